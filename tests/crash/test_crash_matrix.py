"""The crash matrix of CONTRACT §2 and §6, on both stores, through the real server.

Each case starts `agent-runner serve` armed with one failpoint (or SIGKILLs it while a handler
is in flight), lets it die inside a durable run, reads what was committed from a restarted
server, then resubmits the same session and message and checks the resume: nothing committed
is lost, every orphaned call gets exactly one result (a re-run for `safe_to_retry`, the
durability error otherwise), and no side effect runs twice. Each case runs twice: resubmitted
without an Idempotency-Key (a new turn; the crashed run `interrupted`), and with the crashed
request's key (§4: the same turn continued under its run_id, its user message stored once).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.crash.support import (
    MESSAGE,
    SESSION,
    Json,
    assert_durability_error,
    assert_history_consistent,
    assert_idempotency_keys,
    assert_real_issue,
    block_text,
    crash_run,
    final_text,
    get_json,
    is_durability_error,
    kill_in_handler,
    list_messages,
    model_results,
    post_run,
    result_of,
    run_body,
    server_process,
    session_status,
    unanswered_calls,
)
from tests.support.fake_anthropic import FakeAnthropic
from tests.support.server import ServerProcess
from tests.support.tool_server import ToolServer

pytestmark = pytest.mark.crash

SAFE_TOOL = "get_issue"
KEY = {"Idempotency-Key": "turn-1"}


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


def crash(
    case: Case, server: ServerProcess, tool_server: ToolServer, *, headers: dict[str, str] | None
) -> None:
    """Run the case's request on `server` and see it die in the case's window."""
    body = run_body(case.agent)
    if case.kill:
        kill_in_handler(server, body, tool_server, headers=headers)
    else:
        crash_run(server, body, headers=headers)


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
            sent = [i.body for i in tool_server.invocations if i.tool_call_id == call["id"]]
            assert sent == [call["arguments"]] * counts[key], "re-invoked with other arguments"
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
    assert set(tool_server.per_call(case.side_effect).values()) <= {1}
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
    # Its stop reason is stored with the turn's end, which it never reached.
    assert (crashed_run["status"], crashed_run["stop_reason"]) == ("interrupted", None)
    # Its messages: what it stored before the crash, then the repairs made under its id.
    stored = crashed_run["messages"]
    assert [m["seq"] for m in stored[: len(crashed.snapshot)]] == [
        m["seq"] for m in crashed.snapshot
    ]
    assert {m["role"] for m in stored[len(crashed.snapshot) :]} <= {"tool"}
    assert get_json(client, f"/v1/runs/{run['run_id']}")["status"] == "complete"
    session = get_json(client, f"/v1/sessions/{SESSION}")
    assert (session["status"], session["message_count"]) == ("idle", len(history))


def check_continued(
    client: httpx.Client, case: Case, crashed: Crashed, run: Json, history: list[Json]
) -> None:
    """The keyed resubmission continued the crashed turn: one run, `complete`, holding the
    whole turn and its one user message; the same key again answers its record."""
    runs = get_json(client, f"/v1/sessions/{SESSION}/runs")["data"]
    assert [(r["run_id"], r["status"]) for r in runs] == [(run["run_id"], "complete")]
    if crashed.snapshot:
        assert crashed.snapshot[0]["run_id"] == run["run_id"]
    assert [m["seq"] for m in run["messages"]] == [m["seq"] for m in history]
    assert [m["content"] for m in history if m["role"] == "user"] == [MESSAGE]
    replayed = client.post("/v1/runs", json=run_body(case.agent), headers=KEY)
    assert replayed.status_code == 200, replayed.text
    assert replayed.headers.get("idempotent-replayed") == "true"
    assert replayed.json() == run
    session = get_json(client, f"/v1/sessions/{SESSION}")
    assert (session["status"], session["message_count"]) == ("idle", len(history))


@pytest.mark.parametrize("keyed", [False, True], ids=["no-key", "keyed"])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_crash_then_resume(
    case: Case,
    keyed: bool,
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
    headers = KEY if keyed else None
    with server:
        crash(case, server, tool_server, headers=headers)
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
        run = post_run(client, run_body(case.agent), headers=headers)
        history = list_messages(client)
        resumed_request = fake_model.requests[model_calls]
        if not crashed.snapshot:
            # Nothing of the turn was kept: the model is asked again from the prior state.
            assert resumed_request["messages"] == [
                {"role": "user", "content": [{"type": "text", "text": MESSAGE}]}
            ]
        errors = check_repairs(case, crashed, orphans, history, tool_server, resumed_request)
        check_resumed(case, crashed, run, history, tool_server, errors)
        if keyed:
            check_continued(client, case, crashed, run, history)
        else:
            check_runs(client, crashed, run, history)
            # A new turn with the same message: it posts (once) whatever the crashed one did.
            assert set(tool_server.per_call(case.side_effect).values()) == {1}
