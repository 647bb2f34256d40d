"""The crash matrix of CONTRACT §2 and §6, on both stores, through the real server.

Each case starts `agent-runner serve` armed with one failpoint (or SIGKILLs it while a handler
is in flight), lets it die inside a durable run, reads what was committed from a restarted
server, then resubmits the same session and message and checks the resume: nothing committed
is lost, every orphaned call gets exactly one result (a re-run for `safe_to_retry`, the
durability error otherwise), and no side effect runs twice.

The helpers here are shared with `test_durable_resume.py`.
"""

from __future__ import annotations

import json
import signal
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.agents import write_agents_file
from tests.support.fake_anthropic import FakeAnthropic
from tests.support.server import ServerProcess
from tests.support.tool_server import ToolServer

pytestmark = pytest.mark.crash

Json = dict[str, Any]

SESSION = "s-1"
MESSAGE = "triage issue 42"
SAFE_TOOL = "get_issue"
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


def crash_run(server: ServerProcess, body: Json) -> None:
    """POST `body` to a server armed with a failpoint and see the process die there."""
    with server.client(timeout=30) as client, pytest.raises(httpx.TransportError):
        client.post("/v1/runs", json=body)
    assert server.wait() == FAILPOINT_EXIT, server.logs()


def kill_in_handler(server: ServerProcess, body: Json, tool_server: ToolServer) -> None:
    """POST `body` and SIGKILL the server while its `/slow_post` handler is in flight."""
    with server.client(timeout=30) as client, ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(client.post, "/v1/runs", json=body)
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


def post_run(client: httpx.Client, body: Json) -> Json:
    """POST /v1/runs, expecting 200; the run."""
    response = client.post("/v1/runs", json=body)
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


# --- the matrix -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One crash window and what it must leave behind."""

    id: str  # also the FAILPOINTS value, unless `kill`
    committed: tuple[str, ...]  # roles of the messages committed before the crash
    ran: tuple[str, ...]  # tools invoked before the crash, in order
    model_calls: int = 1  # model requests before the crash
    kill: bool = False  # SIGKILL while the slow handler is in flight instead of a failpoint
    agent: str = "triage"
    side_effect: str = "post_slack"  # the agent's tool that is not safe to retry
    steps: int = 1  # tool steps in the agent's plan

    @property
    def failpoints(self) -> str | None:
        """The server's FAILPOINTS setting."""
        return None if self.kill else self.id


STEP = ("user", "assistant")
STEP_DONE = ("user", "assistant", "tool", "tool")
BOTH = ("get_issue", "post_slack")
CASES = [
    Case("before-write-1", committed=(), ran=()),
    Case("after-write-1", committed=STEP, ran=()),
    Case("after-handlers", committed=STEP, ran=BOTH),
    Case("in-write-2", committed=STEP, ran=BOTH),
    Case("after-write-2", committed=STEP_DONE, ran=BOTH),
    Case("before-final-write", committed=STEP_DONE, ran=BOTH, model_calls=2),
    Case(
        "kill-9-in-handler",
        committed=STEP,
        ran=("get_issue", "slow_post"),
        kill=True,
        agent="slow",
        side_effect="slow_post",
    ),
    # Counting: the second step's write #1; step 1's committed result must survive.
    Case(
        "after-write-1@2",
        committed=("user", "assistant", "tool", "assistant"),
        ran=("get_issue",),
        model_calls=2,
        agent="two-steps",
        steps=2,
    ),
]


@dataclass(frozen=True)
class Crashed:
    """What a crashed run left: the committed history and what ran before the restart."""

    snapshot: list[Json]
    status: str | None
    ran: Counter[tuple[str, str]]  # (tool, call id) -> invocations before the restart
    model_calls: int


def crash(case: Case, server: ServerProcess, tool_server: ToolServer) -> None:
    """Run the case's request on `server` and see it die in the case's window."""
    body = run_body(case.agent)
    if case.kill:
        kill_in_handler(server, body, tool_server)
    else:
        crash_run(server, body)


def check_snapshot(case: Case, crashed: Crashed, tool_server: ToolServer) -> list[Json]:
    """The committed state matches the window; returns the orphaned calls."""
    snapshot = crashed.snapshot
    assert tuple(m["role"] for m in snapshot) == case.committed
    assert [i.tool for i in tool_server.invocations] == list(case.ran)
    assert crashed.model_calls == case.model_calls
    # What ran before the crash ran once each, for calls the crashed turn stored.
    stored_calls = {(c["name"], c["id"]) for m in snapshot for c in m["tool_calls"]}
    assert set(crashed.ran) <= stored_calls
    assert set(crashed.ran.values()) <= {1}
    assert_history_consistent(snapshot, orphans_allowed=True)
    orphans = unanswered_calls(snapshot)
    if orphans:
        assert orphans == snapshot[-1]["tool_calls"]
    if not snapshot:
        # The turn was recorded at its start (session and a running run) but stored no
        # message: the history is as before the turn.
        assert crashed.status == "idle", "a turn that stored no message leaves nothing to repair"
        return orphans
    assert len({m["run_id"] for m in snapshot}) == 1, "one run wrote the crashed turn"
    assert snapshot[0]["content"] == MESSAGE
    assert crashed.status == ("needs_resume" if orphans else "idle")
    return orphans


def check_repairs(
    case: Case,
    crashed: Crashed,
    orphans: list[Json],
    history: list[Json],
    tool_server: ToolServer,
    resumed_request: Json,
) -> list[Json]:
    """Each orphan got its one result; returns the calls that got the durability error."""
    counts = Counter((i.tool, i.tool_call_id) for i in tool_server.invocations)
    # The repair results sit right after the orphaned step, ahead of the new turn.
    repairs = history[len(crashed.snapshot) : len(crashed.snapshot) + len(orphans)]
    assert [m["tool_call_id"] for m in repairs] == [c["id"] for c in orphans]
    if repairs:
        # Repairs belong to the run whose step they answer.
        assert {m["run_id"] for m in repairs} == {crashed.snapshot[-1]["run_id"]}
    seen = model_results(resumed_request)
    errors: list[Json] = []
    for call in orphans:
        key = (call["name"], call["id"])
        stored = result_of(history, call["id"])
        if call["name"] == SAFE_TOOL:
            assert counts[key] == crashed.ran[key] + 1, "a safe_to_retry orphan is re-invoked once"
            assert_real_issue(stored, call)
        else:
            assert call["name"] == case.side_effect
            assert counts[key] == crashed.ran[key], "the side effect was re-invoked by the repair"
            assert_durability_error(stored, call)
            errors.append(call)
        block = seen[call["id"]]
        assert block_text(block) == stored["content"]
        assert block.get("is_error", False) is stored["is_error"]
    return errors


def check_resumed(
    case: Case,
    crashed: Crashed,
    run: Json,
    history: list[Json],
    tool_server: ToolServer,
    errors: list[Json],
) -> None:
    """The resubmitted turn completed, was stored whole, and left the past untouched."""
    assert run["status"] == "complete", run
    assert run["error"] is None
    assert run["response"] == final_text(case.steps, errors)
    assert history[: len(crashed.snapshot)] == crashed.snapshot, "committed history changed"
    assert_history_consistent(history)
    assert [
        m["tool_call_id"] for m in history if m["role"] == "tool" and is_durability_error(m)
    ] == [c["id"] for c in errors]
    turn = history[len(history) - len(run["messages"]) :]
    assert [(m["seq"], m["role"], m["content"]) for m in turn] == [
        (m["seq"], m["role"], m["content"]) for m in run["messages"]
    ]
    assert turn[0]["role"] == "user"
    assert turn[0]["content"] == MESSAGE
    assert {m["run_id"] for m in turn} == {run["run_id"]}
    last = history[-1]
    assert (last["role"], last["content"], last["tool_calls"]) == ("assistant", run["response"], [])
    counts = Counter((i.tool, i.tool_call_id) for i in tool_server.invocations)
    answered = {m["tool_call_id"] for m in crashed.snapshot if m["role"] == "tool"}
    for call in (c for m in crashed.snapshot for c in m["tool_calls"] if c["id"] in answered):
        key = (call["name"], call["id"])
        assert counts[key] == crashed.ran[key] == 1, "a call answered before the crash ran again"
    assert set(tool_server.per_call(case.side_effect).values()) == {1}
    assert_idempotency_keys(tool_server)


def check_runs(client: httpx.Client, crashed: Crashed, run: Json, history: list[Json]) -> None:
    """The crashed run is `interrupted`, the new one `complete`, the session idle again."""
    runs = get_json(client, f"/v1/sessions/{SESSION}/runs")["data"]
    statuses = [(r["run_id"], r["status"]) for r in runs]
    # Every turn is recorded at its start, so the crashed one is listed even when it stored
    # no message (before-write-1): it shows `interrupted`, newest first after the new one.
    assert statuses[0] == (run["run_id"], "complete")
    assert [status for _, status in statuses[1:]] == ["interrupted"]
    interrupted = statuses[1][0]
    if crashed.snapshot:
        assert crashed.snapshot[0]["run_id"] == interrupted
    crashed_run = get_json(client, f"/v1/runs/{interrupted}")
    assert crashed_run["status"] == "interrupted"
    # Its messages: what it stored before the crash, then the repairs made under its id.
    stored = crashed_run["messages"]
    assert [m["seq"] for m in stored[: len(crashed.snapshot)]] == [
        m["seq"] for m in crashed.snapshot
    ]
    assert {m["role"] for m in stored[len(crashed.snapshot) :]} <= {"tool"}
    assert get_json(client, f"/v1/runs/{run['run_id']}")["status"] == "complete"
    session = get_json(client, f"/v1/sessions/{SESSION}")
    assert (session["status"], session["message_count"]) == ("idle", len(history))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_crash_then_resume(
    case: Case,
    tmp_path: Path,
    database_url: str,
    fake_model: FakeAnthropic,
    tool_server: ToolServer,
) -> None:
    """Crash in the case's window, restart, resubmit: complete, nothing lost, nothing twice."""
    server = server_process(
        tmp_path,
        database_url=database_url,
        fake_model=fake_model,
        tool_server=tool_server,
        label="crashed",
        failpoints=case.failpoints,
    )
    with server:
        crash(case, server, tool_server)
    ran = Counter((i.tool, i.tool_call_id) for i in tool_server.invocations)
    model_calls = len(fake_model.requests)
    tool_server.release()  # the next slow_post answers at once
    resumed = server_process(
        tmp_path,
        database_url=database_url,
        fake_model=fake_model,
        tool_server=tool_server,
        label="resumed",
    )
    with resumed, resumed.client() as client:
        crashed = Crashed(list_messages(client), session_status(client), ran, model_calls)
        orphans = check_snapshot(case, crashed, tool_server)
        run = post_run(client, run_body(case.agent))
        history = list_messages(client)
        resumed_request = fake_model.requests[model_calls]
        if not crashed.snapshot:
            # Nothing of the turn was kept: the model is asked again from the prior state.
            assert resumed_request["messages"] == [
                {"role": "user", "content": [{"type": "text", "text": MESSAGE}]}
            ]
        errors = check_repairs(case, crashed, orphans, history, tool_server, resumed_request)
        check_resumed(case, crashed, run, history, tool_server, errors)
        check_runs(client, crashed, run, history)
