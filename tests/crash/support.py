"""What the crash tests share: a real server driven into a crash, and checks of its history."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.agents import write_agents_file
from tests.support.fake_anthropic import FakeAnthropic
from tests.support.server import ServerProcess
from tests.support.tool_server import ToolServer

Json = dict[str, Any]

SESSION = "s-1"
MESSAGE = "triage issue 42"
ISSUE = {"id": "id-1", "title": "Printer on fire", "state": "open"}
FAILPOINT_EXIT = 137
DURABILITY_KIND = "tool-durability-error"
DURABILITY_KEYS = {"error", "kind", "toolName", "toolCallId"}


# --- driving the server ---------------------------------------------------------------------


def server_process(
    tmp_path: Path,
    *,
    database_url: str,
    fake_model: FakeAnthropic,
    tool_server: ToolServer,
    label: str,
    failpoints: str | None = None,
) -> ServerProcess:
    """A server on the test's database, fake model and tool server; logs in `<label>.log`."""
    return ServerProcess(
        database_url=database_url,
        log_path=tmp_path / f"{label}.log",
        agents_file=write_agents_file(tmp_path, tool_server.url),
        model_url=fake_model.url,
        failpoints=failpoints,
    )


def server_maker(
    tmp_path: Path, *, database_url: str, fake_model: FakeAnthropic, tool_server: ToolServer
) -> Callable[..., ServerProcess]:
    """`server_process` with the test's fixtures: call it with `label` (and `failpoints`)."""
    return partial(
        server_process,
        tmp_path,
        database_url=database_url,
        fake_model=fake_model,
        tool_server=tool_server,
    )


def run_body(agent: str, *, session_id: str | None = SESSION, message: str = MESSAGE) -> Json:
    """The body of POST /v1/runs."""
    body: Json = {"agent": agent, "message": message}
    if session_id is not None:
        body["session_id"] = session_id
    return body


def crash_run(server: ServerProcess, body: Json, *, headers: dict[str, str] | None = None) -> None:
    """POST `body` to a server armed with a failpoint and see the process die there."""
    with server.client(timeout=30) as client, pytest.raises(httpx.TransportError):
        client.post("/v1/runs", json=body, headers=headers)
    assert server.wait() == FAILPOINT_EXIT, server.logs()


def kill_in_handler(
    server: ServerProcess,
    body: Json,
    tool_server: ToolServer,
    *,
    headers: dict[str, str] | None = None,
) -> None:
    """POST `body` and SIGKILL the server while its `/slow_post` handler is in flight."""
    with server.client(timeout=30) as client, ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(client.post, "/v1/runs", json=body, headers=headers)
        assert tool_server.in_flight.wait(timeout=30), server.logs()
        server.kill()
        with pytest.raises(httpx.TransportError):
            pending.result(timeout=30)
    assert server.process is not None
    assert server.process.returncode == -signal.SIGKILL


def get_json(client: httpx.Client, url: str, *, status: int = 200) -> Any:
    """GET `url`, check the status, return the parsed body."""
    response = client.get(url)
    assert response.status_code == status, response.text
    return response.json()


def list_messages(client: httpx.Client, session_id: str = SESSION) -> list[Json]:
    """The session's whole history, following the pages; [] when the session does not exist."""
    messages: list[Json] = []
    after: str | None = None
    while True:
        params = {"limit": "200", **({"after": after} if after else {})}
        response = client.get(f"/v1/sessions/{session_id}/messages", params=params)
        if response.status_code == 404 and not messages:
            assert response.json()["code"] == "session_not_found", response.text
            return []
        assert response.status_code == 200, response.text
        page = response.json()
        messages.extend(page["data"])
        after = page["next_after"]
        if after is None:
            return messages


def session_status(client: httpx.Client, session_id: str = SESSION) -> str | None:
    """The session's `status`; None when it does not exist. The list says the same."""
    response = client.get(f"/v1/sessions/{session_id}")
    listed = client.get("/v1/sessions")
    assert listed.status_code == 200, listed.text
    in_list = [s["status"] for s in listed.json()["data"] if s["id"] == session_id]
    if response.status_code == 404:
        assert in_list == []
        return None
    assert response.status_code == 200, response.text
    status: str = response.json()["status"]
    assert in_list == [status]
    return status


def post_run(client: httpx.Client, body: Json, *, headers: dict[str, str] | None = None) -> Json:
    """POST /v1/runs, expecting 200; the run."""
    response = client.post("/v1/runs", json=body, headers=headers)
    assert response.status_code == 200, response.text
    run: Json = response.json()
    return run


# --- what the history must look like --------------------------------------------------------


def assert_seqs(messages: list[Json]) -> None:
    """Seqs are 1..n in order, no gaps."""
    assert [m["seq"] for m in messages] == list(range(1, len(messages) + 1))


def unanswered_calls(messages: list[Json]) -> list[Json]:
    """Tool calls that have no tool message with their id."""
    answered = {m["tool_call_id"] for m in messages if m["role"] == "tool"}
    return [c for m in messages for c in m["tool_calls"] if c["id"] not in answered]


def assert_history_consistent(messages: list[Json], *, orphans_allowed: bool = False) -> None:
    """Seqs 1..n; each tool call answered once, by the tool messages right after its step.

    With `orphans_allowed` (a history read right after a crash) the last message may be an
    assistant message whose calls have no results yet; nothing else may be unanswered.
    """
    assert_seqs(messages)
    call_ids = [c["id"] for m in messages for c in m["tool_calls"]]
    assert len(call_ids) == len(set(call_ids)), "a tool call id appears twice"
    result_ids = [m["tool_call_id"] for m in messages if m["role"] == "tool"]
    assert len(result_ids) == len(set(result_ids)), "a tool call has two results"
    if messages:
        assert messages[0]["role"] == "user"
    index = 0
    while index < len(messages):
        message = messages[index]
        assert message["role"] != "tool", f"tool message seq {message['seq']} follows no step"
        calls = message["tool_calls"]
        if message["role"] == "user" or not calls:
            assert not calls, f"{message['role']} message seq {message['seq']} has tool calls"
            index += 1
            continue
        if orphans_allowed and index == len(messages) - 1:
            return
        results = messages[index + 1 : index + 1 + len(calls)]
        assert [m["role"] for m in results] == ["tool"] * len(calls), (
            f"the step at seq {message['seq']} is not followed by its {len(calls)} results"
        )
        names = {c["id"]: c["name"] for c in calls}
        assert {m["tool_call_id"]: m["tool_name"] for m in results} == names
        index += 1 + len(calls)


def is_durability_error(message: Json) -> bool:
    """Whether a stored tool message is the durability error."""
    try:
        value = json.loads(message["content"])
    except ValueError:
        return False
    return isinstance(value, dict) and value.get("kind") == DURABILITY_KIND


def assert_durability_error(message: Json, call: Json) -> None:
    """`message` is exactly the durability error of `call` (CONTRACT §2)."""
    assert message["role"] == "tool"
    assert message["tool_call_id"] == call["id"]
    assert message["tool_name"] == call["name"]
    assert message["is_error"] is True
    body = json.loads(message["content"])
    assert set(body) == DURABILITY_KEYS
    assert body["kind"] == DURABILITY_KIND
    assert body["toolName"] == call["name"]
    assert body["toolCallId"] == call["id"]
    assert call["name"] in body["error"]
    assert call["id"] in body["error"]


def assert_real_issue(message: Json, call: Json) -> None:
    """`message` is the real `get_issue` result of `call`."""
    assert message["role"] == "tool"
    assert message["tool_call_id"] == call["id"]
    assert message["is_error"] is False
    assert json.loads(message["content"]) == ISSUE


def result_of(messages: list[Json], call_id: str) -> Json:
    """The one tool message answering `call_id`."""
    (found,) = [m for m in messages if m["role"] == "tool" and m["tool_call_id"] == call_id]
    return found


def model_results(request: Json) -> dict[str, Json]:
    """The `tool_result` blocks of one Messages API request, by `tool_use_id`."""
    blocks: dict[str, Json] = {}
    for message in request["messages"]:
        content = message["content"]
        if message["role"] != "user" or isinstance(content, str):
            continue
        for block in content:
            if block.get("type") == "tool_result":
                blocks[block["tool_use_id"]] = block
    return blocks


def block_text(block: Json) -> str:
    """A tool_result's content as text (a string, or a list of text blocks)."""
    content = block.get("content")
    if isinstance(content, list):
        return "".join(b["text"] for b in content if b.get("type") == "text")
    return str(content)


def final_text(steps: int, errors: list[Json]) -> str:
    """The fake model's summary for a turn of `steps` steps that saw these durability errors."""
    names = ",".join(c["name"] for c in errors)
    ids = ",".join(c["id"] for c in errors)
    return f"done after {steps} steps; errors: {names}; durability errors: {ids}"


def assert_idempotency_keys(tool_server: ToolServer, session_id: str = SESSION) -> None:
    """Every tool invocation carried `<session_id>:<tool_call_id>`."""
    for invocation in tool_server.invocations:
        assert invocation.idempotency_key == f"{session_id}:{invocation.tool_call_id}"
