"""A dead or stalled holder loses its sessions on PostgreSQL (§4), and then does nothing."""

from __future__ import annotations

import asyncio
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import asyncpg
import httpx
import pytest

from tests.ops.proxy import database_via_proxy
from tests.ownership.conftest import Servers
from tests.ownership.helpers import (
    POSTGRES_ONLY,
    Background,
    Json,
    assert_durability_error,
    assert_history_consistent,
    assert_problem,
    history,
    ok,
    post_until_not_busy,
    result_of,
    run_body,
    session_runs,
    tool_calls,
)
from tests.support.fake_anthropic import FakeAnthropic
from tests.support.polling import wait_for
from tests.support.server import ServerProcess
from tests.support.tool_server import ToolServer
from tests.support.transactions import SessionRowLock, TableLock

pytestmark = [pytest.mark.crash, POSTGRES_ONLY]


def test_kill_9_of_the_holder_then_another_process_takes_over(
    servers: Servers, tool_server: ToolServer
) -> None:
    """B takes the session within 5 s of A's kill -9; A's in-flight side effect never reruns."""
    a, b = servers.new("a"), servers.new("b")
    servers.start_all(a, b)
    body = run_body("slow", "Post the slow report", "s-kill")
    on_a = Background(a.url, body)
    assert tool_server.in_flight.wait(15), a.logs()
    (issue,) = [i for i in tool_server.invocations if i.tool == "get_issue"]
    (in_flight,) = [i for i in tool_server.invocations if i.tool == "slow_post"]
    a.kill()
    killed_at = time.monotonic()
    assert isinstance(on_a.join(5), httpx.TransportError)
    tool_server.release()  # B's new turn posts again (a new call); it must not block
    with b.client() as client:
        before = history(client, "s-kill")  # what A committed before it died
        response = post_until_not_busy(client, body, deadline=killed_at + 5)
        took = time.monotonic() - killed_at
        run = ok(response)
        assert took < 5, f"took over after {took:.1f}s"
        assert run["status"] == "complete", run
        messages = history(client, "s-kill")
        runs = {r["run_id"]: r["status"] for r in session_runs(client, "s-kill")}
    assert tool_server.per_call("slow_post")[in_flight.tool_call_id] == 1, tool_server.invocations
    assert tool_server.count("slow_post") == 2  # the killed call once, and B's new turn's call
    orphan = result_of(messages, in_flight.tool_call_id)
    assert_durability_error(orphan, tool="slow_post", call_id=in_flight.tool_call_id)
    assert tool_server.per_call("get_issue")[issue.tool_call_id] == 2  # safe_to_retry: re-run
    assert messages[: len(before)] == before
    assert_history_consistent(messages)
    crashed = {m["run_id"] for m in messages} - {run["run_id"]}
    assert len(crashed) == 1, messages
    assert runs == {run["run_id"]: "complete", crashed.pop(): "interrupted"}


def test_sigstopped_holder_is_taken_over_and_does_nothing_after_sigcont(
    servers: Servers, fake_model: FakeAnthropic, tool_server: ToolServer
) -> None:
    """A paused holder loses the session; resumed, it writes nothing and calls no tool."""
    env = {"SESSION_TAKEOVER_AFTER_S": "2"}
    a, b = servers.new("a", env=env), servers.new("b", env=env)
    servers.start_all(a, b)
    assert a.process is not None
    session = "s-paused"
    body = run_body("triage", "Triage issue 9", session)
    fake_model.set_delay(3)  # A's first model call is still unanswered when it is paused
    on_a = Background(a.url, body)
    wait_for(lambda: len(fake_model.requests) == 1, timeout=15, what="A's model request")
    a.process.send_signal(signal.SIGSTOP)
    try:
        fake_model.set_delay(0)
        with b.client() as client:
            run = ok(post_until_not_busy(client, body, deadline=time.monotonic() + 10))
            assert run["status"] == "complete", run
            invocations = tool_server.invocations
            before = history(client, session)
    finally:
        a.process.send_signal(signal.SIGCONT)
    answer = on_a.join(15)
    assert isinstance(answer, httpx.Response), answer  # A lives on: it answers, refusing
    lost = assert_problem(answer, 409, "session_busy")
    assert lost["active_run_id"] == run["run_id"]  # the run that took the session over
    time.sleep(1.5)  # A's chance to misbehave: a late write or tool call would land by now
    assert tool_server.invocations == invocations
    assert [i.tool for i in invocations] == ["get_issue", "post_slack"], invocations
    with b.client() as client:
        assert history(client, session) == before
        runs = {r["run_id"]: r["status"] for r in session_runs(client, session)}
    assert {m["run_id"] for m in before} == {run["run_id"]}
    assert len(runs) == 2 and runs.pop(run["run_id"]) == "complete", runs
    assert list(runs.values()) == ["interrupted"]  # A's run


def test_a_stalled_holders_session_reads_as_a_turn_would_find_it(
    servers: Servers, tool_server: ToolServer
) -> None:
    """Once A is stalled past the takeover age, B's reads show its session `needs_resume`
    and its run `interrupted`, as the next turn would find them (they had shown `running`
    for as long as the stall lasted); A, resumed first, ends its turn as usual."""
    env = {"SESSION_TAKEOVER_AFTER_S": "2"}
    a, b = servers.new("a", env=env), servers.new("b", env=env)
    servers.start_all(a, b)
    assert a.process is not None
    session = "s-stalled"
    on_a = Background(a.url, run_body("slow", "Post the slow report", session))
    assert tool_server.in_flight.wait(15), a.logs()
    with b.client() as client:
        assert ok(client.get(f"/v1/sessions/{session}"))["status"] == "running"
        a.process.send_signal(signal.SIGSTOP)
        try:
            stalled_at = time.monotonic()
            wait_for(
                lambda: ok(client.get(f"/v1/sessions/{session}"))["status"] == "needs_resume",
                timeout=10,
                what="the stalled holder's session to read as needing a resume",
            )
            assert time.monotonic() - stalled_at >= 1.5  # not before the takeover age
            (run,) = session_runs(client, session)
            assert run["status"] == "interrupted", run
            listed = ok(client.get("/v1/sessions"))["data"]
            assert [s["status"] for s in listed if s["id"] == session] == ["needs_resume"]
        finally:
            a.process.send_signal(signal.SIGCONT)
        tool_server.release()
        answer = on_a.join(15)
        assert isinstance(answer, httpx.Response), answer
        assert ok(answer)["status"] == "complete"  # nobody took it: A's turn went on
        assert ok(client.get(f"/v1/sessions/{session}"))["status"] == "idle"
    assert tool_server.count("slow_post") == 1


def test_holder_paused_while_its_session_was_deleted_answers_that_it_is_gone(
    servers: Servers, fake_model: FakeAnthropic, tool_server: ToolServer
) -> None:
    """B takes a paused A's session over to delete it; resumed, A says the session is gone
    (not that the database is unavailable) and writes nothing."""
    env = {"SESSION_TAKEOVER_AFTER_S": "2"}
    a, b = servers.new("a", env=env), servers.new("b", env=env)
    servers.start_all(a, b)
    assert a.process is not None
    session = "s-deleted"
    fake_model.set_delay(3)  # A's first model call is still unanswered when it is paused
    on_a = Background(a.url, run_body("triage", "Triage issue 9", session))
    wait_for(lambda: len(fake_model.requests) == 1, timeout=15, what="A's model request")
    a.process.send_signal(signal.SIGSTOP)
    try:
        with b.client() as client:
            deadline = time.monotonic() + 10
            while (deleted := client.delete(f"/v1/sessions/{session}")).status_code == 409:
                assert time.monotonic() < deadline, deleted.text
                time.sleep(0.2)
            assert deleted.status_code == 204, deleted.text
    finally:
        a.process.send_signal(signal.SIGCONT)
    answer = on_a.join(15)
    assert isinstance(answer, httpx.Response), answer
    gone = assert_problem(answer, 404, "session_not_found")
    assert "was deleted while this turn ran" in gone["detail"]
    time.sleep(1.5)  # A's chance to misbehave: a late write or tool call would land by now
    assert tool_server.invocations == []
    with b.client() as client:
        assert_problem(client.get(f"/v1/sessions/{session}"), 404, "session_not_found")


def finish_after_the_hold_ends_mid_call(
    server: ServerProcess, turn: Background, *, database_url: str, tools: ToolServer
) -> None:
    """End `server`'s lock connection while `turn`'s held call runs, with no other runner
    coming, then let the call answer: the turn takes its session again and completes."""
    assert tools.in_flight.wait(15), server.logs()
    assert drop_lock_connections(database_url) == 1
    wait_for(lambda: "ownership connection lost" in server.logs(), timeout=5, what="reconnect")
    tools.release()
    answer = turn.join(15)
    assert isinstance(answer, httpx.Response), answer
    assert ok(answer)["status"] == "complete"
    assert "taken again, nothing stored since: the turn goes on" in server.logs()


def drop_lock_connections(database_url: str) -> int:
    """Terminate the backends holding session locks in the test database (a partition)."""

    async def run() -> int:
        conn = await asyncpg.connect(database_url)
        try:
            rows = await conn.fetch(
                """
                SELECT pg_terminate_backend(pid) FROM pg_locks
                WHERE locktype = 'advisory' AND granted AND objsubid = 1
                  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
                """
            )
        finally:
            await conn.close()
        return len(rows)

    return asyncio.run(run())


def test_holder_that_lost_its_lock_dispatches_no_further_tool(
    servers: Servers, database_url: str, tool_server: ToolServer
) -> None:
    """A's lock connection drops mid-step and B takes the session over: when A's handler
    returns, A must not dispatch the step's next call (it reconnected, but owns nothing)."""
    servers.add_agent(
        "slow-then-post", model="plan:slow_post,post_slack", tools=["slow_post", "post_slack"]
    )
    a, b = servers.new("a"), servers.new("b")
    servers.start_all(a, b)
    session, key = "s-partition", {"Idempotency-Key": "turn-31"}
    body = run_body("slow-then-post", "Post the report, then tell the channel", session)
    on_a = Background(a.url, body, headers=key)
    assert tool_server.in_flight.wait(15), a.logs()
    (slow,) = tool_server.invocations
    assert drop_lock_connections(database_url) == 1  # A's lock, and with it the session, is gone
    wait_for(lambda: "ownership connection lost" in a.logs(), timeout=5, what="A's reconnect")
    with b.client() as client:  # B continues the keyed turn: both calls are orphans
        run = ok(post_until_not_busy(client, body, headers=key, deadline=time.monotonic() + 5))
        assert run["status"] == "complete", run
        messages = history(client, session)
    (post,) = [c for c in tool_calls(messages) if c["name"] == "post_slack"]
    assert_durability_error(result_of(messages, post["id"]), tool="post_slack", call_id=post["id"])
    tool_server.release()  # A's slow_post handler answers; A goes on with its step
    answer = on_a.join(15)
    assert isinstance(answer, httpx.Response), answer  # A lives on: it answers, refusing
    assert_problem(answer, 409, "session_busy")
    assert tool_server.per_call("slow_post") == {slow.tool_call_id: 1}
    assert tool_server.count("post_slack") == 0, tool_server.invocations
    with b.client() as client:
        assert history(client, session) == messages


def test_a_write_that_waited_on_its_row_while_the_hold_was_lost_stores_nothing(
    servers: Servers, database_url: str, tool_server: ToolServer
) -> None:
    """A's write #2 waits on the session's row (another client holds it FOR UPDATE); A's lock
    connection ends meanwhile and B takes the session, its start write waiting on the row
    too. When the row is free, A's write stores nothing: A lost the session during the wait
    (§4: it can no longer write). B's turn finds the call an orphan: the post ran once, and
    its result is the durability error."""
    a, b = servers.new("a"), servers.new("b")
    servers.start_all(a, b)
    session = "s-row-wait"
    body = run_body("slow", "Post the slow report", session)
    on_a = Background(a.url, body)
    assert tool_server.in_flight.wait(15), a.logs()
    (slow,) = [i for i in tool_server.invocations if i.tool == "slow_post"]
    with SessionRowLock(database_url, session_id=session) as row:
        tool_server.release()  # the handler answers; write #2 waits on the row
        wait_for(row.blocked, timeout=20, what="A's write #2 waiting on the row")
        on_b = _taken_over_while_waiting(row, b, database_url=database_url, body=body)
    _refused_for_the_taker(on_a, on_b)
    with b.client() as client:
        messages = history(client, session)
    assert_durability_error(
        result_of(messages, slow.tool_call_id), tool="slow_post", call_id=slow.tool_call_id
    )
    assert tool_server.per_call("slow_post")[slow.tool_call_id] == 1, tool_server.invocations
    assert_history_consistent(messages)


def test_an_end_write_that_waited_on_its_run_row_while_the_hold_was_lost_stores_nothing(
    servers: Servers, database_url: str, fake_model: FakeAnthropic
) -> None:
    """As above for A's end write, which waits on its run's row (another client holds the
    session's runs FOR UPDATE) after it has locked the session's row."""
    a, b = servers.new("a"), servers.new("b")
    servers.start_all(a, b)
    session = "s-run-row-wait"
    fake_model.set_delay(2)
    on_a = Background(a.url, run_body("echo", "first", session))
    with a.client() as client:
        wait_for(
            lambda: client.get(f"/v1/sessions/{session}").status_code == 200,
            timeout=20,
            what="A's start write",
        )
    with SessionRowLock(database_url, session_id=session, table="run") as row:
        fake_model.set_delay(0)
        wait_for(row.blocked, timeout=20, what="A's end write waiting on its run's row")
        second = run_body("echo", "second", session)
        on_b = _taken_over_while_waiting(row, b, database_url=database_url, body=second)
    _refused_for_the_taker(on_a, on_b)
    with b.client() as client:
        runs = {r["run_id"]: r["status"] for r in session_runs(client, session)}
        users = [m["content"] for m in history(client, session) if m["role"] == "user"]
    assert users == ["second"], users  # A's turn stored nothing: its user message neither
    assert sorted(runs.values()) == ["complete", "interrupted"], runs


def test_a_start_write_that_waited_on_a_crashed_runs_row_while_the_hold_was_lost_stores_nothing(
    servers: Servers, database_url: str, tool_server: ToolServer
) -> None:
    """X dies mid-turn, its run left `running`. A's next turn's start write, which marks that
    run `interrupted`, waits on its row (another client holds the session's runs FOR
    UPDATE); A's hold ends meanwhile and B's turn takes the session. A stores nothing."""
    x, a, b = servers.new("x", failpoints="after-handlers"), servers.new("a"), servers.new("b")
    servers.start_all(x, a, b)
    session = "s-interrupted-row-wait"
    died = Background(x.url, run_body("triage", "Triage issue 7", session)).join(30)
    assert isinstance(died, httpx.TransportError), died
    with b.client() as client:
        (crashed,) = session_runs(client, session)
    assert _stored_status(database_url, crashed["run_id"]) == "running"  # shown `interrupted`
    with SessionRowLock(database_url, session_id=session, table="run") as row:
        on_a = Background(a.url, run_body("triage", "Triage issue 8", session))
        wait_for(row.blocked, timeout=20, what="A's start write waiting on the crashed run's row")
        on_b = _taken_over_while_waiting(
            row, b, database_url=database_url, body=run_body("triage", "Triage issue 9", session)
        )
    _refused_for_the_taker(on_a, on_b)
    with b.client() as client:
        runs = {r["run_id"]: r["status"] for r in session_runs(client, session)}
        messages = history(client, session)
    users = [m["content"] for m in messages if m["role"] == "user" and m["content"]]
    assert users == ["Triage issue 7", "Triage issue 9"], users  # nothing of A's turn
    assert len(runs) == 2 and runs[crashed["run_id"]] == "interrupted", runs
    assert _stored_status(database_url, crashed["run_id"]) == "interrupted"  # by B's start
    posts = tool_server.per_call("post_slack")  # X's and B's: each once
    assert len(posts) == 2 and set(posts.values()) == {1}, tool_server.invocations
    assert_history_consistent(messages)


def _stored_status(database_url: str, run_id: str) -> str:
    async def read() -> str:
        conn = await asyncpg.connect(database_url)
        try:
            return str(await conn.fetchval("SELECT status FROM run WHERE id = $1", run_id))
        finally:
            await conn.close()

    return asyncio.run(read())


@pytest.mark.parametrize("table", ["session", "message"])
def test_a_delete_that_waited_on_a_row_while_the_hold_was_lost_deletes_nothing(
    servers: Servers, database_url: str, table: Literal["session", "message"]
) -> None:
    """As above for a DELETE on A: it waits on the session's row (or, the session's row
    locked, on its messages' rows), A's hold ends, and B's turn takes the session and waits
    on its row. The delete deletes nothing; B's turn runs."""
    a, b = servers.new("a"), servers.new("b")
    servers.start_all(a, b)
    session = "s-delete-row-wait"
    with b.client() as client:
        ok(client.post("/v1/runs", json=run_body("echo", "first", session)))
    with ThreadPoolExecutor(max_workers=1) as pool, a.client() as on_a:
        with SessionRowLock(database_url, session_id=session, table=table) as row:
            deleting = pool.submit(on_a.delete, f"/v1/sessions/{session}")
            wait_for(row.blocked, timeout=20, what="A's delete waiting on a row")
            second = run_body("echo", "second", session)
            on_b = _taken_over_while_waiting(row, b, database_url=database_url, body=second)
        taken = on_b.join(30)
        assert isinstance(taken, httpx.Response), taken
        run = ok(taken)
        assert run["status"] == "complete", run
        refused = assert_problem(deleting.result(timeout=30), 409, "session_busy")
        assert refused["active_run_id"] == run["run_id"], refused
    with b.client() as client:
        users = [m["content"] for m in history(client, session) if m["role"] == "user"]
    assert users == ["first", "second"], users


def _taken_over_while_waiting(
    row: SessionRowLock, b: ServerProcess, *, database_url: str, body: Json
) -> Background:
    """While A's statement waits on a row `row` holds: A's hold ends, and B's turn `body`
    takes the session and waits on its row too."""
    assert drop_lock_connections(database_url) == 1  # A's hold is gone
    on_b = Background(b.url, body)
    wait_for(lambda: row.waiting() == 2, timeout=20, what="B's start write waiting too")
    return on_b


def _refused_for_the_taker(on_a: Background, on_b: Background) -> None:
    """B's turn completed, and A's request was answered 409 naming it."""
    answer = on_a.join(30)
    assert isinstance(answer, httpx.Response), answer
    taken = on_b.join(30)
    assert isinstance(taken, httpx.Response), taken
    run = ok(taken)
    assert run["status"] == "complete", run
    assert assert_problem(answer, 409, "session_busy")["active_run_id"] == run["run_id"]


@pytest.mark.parametrize("ids", ["random", "reused"])
def test_a_write_whose_outcome_was_unknown_is_not_taken_for_another_runners(
    servers: Servers,
    database_url: str,
    fake_model: FakeAnthropic,
    tool_server: ToolServer,
    ids: str,
) -> None:
    """A's step-2 write #1 waits on the session's row; A is paused, its hold and that write
    both end (the write never committed). The client sends the keyed turn to B, which
    continues the same run: it stores its own step-2 write #1, as many messages as A's, posts,
    and dies. A, resumed, finds the session as its write would have left it in count and
    status, but the stored call is B's: A must not take it for its own write and post. With
    `reused` ids (the model's ids follow the history, as `scripted:` models' do) B's call
    has the same id and text as A's: only when it was written tells them apart."""
    plan = "get_issue;post_slack"
    servers.add_agent(
        "unknown-write",
        model=f"{'plan' if ids == 'random' else 'reuse'}:{plan}",
        tools=["get_issue", "post_slack"],
    )
    a, b = servers.new("a"), servers.new("b", failpoints="after-handlers")
    servers.start_all(a, b)
    assert a.process is not None
    session, key = "s-unknown-write", {"Idempotency-Key": "turn-51"}
    body = run_body("unknown-write", "Triage issue 9", session)
    fake_model.set_delay(2)
    on_a = Background(a.url, body, headers=key)
    wait_for(lambda: len(fake_model.requests) == 2, timeout=20, what="A's second model call")
    with SessionRowLock(database_url, session_id=session) as row:
        wait_for(row.blocked, timeout=20, what="A's step-2 write #1 waiting on the row")
        a.process.send_signal(signal.SIGSTOP)
        try:
            assert drop_lock_connections(database_url) == 1  # A's hold
            assert _end_lock_waiters(database_url) == 1  # A's write #1, never committed
        except BaseException:
            a.process.send_signal(signal.SIGCONT)
            raise
    fake_model.set_delay(0)
    try:
        assert isinstance(Background(b.url, body, headers=key).join(30), httpx.TransportError)
    finally:
        a.process.send_signal(signal.SIGCONT)
    answer = on_a.join(30)
    assert isinstance(answer, httpx.Response), answer
    assert_problem(answer, 503, "database_unavailable")  # the write could not be settled
    with servers.start("c").client() as client:
        stored = {c["id"] for c in tool_calls(history(client, session))}
    posted = [i.tool_call_id for i in tool_server.invocations if i.tool == "post_slack"]
    assert len(posted) == 1 and posted[0] in stored, (posted, stored)


def _end_lock_waiters(database_url: str) -> int:
    """Terminate the backends whose statement waits on a lock."""

    async def run() -> int:
        conn = await asyncpg.connect(database_url)
        try:
            rows = await conn.fetch(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE wait_event_type = 'Lock' AND datname = current_database()"
            )
        finally:
            await conn.close()
        return len(rows)

    return asyncio.run(run())


def test_a_holder_whose_lock_connection_ended_with_no_taker_takes_the_session_again(
    servers: Servers, database_url: str, tool_server: ToolServer
) -> None:
    """A's lock connection ends mid-step (a backend ended by an administrator or a proxy) and
    no other runner comes: A takes the session again on a new connection, finds nothing
    stored to it since its last write, and stores the call's result. It stopped (503), and
    the resumed turn gave the call, which had run, §2's durability error."""
    a = servers.new("a")
    servers.start_all(a)
    session, key = "s-hold-lost", {"Idempotency-Key": "turn-41"}
    body = run_body("slow", "Post the slow report", session)
    on_a = Background(a.url, body, headers=key)
    finish_after_the_hold_ends_mid_call(a, on_a, database_url=database_url, tools=tool_server)
    with a.client() as client:
        messages = history(client, session)
    (post,) = [c for c in tool_calls(messages) if c["name"] == "slow_post"]
    assert "tool-durability-error" not in result_of(messages, post["id"])["content"]
    assert tool_server.count("slow_post") == 1


def test_parallel_calls_that_find_the_hold_ended_take_the_session_again_once(
    servers: Servers, database_url: str, tool_server: ToolServer
) -> None:
    """A's lock connection ends while a step's first call runs; the step's parallel calls
    then all find the hold gone at once. A takes the session again once: when the turn
    ends, it holds nothing, and another replica may delete the session."""
    servers.add_http_tool("fan_a", path="get_issue", parallel=True)
    servers.add_http_tool("fan_b", path="get_issue", parallel=True)
    servers.add_agent(
        "slow-then-fan", model="plan:slow_post,fan_a,fan_b", tools=["slow_post", "fan_a", "fan_b"]
    )
    a, b = servers.new("a"), servers.new("b")
    servers.start_all(a, b)
    session = "s-fan-retake"
    on_a = Background(a.url, run_body("slow-then-fan", "Post, then read twice", session))
    finish_after_the_hold_ends_mid_call(a, on_a, database_url=database_url, tools=tool_server)
    assert tool_server.count("get_issue") == 2
    with b.client() as client:  # A let the session go: B may delete it at once
        deleted = client.delete(f"/v1/sessions/{session}")
    assert deleted.status_code == 204, deleted.text


def test_a_hold_that_ended_before_the_turns_start_record_is_taken_again(
    servers: Servers, database_url: str
) -> None:
    """The lock connection ends between the turn taking the session and its start record:
    nobody else holds the session, nor stored anything since the turn read it, so the turn
    takes it again and runs. It answered 503, and before that 409 naming the session's
    previous run as if another runner had taken the session over."""
    a = servers.new("a")
    servers.start_all(a)
    body = run_body("echo", "hello", "s-hold-lost-early")
    with a.client() as client:
        first = ok(client.post("/v1/runs", json=body))
        # The turn's read of the history, after it took the session, waits for the table.
        lock = TableLock(database_url)
        lock.take()
        try:
            second = Background(a.url, body)
            wait_for(lambda: lock.waiting() > 0, timeout=15, what="the history read waiting")
            assert drop_lock_connections(database_url) == 1
        finally:
            lock.release()
        answer = second.join(15)
        assert isinstance(answer, httpx.Response), answer
        again = ok(answer)
        assert again["status"] == "complete" and again["run_id"] != first["run_id"]
    assert "taken again, nothing stored since: the turn goes on" in a.logs()


def test_a_hold_that_ended_before_the_start_record_while_another_turn_ran_answers_503(
    servers: Servers,
    database_url: str,
    tmp_path: Path,
    fake_model: FakeAnthropic,
    tool_server: ToolServer,
) -> None:
    """As above, but another replica runs a whole turn on the session before the first
    turn's start record reaches the database: the session changed since the first turn read
    it, so that turn cannot take it again; it stored and ran nothing, and says to resubmit,
    which then runs after the other turn."""
    session = "s-hold-lost-overtaken"
    with database_via_proxy(database_url) as (proxy, via_proxy):
        (tmp_path / "late").mkdir()
        late = Servers(
            tmp_path / "late",
            database_url=via_proxy,
            model_url=fake_model.url,
            tools_url=tool_server.url,
        )
        try:
            a, b = late.new("a"), servers.new("b")
            servers.start_all(a, b)
            with b.client() as client:
                ok(client.post("/v1/runs", json=run_body("echo", "first", session)))
            lock = TableLock(database_url)
            lock.take()
            try:
                second = Background(a.url, run_body("echo", "second", session))
                wait_for(lambda: lock.waiting() > 0, timeout=15, what="A's history read waiting")
                proxy.stall(8)  # what A reads and sends from now on arrives 8 s late
                assert drop_lock_connections(database_url) == 1  # A's hold ends
            finally:
                lock.release()
            with b.client() as client:
                assert (
                    ok(client.post("/v1/runs", json=run_body("echo", "third", session)))["status"]
                    == "complete"
                )
            answer = second.join(60)
            assert isinstance(answer, httpx.Response), answer
            detail = assert_problem(answer, 503, "database_unavailable")["detail"]
            assert f"hold on session {session!r} ended with its connection" in detail, detail
            assert answer.headers.get("Retry-After")
            with a.client() as client:
                assert (
                    ok(client.post("/v1/runs", json=run_body("echo", "second", session)))["status"]
                    == "complete"
                )
                messages = history(client, session)
        finally:
            late.close()
    users = [m["content"] for m in messages if m["role"] == "user"]
    assert users == ["first", "third", "second"], users
    assert_history_consistent(messages)


def test_a_database_that_answers_late_costs_the_holder_no_session(
    database_url: str, tmp_path: Path, fake_model: FakeAnthropic, tool_server: ToolServer
) -> None:
    """PostgreSQL stalls for 2 s while a side effect is in flight: less than the time a
    holder may go without a heartbeat (half of SESSION_TAKEOVER_AFTER_S), so the holder
    keeps its lock connection, and the turn stores its result and finishes."""
    with database_via_proxy(database_url) as (proxy, via_proxy):
        servers = Servers(
            tmp_path, database_url=via_proxy, model_url=fake_model.url, tools_url=tool_server.url
        )
        try:
            server = servers.start("server", env={"SESSION_TAKEOVER_AFTER_S": "8"})
            turn = Background(server.url, run_body("slow", "Triage issue 3", "s-late-db"))
            assert tool_server.in_flight.wait(15), "the side effect never started"
            proxy.stall(2)
            time.sleep(2.5)  # the heartbeats sent meanwhile are answered, late
            tool_server.release()
            answer = turn.join(30)
            assert isinstance(answer, httpx.Response), answer
            assert ok(answer)["status"] == "complete"
            assert tool_server.count("slow_post") == 1
            assert "ownership connection lost" not in server.logs()
        finally:
            servers.close()


LOOP_HOLDER = """
import time


async def hold_the_loop(arguments, context):
    time.sleep(2.5)  # not awaited: every other task of the process waits too
    return {"held": True}
"""


def test_a_tool_that_holds_the_event_loop_costs_other_sessions_nothing(
    servers: Servers, fake_model: FakeAnthropic, tool_server: ToolServer, tmp_path: Path
) -> None:
    """A Python tool holds the event loop for 2.5 s, longer than a holder may go without a
    heartbeat, while four other sessions run: each beats at once before its next dispatch,
    finds its session still its own, and finishes."""
    (tmp_path / "loop_holder.py").write_text(LOOP_HOLDER)
    servers.add_tool("hold_the_loop", python="loop_holder:hold_the_loop")
    servers.add_agent("loop-holder", model="plan:hold_the_loop", tools=["hold_the_loop"])
    server = servers.start("server", env={"PYTHONPATH": str(tmp_path)})
    fake_model.set_delay(0.2)
    turns = [
        Background(server.url, run_body("ten-steps", "Triage issue 4", f"s-loop-{i}"))
        for i in range(4)
    ]
    wait_for(lambda: len(fake_model.requests) >= 4, timeout=15, what="the turns' model calls")
    for _ in range(2):
        with server.client() as client:
            held = ok(client.post("/v1/runs", json=run_body("loop-holder", "Hold it", None)))
        assert held["status"] == "complete", held
    for turn in turns:
        answer = turn.join(60)
        assert isinstance(answer, httpx.Response), answer
        assert ok(answer)["status"] == "complete"
    assert tool_server.count("get_issue") == 40
