"""AnthropicLLMClient driving the real SDK against the local fake Messages API."""

from __future__ import annotations

import json
import logging
import re
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anthropic
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app.domain import Message, ToolCall, ToolResult, durability_error
from app.llm.anthropic import AnthropicLLMClient
from app.llm.base import LLMError, ModelRequest
from app.serving import ThreadedServer
from tests.support.fake_anthropic import FakeAnthropic
from tests.unit.adapter_support import ISSUE, SLACK, answer, failure, request


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeAnthropic]:
    with FakeAnthropic() as server:
        yield server


@pytest.fixture(autouse=True)
def _clean_fake(fake: FakeAnthropic) -> None:
    fake.reset()


@pytest.fixture
async def llm(fake: FakeAnthropic) -> AsyncIterator[AnthropicLLMClient]:
    client = AnthropicLLMClient(max_retries=0, timeout_s=5, api_key="test-key", base_url=fake.url)
    yield client
    await client.aclose()


def tool_history() -> list[Message]:
    """A turn's first two steps: two calls (one failed), then one call with blank text."""
    issue = ToolCall("toolu_a", "get_issue", {"id": "1"})
    slack = ToolCall("toolu_b", "post_slack", {"channel": "#ops", "urgent": True})
    again = ToolCall("toolu_c", "get_issue", {"id": "2"})
    return [
        Message.user("triage issue 1"),
        Message.assistant("Looking.", tool_calls=[issue, slack]),
        Message.tool(ToolResult.ok(issue, value={"title": "broken"})),
        Message.tool(ToolResult.error(slack, message="channel not found")),
        Message.assistant("", tool_calls=[again]),
        Message.tool(ToolResult.ok(again, value={"title": "ok"})),
    ]


async def test_multi_step_history_groups_tool_results(
    llm: AnthropicLLMClient, fake: FakeAnthropic
) -> None:
    response = await llm.complete(request(tool_history(), tools=[ISSUE, SLACK]))

    assert response.text == "echo: triage issue 1"
    (body,) = fake.requests
    assert body["system"] == "You triage issues."
    assert body["max_tokens"] == 256
    assert body["tools"] == [
        {"name": t.name, "description": t.description, "input_schema": t.input_schema}
        for t in (ISSUE, SLACK)
    ]
    messages = body["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant", "user"]
    assert messages[1]["content"] == [
        {"type": "text", "text": "Looking."},
        {"type": "tool_use", "id": "toolu_a", "name": "get_issue", "input": {"id": "1"}},
        {
            "type": "tool_use",
            "id": "toolu_b",
            "name": "post_slack",
            "input": {"channel": "#ops", "urgent": True},
        },
    ]
    assert messages[2]["content"] == [
        {"type": "tool_result", "tool_use_id": "toolu_a", "content": '{"title":"broken"}'},
        {
            "type": "tool_result",
            "tool_use_id": "toolu_b",
            "content": json.dumps({"error": "channel not found"}),
            "is_error": True,
        },
    ]
    # Empty assistant text yields no text block: the API rejects empty text blocks.
    assert [b["type"] for b in messages[3]["content"]] == ["tool_use"]


async def test_repaired_results_merge_with_the_next_user_text(
    llm: AnthropicLLMClient, fake: FakeAnthropic
) -> None:
    slack = ToolCall("toolu_x", "post_slack", {"channel": "#ops", "urgent": True})
    history = [
        Message.user("post it"),
        Message.assistant("", tool_calls=[slack]),
        Message.tool(durability_error("post_slack", tool_call_id="toolu_x")),
        Message.user("post it"),
    ]

    # steps:0 answers the summary at once: what the model learned in this turn.
    response = await llm.complete(request(history, model="steps:0:post_slack", tools=[SLACK]))

    assert response.text == "done after 0 steps; errors: post_slack; durability errors: toolu_x"
    messages = fake.requests[0]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    last = messages[2]["content"]
    assert [b["type"] for b in last] == ["tool_result", "text"]
    assert last[0]["is_error"] is True
    assert json.loads(last[0]["content"])["kind"] == "tool-durability-error"
    assert last[1] == {"type": "text", "text": "post it"}


async def test_blank_assistant_message_is_skipped(
    llm: AnthropicLLMClient, fake: FakeAnthropic
) -> None:
    history = [Message.user("first"), Message.assistant("  "), Message.user("second")]

    response = await llm.complete(request(history))

    assert response.text == "echo: first\nsecond"
    (message,) = fake.requests[0]["messages"]
    assert message["content"] == [
        {"type": "text", "text": "first"},
        {"type": "text", "text": "second"},
    ]


async def test_tool_calls_and_usage_are_parsed(
    llm: AnthropicLLMClient, fake: FakeAnthropic
) -> None:
    response = await llm.complete(
        request([Message.user("go")], model="plan:get_issue,post_slack", tools=[ISSUE, SLACK])
    )

    assert response.stop_reason == "tool_use"
    assert response.text == "step 1"
    assert [(c.name, c.arguments) for c in response.tool_calls] == [
        ("get_issue", {"id": "id-1"}),
        ("post_slack", {"channel": "channel-1", "urgent": True}),
    ]
    assert all(c.id.startswith("toolu_") and len(c.id) == 30 for c in response.tool_calls)
    sent = fake.requests[0]["messages"]
    outputs = len("step 1") + sum(len(json.dumps(c.arguments)) for c in response.tool_calls)
    assert response.usage.input_tokens == len(json.dumps(sent)) // 4 + 1
    assert response.usage.output_tokens == outputs // 4 + 1


async def test_final_answer_and_omitted_optionals(
    llm: AnthropicLLMClient, fake: FakeAnthropic
) -> None:
    plain = ModelRequest("echo", None, [Message.user("hello")], [], 64)

    response = await llm.complete(plain)

    assert (response.text, response.tool_calls, response.stop_reason) == (
        "echo: hello",
        [],
        "end_turn",
    )
    assert "system" not in fake.requests[0]
    assert "tools" not in fake.requests[0]
    assert "tool_choice" not in fake.requests[0]


async def test_a_system_prompt_of_white_space_is_left_out(
    llm: AnthropicLLMClient, fake: FakeAnthropic
) -> None:
    # The API refuses it (the fake as well): every run of such an agent failed.
    response = await llm.complete(ModelRequest("echo", " \n\t", [Message.user("hi")], [], 64))

    assert response.text == "echo: hi"
    assert "system" not in fake.requests[0]


async def test_history_with_tool_calls_and_no_tools_left_gets_stand_ins(
    llm: AnthropicLLMClient, fake: FakeAnthropic
) -> None:
    # The API refuses a history with tool_use/tool_result blocks when the request defines no
    # tools: an agent whose tools were all removed from the agents file could never continue
    # a session that had used them.
    history = [*tool_history(), Message.assistant("Done."), Message.user("anything else?")]

    response = await llm.complete(request(history, model="plan:get_issue"))

    assert (response.text, response.tool_calls) == ("echo: anything else?", [])
    (body,) = fake.requests
    assert [t["name"] for t in body["tools"]] == ["get_issue", "post_slack"]
    assert all(t["input_schema"] == {"type": "object"} for t in body["tools"])
    assert body["tool_choice"] == {"type": "none"}  # the model may call none of them


async def test_without_tool_calls_in_history_no_tools_are_sent(
    llm: AnthropicLLMClient, fake: FakeAnthropic
) -> None:
    history = [Message.user("a"), Message.assistant("b"), Message.user("c")]

    await llm.complete(request(history))

    assert "tools" not in fake.requests[0]
    assert "tool_choice" not in fake.requests[0]


@pytest.mark.parametrize(
    ("status", "error_type", "retryable"),
    [
        (529, "overloaded_error", True),
        (429, "rate_limit_error", True),
        (500, "api_error", True),
        (400, "invalid_request_error", False),
        (401, "authentication_error", False),
    ],
)
async def test_api_errors_map_to_llm_error(
    llm: AnthropicLLMClient, fake: FakeAnthropic, status: int, error_type: str, retryable: bool
) -> None:
    fake.fail_next(1, status, error_type)

    with pytest.raises(LLMError) as caught:
        await llm.complete(request([Message.user("hi")]))

    assert caught.value.type == error_type
    assert caught.value.retryable is retryable
    assert str(status) in caught.value.message
    # The API's request id, which its support asks for, ends the message.
    assert re.search(r" \(request-id req_[0-9a-f]{24}\)$", caught.value.message), caught.value
    assert len(fake.requests) == 1


async def test_sdk_retry_recovers_from_one_overload(fake: FakeAnthropic) -> None:
    fake.fail_next(1, 529, "overloaded_error")
    llm = AnthropicLLMClient(max_retries=1, timeout_s=5, api_key="k", base_url=fake.url)
    try:
        response = await llm.complete(request([Message.user("hi")]))
    finally:
        await llm.aclose()

    assert response.text == "echo: hi"
    assert len(fake.requests) == 2


async def test_retries_exhausted_raise_the_last_error(fake: FakeAnthropic) -> None:
    error = await failure(fake.url, max_retries=1, model="fail:529")

    assert (error.type, error.retryable) == ("overloaded_error", True)
    assert len(fake.requests) == 2


async def test_connection_refused_is_a_connection_error() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # Nothing listens on the port any more.
    error = await failure(f"http://127.0.0.1:{port}")

    assert (error.type, error.retryable) == ("api_connection_error", True)
    assert error.message.startswith("The connection to the model API failed")


async def test_an_answer_cut_off_midway_is_a_connection_error() -> None:
    # It was reported as "Could not connect to the model API.", sending an operator to look
    # for a network problem that was not there.
    def answer_half(listener: socket.socket) -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                b"content-length: 500\r\n\r\n" + answer()[:40]
            )

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        server = threading.Thread(target=answer_half, args=(listener,), daemon=True)
        server.start()
        error = await failure(f"http://127.0.0.1:{listener.getsockname()[1]}")
        server.join(5)

    assert (error.type, error.retryable) == ("api_connection_error", True)
    assert "or it broke before the answer was complete" in error.message


async def test_slow_answer_is_a_timeout(fake: FakeAnthropic) -> None:
    fake.set_delay(2)
    error = await failure(fake.url, timeout_s=0.2)

    assert (error.type, error.retryable) == ("api_timeout", True)


async def test_the_timeout_bounds_the_whole_call_with_its_retries() -> None:
    # A 429 asking to wait 100 s: the SDK would sleep that long before each retry.
    async def messages(_: Request) -> Response:
        body = {"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}
        return JSONResponse(body, status_code=429, headers={"retry-after": "100"})

    app = Starlette(routes=[Route("/v1/messages", messages, methods=["POST"])])
    with ThreadedServer(app, name="slow-429") as server:
        started = time.monotonic()
        error = await failure(server.url, max_retries=2, timeout_s=1)
        took = time.monotonic() - started

    assert error.type == "api_timeout"
    assert took < 10, f"the call took {took:.1f} s against a 1 s timeout"
    # It said "timed out" only: an operator looked for a slow API, not a long Retry-After.
    assert error.message.startswith("The model call did not finish within ANTHROPIC_TIMEOUT_S")


async def test_fake_rejects_tool_use_without_its_result(
    llm: AnthropicLLMClient, fake: FakeAnthropic
) -> None:
    orphan = ToolCall("toolu_orphan", "post_slack", {"channel": "#ops", "urgent": True})
    history = [
        Message.user("post"),
        Message.assistant("", tool_calls=[orphan]),
        Message.user("again"),
    ]

    with pytest.raises(LLMError) as caught:
        await llm.complete(request(history))

    assert (caught.value.type, caught.value.retryable) == ("invalid_request_error", False)
    assert "`tool_use` ids were found without `tool_result` blocks" in caught.value.message
    assert "toolu_orphan" in caught.value.message


@pytest.fixture
def no_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    """An environment without any Anthropic credential, profile or config on disk."""
    for name in (
        "ANTHROPIC_API_KEY",
        "ANTHROPIC_AUTH_TOKEN",
        "ANTHROPIC_PROFILE",
        "ANTHROPIC_CONFIG_DIR",
        "ANTHROPIC_FEDERATION_RULE_ID",
        "ANTHROPIC_IDENTITY_TOKEN",
        "ANTHROPIC_IDENTITY_TOKEN_FILE",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # the SDK looks for profiles under ~/.config
    return monkeypatch


async def test_without_key_or_url_the_sdk_environment_applies(
    fake: FakeAnthropic, no_credentials: pytest.MonkeyPatch
) -> None:
    no_credentials.setenv("ANTHROPIC_BASE_URL", fake.url)

    llm = AnthropicLLMClient(max_retries=0, timeout_s=5)
    try:
        response = await llm.complete(request([Message.user("offline")]))
    finally:
        await llm.aclose()

    # Construction never fails offline; the placeholder key reaches the API, which decides.
    assert response.text == "echo: offline"
    assert len(fake.requests) == 1


async def test_a_failed_call_without_any_credential_says_none_is_set(
    fake: FakeAnthropic, no_credentials: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Offline, such a call failed as api_connection_error with no word of the key.
    fake.fail_next(1, 401)
    with caplog.at_level(logging.WARNING, logger="app.llm.anthropic"):
        llm = AnthropicLLMClient(max_retries=0, timeout_s=5, base_url=fake.url)
    assert [r.getMessage() for r in caplog.records] == [
        "no Anthropic credential is set (ANTHROPIC_API_KEY): calls of agents on API models"
        " will fail"
    ]
    try:
        with pytest.raises(LLMError) as caught:
            await llm.complete(request([Message.user("offline")]))
    finally:
        await llm.aclose()

    assert caught.value.type == "authentication_error"
    assert caught.value.message.endswith(" (No Anthropic credential is set: ANTHROPIC_API_KEY.)"), (
        caught.value.message
    )


async def test_broken_profile_still_constructs(
    fake: FakeAnthropic, no_credentials: pytest.MonkeyPatch
) -> None:
    no_credentials.setenv("ANTHROPIC_PROFILE", "missing")

    llm = AnthropicLLMClient(max_retries=0, timeout_s=5, base_url=fake.url)
    try:
        response = await llm.complete(request([Message.user("offline")]))
    finally:
        await llm.aclose()

    assert response.text == "echo: offline"


@pytest.mark.parametrize(("timeout_s", "connect_s"), [(600, 5.0), (2, 2)])
async def test_an_attempt_waits_for_its_connection_no_longer_than_the_sdks_usual(
    timeout_s: float, connect_s: float
) -> None:
    # ANTHROPIC_TIMEOUT_S was every phase's timeout: a host dropping packets held the first
    # attempt's connect for the whole budget, and the SDK's retries never came.
    llm = AnthropicLLMClient(max_retries=2, timeout_s=timeout_s, api_key="k")
    try:
        timeout = llm._client.timeout  # the SDK client this adapter built
    finally:
        await llm.aclose()
    assert isinstance(timeout, anthropic.Timeout)
    assert (timeout.connect, timeout.read, timeout.write) == (connect_s, timeout_s, timeout_s)


# Older SDKs in our range warn that this model is deprecated; it is still one they cap.
@pytest.mark.filterwarnings("ignore:The model 'claude-opus-4-20250514' is deprecated")
@pytest.mark.parametrize("model", ["echo", "claude-opus-4-20250514"])
async def test_a_large_max_tokens_is_sent_with_the_default_timeout(
    fake: FakeAnthropic, model: str
) -> None:
    # With ANTHROPIC_TIMEOUT_S at its default (the SDK's own), the SDK refused such a request
    # unsent ("streaming is required"), and the run ended `error` blaming the API's answer.
    llm = AnthropicLLMClient(max_retries=0, timeout_s=600, api_key="k", base_url=fake.url)
    try:
        response = await llm.complete(
            request([Message.user("long answer")], model=model, max_tokens=64_000)
        )
    finally:
        await llm.aclose()
    assert response.text == "echo: long answer"
    assert [r["max_tokens"] for r in fake.requests] == [64_000]
