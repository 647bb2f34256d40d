"""The fake Messages API itself: scenario logic, validation, control endpoints, process mode."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.fake_anthropic import FakeAnthropic
from tests.support.fake_anthropic_replies import scenario_reply
from tests.support.fake_anthropic_validation import InvalidRequest, validate

TOOLS = [
    {
        "name": "get_issue",
        "description": "Fetch",
        "input_schema": {
            "type": "object",
            "properties": {
                "id": {"type": "string"},
                "limit": {"type": "integer"},
                "closed": {"type": "boolean"},
                "labels": {"type": "array"},
                "extra": {"type": "object"},
                "mode": {"type": "string", "enum": ["fast", "slow"]},
                "note": {"type": "string"},
            },
            "required": ["id", "limit", "closed", "labels", "extra", "mode"],
        },
    },
    {"name": "post_slack", "description": "Post", "input_schema": {"type": "object"}},
]


def body(model: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": model, "max_tokens": 100, "messages": messages, "tools": TOOLS}


def user(*blocks: Any) -> dict[str, Any]:
    return {"role": "user", "content": list(blocks)}


def text(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value}


def result(call_id: str, content: Any, *, is_error: bool = False) -> dict[str, Any]:
    block = {"type": "tool_result", "tool_use_id": call_id, "content": content}
    return {**block, "is_error": True} if is_error else block


def replay(model: str, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Play the scenario to its final answer, answering every call with `{"ok": true}`."""
    while True:
        request = body(model, messages)
        validate(request)
        reply = scenario_reply(request)
        messages = [*messages, {"role": "assistant", "content": reply["content"]}]
        calls = [b["id"] for b in reply["content"] if b["type"] == "tool_use"]
        if reply["stop_reason"] == "end_turn":
            return messages
        messages.append(user(*(result(c, '{"ok":true}') for c in calls)))


def test_echo_answers_the_current_user_text() -> None:
    reply = scenario_reply(body("claude-whatever", [user(text("hello"))]))

    assert reply["content"] == [{"type": "text", "text": "echo: hello"}]
    assert reply["stop_reason"] == "end_turn"
    assert reply["type"] == "message" and reply["id"].startswith("msg_")


@pytest.mark.parametrize("stop_reason", ["max_tokens", "refusal", "pause_turn"])
def test_stopped_answers_text_only_with_that_stop_reason(stop_reason: str) -> None:
    reply = scenario_reply(body(f"stopped:{stop_reason}", [user(text("tell me everything"))]))

    assert reply["content"] == [{"type": "text", "text": "echo: tell m"}]  # cut short
    assert reply["stop_reason"] == stop_reason


def test_plan_runs_its_steps_then_summarises() -> None:
    messages = replay("plan:get_issue,post_slack;post_slack", [user(text("go"))])

    steps = [m["content"] for m in messages if m["role"] == "assistant"]
    assert [[b.get("name") for b in s if b["type"] == "tool_use"] for s in steps] == [
        ["get_issue", "post_slack"],
        ["post_slack"],
        [],
    ]
    assert steps[0][0] == text("step 1")
    assert steps[2] == [text("done after 2 steps; errors: ; durability errors: ")]


def test_input_is_filled_from_the_schema() -> None:
    reply = scenario_reply(body("steps:3:get_issue", [user(text("go"))]))

    (call,) = [b for b in reply["content"] if b["type"] == "tool_use"]
    assert call["input"] == {
        "id": "id-1",
        "limit": 1,
        "closed": True,
        "labels": [],
        "extra": {},
        "mode": "fast",
    }
    assert len(call["id"]) == len("toolu_") + 24


def test_steps_model_and_a_new_turn_restarts_the_plan() -> None:
    first = replay("steps:3:post_slack", [user(text("one"))])
    assert first[-1]["content"] == [text("done after 3 steps; errors: ; durability errors: ")]

    second = replay("steps:3:post_slack", [*first, user(text("two"))])
    assert len(second) == len(first) + 1 + 7  # the user text, 3 steps with results, the answer


def test_tool_results_alone_do_not_start_a_turn() -> None:
    call = {"type": "tool_use", "id": "toolu_1", "name": "post_slack", "input": {}}
    messages = [
        user(text("go")),
        {"role": "assistant", "content": [text("step 1"), call]},
        user(result("toolu_1", "{}")),
    ]

    reply = scenario_reply(body("plan:post_slack;post_slack", messages))

    assert reply["content"][0] == text("step 2")


def test_summary_lists_error_tools_and_durability_errors() -> None:
    durable = json.dumps({"kind": "tool-durability-error", "toolCallId": "toolu_2"})
    calls = [
        {"type": "tool_use", "id": "toolu_1", "name": "get_issue", "input": {}},
        {"type": "tool_use", "id": "toolu_2", "name": "post_slack", "input": {}},
    ]
    messages = [
        user(text("go")),
        {"role": "assistant", "content": [text("step 1"), *calls]},
        user(
            result("toolu_1", '{"error": "boom"}', is_error=True),
            # Content as a list of text blocks is legal too.
            result("toolu_2", [text(durable)], is_error=True),
        ),
    ]

    reply = scenario_reply(body("plan:get_issue,post_slack", messages))

    assert reply["content"] == [
        text("done after 1 steps; errors: get_issue,post_slack; durability errors: toolu_2")
    ]


def test_usage_follows_the_documented_formula() -> None:
    messages = [user(text("hello"))]

    reply = scenario_reply(body("echo", messages))

    assert reply["usage"] == {
        "input_tokens": len(json.dumps(messages)) // 4 + 1,
        "output_tokens": len("echo: hello") // 4 + 1,
    }


@pytest.mark.parametrize(
    ("request_body", "message"),
    [
        ({"max_tokens": 1, "messages": [user(text("x"))]}, "model: Field required"),
        ({"model": "echo", "messages": [user(text("x"))]}, "max_tokens: Field required"),
        ({"model": "echo", "max_tokens": 1, "messages": []}, "at least one message"),
        (
            body("echo", [{"role": "assistant", "content": "hi"}]),
            'first message must use the "user" role',
        ),
        (body("echo", [user(text("a")), user(text("b"))]), 'multiple "user" roles in a row'),
        (body("echo", [user(text(""))]), "text content blocks must be non-empty"),
        (
            body(
                "echo",
                [
                    user(text("a")),
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "t1", "name": "x", "input": {}}],
                    },
                    user(text("b")),
                ],
            ),
            "`tool_use` ids were found without `tool_result` blocks immediately after: t1",
        ),
        (
            body(
                "echo",
                [
                    user(text("a")),
                    {"role": "assistant", "content": [text("no tools")]},
                    user(result("t9", "{}")),
                ],
            ),
            "unexpected `tool_use_id` found in `tool_result` blocks: t9",
        ),
        (
            body(
                "echo",
                [
                    user(text("a")),
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "t1", "name": "x", "input": {}}],
                    },
                    user(text("b"), result("t1", "{}")),
                ],
            ),
            "`tool_result` blocks must come first",
        ),
        (
            body("echo", [{"role": "user", "content": "a", "seq": 1}]),
            "messages.0.seq: Extra inputs are not permitted",
        ),
        (
            body("echo", [user({**text("a"), "is_error": False})]),
            "messages.0.content.0.text.is_error: Extra inputs are not permitted",
        ),
        (
            body(
                "echo",
                [
                    user(text("a")),
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "t1", "name": "x", "input": {}}],
                    },
                    user(result("t1", {"ok": True})),
                ],
            ),
            "tool_result.content: Input should be a string or a list of blocks",
        ),
        (
            {**body("echo", [user(text("a"))]), "tools": [{"name": "x", "input_schema": {}}]},
            "tools.0.input_schema.type: Input should be 'object'",
        ),
    ],
)
def test_validation_rejects_what_the_api_rejects(
    request_body: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidRequest) as caught:
        validate(request_body)

    assert message in str(caught.value)


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeAnthropic]:
    with FakeAnthropic() as server:
        yield server


def test_control_endpoints_over_http(fake: FakeAnthropic) -> None:
    with httpx.Client(base_url=fake.url) as http:
        assert http.post("/_reset").status_code == 200
        spec = {"count": 1, "status": 529, "error_type": "overloaded_error"}
        assert http.post("/_fail_next", json=spec).status_code == 200

        failed = http.post("/v1/messages", json=body("echo", [user(text("hi"))]))
        answered = http.post("/v1/messages", json=body("echo", [user(text("hi"))]))
        recorded = http.get("/_requests").json()

    assert failed.status_code == 529
    assert failed.json()["type"] == "error"
    assert failed.json()["error"]["type"] == "overloaded_error"
    assert failed.headers["retry-after-ms"] == "10"
    assert answered.json()["content"] == [text("echo: hi")]
    assert len(recorded) == 2 and recorded == fake.requests


def test_fail_model_and_bad_requests_over_http(fake: FakeAnthropic) -> None:
    fake.reset()
    with httpx.Client(base_url=fake.url) as http:
        limited = http.post("/v1/messages", json=body("fail:429", [user(text("hi"))]))
        invalid = http.post("/v1/messages", json={"model": "echo"})

    assert (limited.status_code, limited.json()["error"]["type"]) == (429, "rate_limit_error")
    assert (invalid.status_code, invalid.json()["error"]["type"]) == (400, "invalid_request_error")


def test_runs_as_a_process() -> None:
    command = [sys.executable, "-m", "tests.support.fake_anthropic", "--port", "0"]
    root = Path(__file__).resolve().parents[2]  # where `tests` is importable from
    with subprocess.Popen(command, cwd=root, stdout=subprocess.PIPE, text=True) as process:
        try:
            assert process.stdout is not None
            url = process.stdout.readline().split()[-1]
            with httpx.Client(base_url=url) as http:
                http.post("/v1/messages", json=body("echo", [user(text("hi"))]))
                assert len(http.get("/_requests").json()) == 1
        finally:
            process.terminate()
            process.wait(timeout=10)
