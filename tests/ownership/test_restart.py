"""After a crash: runs tell the truth, a restart releases, and a resubmission resumes (§4)."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import httpx
import pytest
from sqlalchemy import Connection, select, update

from app.db.models import Run
from app.db.session import Database
from tests.ownership.conftest import Servers
from tests.ownership.helpers import (
    Background,
    assert_busy,
    assert_durability_error,
    assert_history_consistent,
    history,
    ok,
    result_of,
    run_body,
    run_status,
    session_runs,
    session_status,
    tool_calls,
    user_messages,
)
from tests.support.fake_anthropic import FakeAnthropic
from tests.support.polling import wait_for
from tests.support.server import ServerProcess
from tests.support.tool_server import ToolServer

pytestmark = pytest.mark.crash

FAILPOINT_EXIT = 137


def crash_with_failpoint(
    server: ServerProcess, body: dict[str, object], headers: dict[str, str] | None = None
) -> None:
    """POST `body` to a server armed with a failpoint and see the process die there."""
    with server.client(timeout=30) as client, pytest.raises(httpx.TransportError):
        client.post("/v1/runs", json=body, headers=headers)
    assert server.wait() == FAILPOINT_EXIT, server.logs()


def test_kill_mid_handler_then_restart_and_resubmit_without_key(
    servers: Servers, tool_server: ToolServer
) -> None:
    """The crashed run reads `interrupted`, the session `needs_resume`; a restart releases the
    session at once, and a resubmission without a key repairs orphans and starts a new turn."""
    session, message = "s-restart", "Post the slow report"
    body = run_body("slow", message, session)
    crashed = servers.start("crashed")
    on_crashed = Background(crashed.url, body)
    assert tool_server.in_flight.wait(15), crashed.logs()
    crashed.kill()
    assert isinstance(on_crashed.join(5), httpx.TransportError)
    tool_server.release()  # the new turn posts again (a new call); it must not block
    (issue,) = [i for i in tool_server.invocations if i.tool == "get_issue"]
    (slow,) = [i for i in tool_server.invocations if i.tool == "slow_post"]

    with servers.start("restarted").client() as client:
        (crashed_run,) = session_runs(client, session)
        crashed_id = crashed_run["run_id"]
        assert crashed_run["status"] == "interrupted", crashed_run
        assert run_status(client, crashed_id) == "interrupted"
        assert session_status(client, session) == "needs_resume"
        before = history(client, session)
        assert {m["run_id"] for m in before} == {crashed_id}

        run = ok(client.post("/v1/runs", json=body))  # at once: the dead runner holds nothing
        messages = history(client, session)
        assert session_status(client, session) == "idle"
        crashed_after = ok(client.get(f"/v1/runs/{crashed_id}"))

    assert run["status"] == "complete", run
    assert run["run_id"] != crashed_id
    assert crashed_after["status"] == "interrupted"
    assert crashed_after["finished_at"] is not None
    users = user_messages(messages, message)
    assert [m["run_id"] for m in users] == [crashed_id, run["run_id"]]
    assert tool_server.per_call("slow_post")[slow.tool_call_id] == 1
    assert tool_server.count("slow_post") == 2  # the killed call once, and the new turn's call
    assert messages[: len(before)] == before  # the resume kept what was committed
    assert_durability_error(
        result_of(messages, slow.tool_call_id), tool="slow_post", call_id=slow.tool_call_id
    )
    assert tool_server.per_call("get_issue")[issue.tool_call_id] == 2  # safe_to_retry: re-run
    assert result_of(messages, issue.tool_call_id)["is_error"] is False
    assert messages[: len(before)] == before
    assert_history_consistent(messages)


def crash_keyed_turn(
    servers: Servers, failpoint: str, body: dict[str, object], key: str
) -> ServerProcess:
    """Crash a keyed turn at `failpoint`; a restarted server without failpoints."""
    crash_with_failpoint(
        servers.start("crashed", failpoints=failpoint), body, {"Idempotency-Key": key}
    )
    return servers.start("restarted")


def test_interrupted_keyed_turn_after_handlers_is_continued(
    servers: Servers, fake_model: FakeAnthropic, tool_server: ToolServer
) -> None:
    """Same key after a crash past the handlers: the same run goes on, orphans repaired."""
    session, message, key = "s-keyed-handlers", "Triage issue 21", "turn-21"
    body = run_body("triage", message, session)
    restarted = crash_keyed_turn(servers, "after-handlers", body, key)
    (issue,) = [i for i in tool_server.invocations if i.tool == "get_issue"]
    (post,) = [i for i in tool_server.invocations if i.tool == "post_slack"]
    with restarted.client() as client:
        (crashed,) = session_runs(client, session)
        assert {m["run_id"] for m in history(client, session)} == {crashed["run_id"]}
        response = client.post("/v1/runs", json=body, headers={"Idempotency-Key": key})
        run = ok(response)
        messages = history(client, session)
        model_calls = len(fake_model.requests)
        replay = client.post("/v1/runs", json=body, headers={"Idempotency-Key": key})
    assert "idempotent-replayed" not in response.headers
    assert run["run_id"] == crashed["run_id"]
    assert run["status"] == "complete", run
    assert (crashed["stop_reason"], run["stop_reason"]) == (None, "end_turn")
    assert [m["run_id"] for m in user_messages(messages, message)] == [run["run_id"]]
    assert {m["run_id"] for m in messages} == {run["run_id"]}
    assert tool_server.per_call("post_slack")[post.tool_call_id] == 1
    assert_durability_error(
        result_of(messages, post.tool_call_id), tool="post_slack", call_id=post.tool_call_id
    )
    assert tool_server.per_call("get_issue")[issue.tool_call_id] == 2
    assert result_of(messages, issue.tool_call_id)["is_error"] is False
    assert len(tool_server.invocations) == 3
    assert_history_consistent(messages)
    assert replay.headers.get("idempotent-replayed") == "true"
    assert ok(replay) == run
    assert len(fake_model.requests) == model_calls


def test_interrupted_keyed_turn_before_write_1_is_continued(
    servers: Servers, tool_server: ToolServer
) -> None:
    """Same key after a crash before write #1: the same run goes on, its message stored once
    (on a session with a past: the turn's own user message is what counts, not any)."""
    session, message, key = "s-keyed-write-1", "Triage issue 22", "turn-22"
    with servers.new("earlier") as earlier, earlier.client() as client:
        past_run = ok(client.post("/v1/runs", json=run_body("triage", "Triage issue 0", session)))
        past = history(client, session)
    ran_before = len(tool_server.invocations)
    body = run_body("triage", message, session)
    restarted = crash_keyed_turn(servers, "before-write-1", body, key)
    assert len(tool_server.invocations) == ran_before
    with restarted.client() as client:
        crashed, _ = session_runs(client, session)
        assert history(client, session) == past
        response = client.post("/v1/runs", json=body, headers={"Idempotency-Key": key})
        run = ok(response)
        messages = history(client, session)
        runs = [r["run_id"] for r in session_runs(client, session)]
    assert runs == [crashed["run_id"], past_run["run_id"]]
    assert "idempotent-replayed" not in response.headers
    assert run["run_id"] == crashed["run_id"]
    assert run["status"] == "complete", run
    assert messages[: len(past)] == past
    turn = messages[len(past) :]
    assert [(m["role"], m["content"]) for m in turn[:1]] == [("user", message)]
    assert [m["run_id"] for m in user_messages(messages, message)] == [run["run_id"]]
    assert {m["run_id"] for m in turn} == {run["run_id"]}
    assert sorted(c["name"] for c in tool_calls(turn)) == ["get_issue", "post_slack"]
    assert sorted(i.tool for i in tool_server.invocations[ran_before:]) == [
        "get_issue",
        "post_slack",
    ]
    assert_history_consistent(messages)


def test_interrupted_keyed_turn_a_later_turn_overtook_is_answered_from_its_record(
    servers: Servers, fake_model: FakeAnthropic, tool_server: ToolServer, database_url: str
) -> None:
    """Same key after a later turn has started on the session: continuing the crashed turn
    would store its messages after that turn's, so its stored record is the answer. Which
    turn came later is the database's order, not the replicas' clocks: here the crashed
    turn's replica ran an hour fast, and its turn was continued after the later one."""
    session, message, key = "s-keyed-overtaken", "Triage issue 24", "turn-24"
    body = run_body("triage", message, session)
    crash_with_failpoint(
        servers.start("crashed", failpoints="after-handlers"), body, {"Idempotency-Key": key}
    )
    asyncio.run(run_clock_ahead(database_url, session, timedelta(hours=1)))
    restarted = servers.start("restarted")
    with restarted.client() as client:
        (crashed,) = session_runs(client, session)
        later = ok(client.post("/v1/runs", json=run_body("triage", "Triage issue 25", session)))
        assert later["status"] == "complete", later
        messages = history(client, session)
        model_calls, tools_run = len(fake_model.requests), len(tool_server.invocations)
        again = client.post("/v1/runs", json=body, headers={"Idempotency-Key": key})
        assert history(client, session) == messages
        # While another turn holds the session, the record is still the answer (it was a 409
        # saying a run was in progress, as if this one could still run).
        fake_model.set_delay(2)
        busy = Background(restarted.url, run_body("triage", "Triage issue 28", session))
        wait_for(
            lambda: session_status(client, session) == "running",
            timeout=15,
            what="another turn holding the session",
        )
        while_busy = client.post("/v1/runs", json=body, headers={"Idempotency-Key": key})
        fake_model.set_delay(0)
        busy_answer = busy.join(30)
        assert isinstance(busy_answer, httpx.Response), busy_answer
        assert ok(busy_answer)["status"] == "complete"
    for response in (again, while_busy):
        assert response.headers.get("idempotent-replayed") == "true"
        replayed = ok(response)
        assert (replayed["run_id"], replayed["status"]) == (crashed["run_id"], "interrupted")
        assert replayed["stop_reason"] is None  # its end was never stored
    assert len(tool_server.invocations) == tools_run + 2  # the busy turn's, none of this one's
    assert len(fake_model.requests) == model_calls + 2  # idem
    assert_history_consistent(messages)


def test_keyed_turn_that_stored_nothing_before_a_later_turn_runs_after_it(
    servers: Servers, tool_server: ToolServer
) -> None:
    """Same key after a crash before write #1 and a later turn: the crashed turn stored no
    message, so going on puts nothing out of order; it runs after the later turn, under its
    run_id (it was answered from its record, `interrupted`, with its message never stored)."""
    session, message, key = "s-keyed-nothing-stored", "Triage issue 26", "turn-26"
    body = run_body("triage", message, session)
    crash_with_failpoint(
        servers.start("crashed", failpoints="before-write-1"), body, {"Idempotency-Key": key}
    )
    with servers.start("restarted").client() as client:
        (crashed,) = session_runs(client, session)
        later = ok(client.post("/v1/runs", json=run_body("triage", "Triage issue 27", session)))
        before = history(client, session)
        response = client.post("/v1/runs", json=body, headers={"Idempotency-Key": key})
        messages = history(client, session)
    assert "idempotent-replayed" not in response.headers
    run = ok(response)
    assert (run["run_id"], run["status"]) == (crashed["run_id"], "complete")
    assert {m["run_id"] for m in before} == {later["run_id"]}
    assert messages[: len(before)] == before
    turn = messages[len(before) :]
    assert [(m["role"], m["content"]) for m in turn[:1]] == [("user", message)]
    assert {m["run_id"] for m in turn} == {run["run_id"]}
    assert sorted(i.tool for i in tool_server.invocations) == ["get_issue"] * 2 + ["post_slack"] * 2
    assert_history_consistent(messages)


def test_a_keyed_turn_being_repaired_is_busy_then_answers_one_record(
    servers: Servers, tool_server: ToolServer
) -> None:
    """Same key while a later turn repairs the crashed turn's calls (results that are the
    crashed turn's own): 409, not a record that would change once the repair is stored; once
    the later turn has stored its own messages, every replay is the one final record."""
    session, key = "s-keyed-repairing", "turn-30"
    body = run_body("slow-read", "Read the slow report", session)
    crashed = servers.start("crashed", failpoints="after-handlers")
    on_crashed = Background(crashed.url, body, headers={"Idempotency-Key": key})
    assert tool_server.in_flight.wait(15), crashed.logs()
    tool_server.release()
    assert isinstance(on_crashed.join(15), httpx.TransportError)
    assert crashed.wait() == FAILPOINT_EXIT, crashed.logs()
    tool_server.reset()  # hold the repair's re-run of slow_read
    restarted = servers.start("restarted")
    later = Background(restarted.url, run_body("slow-read", "Read it again", session))
    assert tool_server.in_flight.wait(15), restarted.logs()
    with restarted.client() as client:
        (crashed_run,) = [r for r in session_runs(client, session) if r["status"] == "interrupted"]
        while_repairing = client.post("/v1/runs", json=body, headers={"Idempotency-Key": key})
        tool_server.release()
        later_answer = later.join(30)
        assert isinstance(later_answer, httpx.Response), later_answer
        assert ok(later_answer)["status"] == "complete"
        replays = [
            client.post("/v1/runs", json=body, headers={"Idempotency-Key": key}) for _ in (1, 2)
        ]
        record = ok(client.get(f"/v1/runs/{crashed_run['run_id']}"))
    assert_busy(while_repairing)
    for replay in replays:
        assert replay.headers.get("idempotent-replayed") == "true"
        assert ok(replay) == record
    assert [m["role"] for m in record["messages"]] == ["user", "assistant", "tool"]


def test_a_keyed_turn_goes_on_when_the_later_turn_stored_nothing_of_its_own(
    servers: Servers, fake_model: FakeAnthropic, tool_server: ToolServer
) -> None:
    """Same key after a later turn repaired the crashed turn's calls and then failed at its
    first model call (storing nothing of its own): nothing follows the crashed turn's
    messages, so it goes on where it stopped, under its run_id, to its end."""
    session, message, key = "s-keyed-later-failed", "Triage issue 31", "turn-31"
    body = run_body("triage", message, session)
    crash_with_failpoint(
        servers.start("crashed", failpoints="after-write-1"), body, {"Idempotency-Key": key}
    )
    with servers.start("restarted").client() as client:
        (crashed,) = session_runs(client, session)
        fake_model.fail_next(1, 500)
        failed = ok(client.post("/v1/runs", json=run_body("triage", "Triage issue 32", session)))
        response = client.post("/v1/runs", json=body, headers={"Idempotency-Key": key})
        messages = history(client, session)
    assert failed["status"] == "error", failed
    assert "idempotent-replayed" not in response.headers
    run = ok(response)
    assert (run["run_id"], run["status"]) == (crashed["run_id"], "complete")
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool", "assistant"]
    assert {m["run_id"] for m in messages} == {run["run_id"]}
    (charge,) = [c for c in tool_calls(messages) if c["name"] == "post_slack"]
    assert_durability_error(
        result_of(messages, charge["id"]), tool="post_slack", call_id=charge["id"]
    )
    assert tool_server.count("post_slack") == 0  # write #1 was the last thing it did
    assert_history_consistent(messages)


async def run_clock_ahead(database_url: str, session_id: str, ahead: timedelta) -> None:
    """Move the session's runs' start times ahead, as a replica whose clock is fast would
    have stamped them."""
    db = await Database.connect(database_url, pool_size=1)

    def move(conn: Connection) -> None:
        runs = conn.execute(select(Run.id, Run.created_at).where(Run.session_id == session_id))
        for run_id, created_at in runs.all():
            conn.execute(update(Run).where(Run.id == run_id).values(created_at=created_at + ahead))

    try:
        await db.writes.transact(move)
    finally:
        await db.dispose()


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_one_process_serves_a_sqlite_file_until_it_dies(servers: Servers) -> None:
    """A second process on the same SQLite file would run turns the first cannot see (one run
    per session would not hold): it is refused at start; the first's death releases the file."""
    first = servers.start("first")
    second = servers.new("second")
    with pytest.raises(RuntimeError, match="another process is serving this SQLite database"):
        second.start()
    assert "Traceback" not in second.logs()  # a clear refusal, not a crash
    with first.client() as client:
        assert ok(client.post("/v1/runs", json=run_body("echo", "hi", "s-one")))["status"] == (
            "complete"
        )
    first.kill()
    with servers.start("after-kill").client() as client:  # kill -9 released the file
        assert session_status(client, "s-one") == "idle"
        assert ok(client.post("/v1/runs", json=run_body("echo", "again", "s-one")))
