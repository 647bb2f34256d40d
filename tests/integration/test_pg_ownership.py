"""PostgresOwnership on a real PostgreSQL: what a holder whose heartbeat is late may do."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
import pytest
from sqlalchemy import text

from app.db.session import Database
from app.db.urls import asyncpg_dsn
from app.domain import RunStatus
from app.errors import SessionBusy, SessionConflict
from app.failpoints import Failpoints
from app.llm.scripted import ScriptedLLMClient
from app.metrics import Metrics
from app.schemas.runs import RunCreate
from app.services.pg_locks import lock_key
from app.services.pg_ownership import PostgresOwnership
from app.services.runner import AgentRunner
from app.services.runs import RunService
from app.services.sessions import SessionService
from app.tools.agents_file import load_registry
from tests.ops.proxy import database_via_proxy

pytestmark = pytest.mark.parametrize(
    "backend", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)

TAKEOVER_AFTER_S = 4.0


@asynccontextmanager
async def a_replica(database_url: str) -> AsyncIterator[PostgresOwnership]:
    """A replica's ownership, its beats far apart: a test sets how late the last one was."""
    held = PostgresOwnership(database_url, heartbeat_s=3600, takeover_after_s=TAKEOVER_AFTER_S)
    await held.start()
    try:
        yield held
    finally:
        await held.stop()


@asynccontextmanager
async def a_replica_told_of_ends_late(database_url: str) -> AsyncIterator[PostgresOwnership]:
    """A replica whose connections go through a proxy that passes their server's end on
    0.5 s late: a statement sent meanwhile meets an end the driver has not seen."""
    with database_via_proxy(database_url) as (proxy, via_proxy):
        proxy.end_late(0.5)
        async with a_replica(via_proxy) as held:
            yield held


@pytest.fixture
async def ownership(database_url: str) -> AsyncIterator[PostgresOwnership]:
    async with a_replica(database_url) as held:
        yield held


async def unanswered(*, if_stale: bool = False) -> None:
    raise ConnectionError("the database does not answer")


async def test_a_holder_whose_last_beat_is_past_half_the_takeover_time_dispatches_nothing(
    ownership: PostgresOwnership, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another replica may take a session whose holder has been idle TAKEOVER_AFTER_S; the
    # holder stops at half that, so that a beat answered late still lands before it.
    async with ownership.hold("s-late"):
        await ownership.check("s-late")  # beat just now: may go on
        monkeypatch.setattr(ownership, "_heartbeat", unanswered)
        ownership._last_beat = time.monotonic() - 0.25 * TAKEOVER_AFTER_S
        await ownership.check("s-late")  # late, but not past half
        ownership._last_beat = time.monotonic() - 0.75 * TAKEOVER_AFTER_S
        with pytest.raises(SessionConflict):
            await ownership.check("s-late")


@asynccontextmanager
async def example_services(
    database_url: str, ownership: PostgresOwnership
) -> AsyncIterator[tuple[Database, RunService, SessionService]]:
    """The run and session services on the example agents (scripted models), on `ownership`."""
    db = await Database.connect(database_url, pool_size=2)
    registry = load_registry(None)
    metrics = Metrics()
    runner = AgentRunner(llm=ScriptedLLMClient(), registry=registry, metrics=metrics)
    service = RunService(db, registry, runner, Failpoints.parse(None), ownership, metrics)
    try:
        yield db, service, SessionService(db, ownership, metrics)
    finally:
        await registry.aclose()
        await db.dispose()


async def test_a_stored_turn_is_answered_though_shutdown_cancels_its_release(
    database_url: str, ownership: PostgresOwnership, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Shutdown cancels the requests still running when its grace is over; one cancelled
    # while releasing its session (a round trip here) had already stored its turn, and was
    # answered 503 "shut down before the run finished": its client ran the turn again.
    # (Staged here: a release that takes a while; over HTTP the window is milliseconds.)
    releasing = asyncio.Event()
    unlock = ownership._unlock

    async def slow_unlock(key: int) -> None:
        releasing.set()
        await asyncio.sleep(0.5)
        await unlock(key)

    monkeypatch.setattr(ownership, "_unlock", slow_unlock)
    body = RunCreate(agent="support", message="where is my order?", session_id="s-cut")
    async with example_services(database_url, ownership) as (_, service, _):
        turn = asyncio.create_task(service.create(body, tenant_id=None))
        await releasing.wait()
        turn.cancel()
        result = await turn
        assert result.run.status is RunStatus.COMPLETE
        # The release went on regardless: the session takes its next turn.
        deadline = time.monotonic() + 5
        while await ownership.is_held("s-cut"):
            assert time.monotonic() < deadline, "the session stayed locked"
            await asyncio.sleep(0.05)
        monkeypatch.setattr(ownership, "_unlock", unlock)
        again = await service.create(body, tenant_id=None)
        assert again.run.status is RunStatus.COMPLETE


async def test_stop_waits_for_a_release_its_request_gave_up_on(
    database_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A release that went on without its cancelled request ran after stop: it found the lock
    # connection closed and opened another, which nobody closed.
    owner = PostgresOwnership(database_url, heartbeat_s=3600, takeover_after_s=TAKEOVER_AFTER_S)
    await owner.start()
    unlock = owner._unlock
    releasing = asyncio.Event()

    async def slow_unlock(key: int) -> None:
        releasing.set()
        await asyncio.sleep(0.3)
        await unlock(key)

    monkeypatch.setattr(owner, "_unlock", slow_unlock)

    async def hold_a_while() -> None:
        async with owner.hold("s-stop"):
            pass

    holding = asyncio.create_task(hold_a_while())
    await releasing.wait()
    holding.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await holding
    await owner.stop()
    await asyncio.sleep(0.5)  # a release left going would have run by now
    assert "ownership connection lost" not in caplog.text
    admin = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        locks = await admin.fetchval(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND database ="
            " (SELECT oid FROM pg_database WHERE datname = current_database())"
        )
    finally:
        await admin.close()
    assert locks == 0  # released before the stop, and no new connection took a token


async def test_a_hold_that_ends_while_stop_runs_opens_nothing_and_says_nothing(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Its release met the lock connection stop had just closed: it reported the connection
    # lost, and before stop refused to open connections, opened another to unlock a lock
    # that had gone with the first.
    owner = PostgresOwnership(database_url, heartbeat_s=3600, takeover_after_s=TAKEOVER_AFTER_S)
    await owner.start()
    inside = asyncio.Event()

    async def hold_past_the_stop() -> None:
        async with owner.hold("s-late"):
            inside.set()
            await asyncio.sleep(0.2)

    holding = asyncio.create_task(hold_past_the_stop())
    await inside.wait()
    await owner.stop()
    await holding
    assert "ownership connection lost" not in caplog.text
    assert owner._conn is None or owner._conn.is_closed()


async def test_a_finished_run_is_read_without_asking_whether_its_session_is_held(
    database_url: str, ownership: PostgresOwnership
) -> None:
    # Whether a session's owner is alive matters only to a run stored `running`; a finished
    # run's GET sent a statement on the replica's one lock connection all the same, in line
    # with every turn's start and end, and answered 503 while that connection was down.
    body = RunCreate(agent="support", message="where is my order?", session_id="s-read")
    async with example_services(database_url, ownership) as (db, service, sessions):
        done = (await service.create(body, tenant_id=None)).run
        sent = ownership.statements
        got = await service.get(done.run_id, tenant_id=None)
        page = await sessions.runs("s-read", tenant_id=None, user_id=None, after=None, limit=10)
        assert ownership.statements == sent
        assert got.status is RunStatus.COMPLETE
        assert [r.status for r in page.data] == [RunStatus.COMPLETE]
        # A run stored `running` whose owner is gone reads `interrupted`: that one asks.
        async with db.engine.begin() as conn:
            await conn.execute(text("UPDATE run SET status = 'running'"))
        got = await service.get(done.run_id, tenant_id=None)
        page = await sessions.runs("s-read", tenant_id=None, user_id=None, after=None, limit=10)
        assert ownership.statements == sent + 2
        assert got.status is RunStatus.INTERRUPTED
        assert [r.status for r in page.data] == [RunStatus.INTERRUPTED]


async def test_a_lock_connection_that_stops_answering_is_dropped_not_waited_on(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # The network path to PostgreSQL holds everything back (a failover, a lost NAT entry)
    # while a turn releases its session. The unlock waited without end, holding the lock
    # connection, so the heartbeat could not notice: every request of the replica hung.
    with database_via_proxy(database_url) as (proxy, via_proxy):
        owner = PostgresOwnership(via_proxy, heartbeat_s=3600, takeover_after_s=2)
        await owner.start()
        try:
            stall_s = 6
            async with owner.hold("s-stalled"):
                proxy.stall(stall_s)
                stalled_at = time.monotonic()
            released_s = time.monotonic() - stalled_at
            assert released_s < stall_s - 2, f"the release waited {released_s:.1f} s"
            assert "ownership connection lost (TimeoutError)" in caplog.text
            # Once the path is back, a new lock connection serves the session again.
            await asyncio.sleep(stall_s - released_s + 0.5)
            async with owner.hold("s-stalled"):
                await owner.check("s-stalled")
        finally:
            await owner.stop()


async def test_a_new_lock_connection_that_answers_nothing_is_given_up_and_closed(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # After a failover the server accepts the new lock connection, then its first statement
    # is never answered. Untimed, it held the lock connection's turn, and with it every
    # request of the replica, until the kernel gave up on the socket; each failed attempt
    # also left its connection open.
    with database_via_proxy(database_url) as (proxy, via_proxy):
        async with a_replica(via_proxy) as owner:
            opened: list[asyncpg.Connection] = []
            open_connection = owner._open

            async def open_then_stall() -> asyncpg.Connection:
                conn = await open_connection()
                opened.append(conn)
                proxy.stall(6)  # accepted; what it is sent next goes unanswered
                return conn

            admin = await asyncpg.connect(asyncpg_dsn(database_url))
            try:
                assert await admin.fetchval("SELECT pg_terminate_backend($1, 5000)", owner.lock_pid)
            finally:
                await admin.close()
            monkeypatch.setattr(owner, "_open", open_then_stall)
            asked_at = time.monotonic()
            with pytest.raises(ConnectionError):
                await owner.ping()
            waited_s = time.monotonic() - asked_at
            assert waited_s < TAKEOVER_AFTER_S, f"the new connection was waited on {waited_s:.1f} s"
            assert len(opened) == 1 and opened[0].is_closed()
            proxy.stall(0)


async def test_a_heartbeat_counts_from_when_it_was_sent(
    ownership: PostgresOwnership, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An answer that waited to be read (the process stopped, its event loop held up) says
    # the lock connection was alive when the beat was sent, not when it is read: stamped at
    # reading, a holder resumed after a takeover could pass its next check.
    live = ownership._conn
    assert live is not None
    conn = live

    class ReadLate:
        async def fetchval(self, *args: Any, **kwargs: Any) -> Any:
            value = await conn.fetchval(*args, **kwargs)
            await asyncio.sleep(0.5)
            return value

    async def connection() -> ReadLate:
        return ReadLate()

    monkeypatch.setattr(ownership, "_connection", connection)
    before = time.monotonic()
    await ownership._heartbeat()
    assert ownership._last_beat - before < 0.25


async def test_a_deadline_that_passed_while_the_event_loop_was_held_up_costs_no_session(
    ownership: PostgresOwnership, caplog: pytest.LogCaptureFixture
) -> None:
    # A tool that blocks the event loop for longer than a lock statement may take, while the
    # statement is in flight: its answer came meanwhile, or its second round trip (a statement
    # is prepared on its first use; the asking connection's first also opens it) goes out only
    # when the loop runs again. Timed by the
    # loop's clock, the deadline fired first: the lock connection was dropped, and with it
    # every session of the replica.
    async with ownership.hold("s-held"):
        # On the lock connection, and on the one that asks whether others hold sessions.
        asking = asyncio.gather(
            ownership.ping(),  # SELECT 1's first use there: prepared first
            ownership.is_held("s-other"),  # the asking connection's first statement
        )
        await asyncio.sleep(0)  # the statements are sent
        time.sleep(0.6 * TAKEOVER_AFTER_S)  # noqa: ASYNC251 - the loop held up past the deadline
        assert tuple(await asking) == (None, False)
        await ownership.check("s-held")  # still its own
    assert "ownership connection lost" not in caplog.text


async def test_whether_others_hold_sessions_is_asked_beside_the_lock_connections_line(
    ownership: PostgresOwnership, database_url: str
) -> None:
    # Every take, release and heartbeat of a replica waits in one line for its lock
    # connection. Status questions (a GET, a page of sessions, a 409's wait for the holder's
    # run) waited in it too: under load they held up the takes and releases, so that a
    # request sent while a turn ran could be looked at only after it had ended.
    async with a_replica(database_url) as other, other.hold("s-theirs"):
        async with ownership._io:  # the lock connection's line, held up
            held = await asyncio.wait_for(
                ownership.held_among(["s-theirs", "s-free"]), timeout=TAKEOVER_AFTER_S / 4
            )
        assert held == {"s-theirs"}


async def test_a_session_taken_again_on_a_connection_that_then_ended_is_not_held(
    ownership: PostgresOwnership, database_url: str
) -> None:
    # The lock connection ends again while the turn reads the session to see whether it may
    # go on: the lock just taken went with it, so the session must not count as held (the
    # next dispatch would pass its check on a connection that holds nothing).
    admin = await asyncpg.connect(asyncpg_dsn(database_url))

    async def end_the_lock_connection() -> None:
        pid = ownership.lock_pid
        assert await admin.fetchval("SELECT pg_terminate_backend($1, 5000)", pid)

    async def unchanged_but_lost_again() -> bool:
        await end_the_lock_connection()
        with contextlib.suppress(ConnectionError):
            await ownership.ping()  # the ended connection is noticed and replaced
        return True

    try:
        async with ownership.hold("s-again"):
            await end_the_lock_connection()
            assert await ownership.retake("s-again", unchanged=unchanged_but_lost_again) is False
            with pytest.raises(SessionConflict):
                await ownership.check("s-again")
            # Taken again once more, with nothing in the way, it is held.
            assert await ownership.retake("s-again", unchanged=_unchanged) is True
            await ownership.check("s-again")
    finally:
        await admin.close()


async def _unchanged() -> bool:
    return True


async def test_a_session_whose_lock_connection_ended_unseen_is_taken_again(
    database_url: str,
) -> None:
    # A network path ends the lock connection and the turn's write connection together: the
    # write's failure is seen first, and the turn asks to take the session again before the
    # lock connection's end is. Its connection looked alive, so the session counted held
    # there and was not taken again: the turn answered 503 though nobody else had it.
    admin = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        async with a_replica_told_of_ends_late(database_url) as owner, owner.hold("s-unseen"):
            assert await admin.fetchval("SELECT pg_terminate_backend($1, 5000)", owner.lock_pid)
            assert await owner.retake("s-unseen", unchanged=_unchanged) is True
            await owner.check("s-unseen")
    finally:
        await admin.close()


async def test_the_fence_holds_only_on_the_lock_connection_the_session_was_taken_on(
    ownership: PostgresOwnership, database_url: str
) -> None:
    # The fence names the token of the connection that took the session's lock, not the
    # current one: after that connection ends, the new one is alive (its own token held)
    # but holds no lock of the session's until it takes it again.
    admin = await asyncpg.connect(asyncpg_dsn(database_url))

    async def fenced(session_id: str) -> bool:
        sql = ownership.fence_sql.replace(":token_hi", "$1").replace(":token_lo", "$2")
        params = ownership.fence_params(session_id)
        return bool(await admin.fetchval(f"SELECT {sql}", params["token_hi"], params["token_lo"]))

    try:
        assert await fenced("s-fenced") is False  # not held
        async with ownership.hold("s-fenced"), ownership.hold("s-other"):
            assert await fenced("s-fenced") is True
            assert await admin.fetchval("SELECT pg_terminate_backend($1, 5000)", ownership.lock_pid)
            assert await fenced("s-fenced") is False
            await ownership.ping()  # a new lock connection, holding no session
            assert await fenced("s-fenced") is False
            assert await ownership.retake("s-fenced", unchanged=_unchanged) is True
            assert await fenced("s-fenced") is True
            assert await fenced("s-other") is False  # not taken again
        assert await fenced("s-fenced") is False
    finally:
        await admin.close()


async def test_another_replicas_sessions_are_told_held_without_taking_any(
    ownership: PostgresOwnership, database_url: str
) -> None:
    # A session's status asks whether any runner holds its lock, by trying for a shared lock
    # on it for one statement: refused while a runner holds it, granted (and let go at once)
    # otherwise, so asking takes nothing a turn needs.
    async with a_replica(database_url) as other, other.hold("s-theirs"):
        assert await ownership.held_among(["s-theirs", "s-free", "s-mine"]) == {"s-theirs"}
        async with ownership.hold("s-mine"):
            assert await ownership.held_among(["s-theirs", "s-free", "s-mine"]) == {
                "s-theirs",
                "s-mine",
            }
            assert await other.held_among(["s-theirs", "s-free", "s-mine"]) == {
                "s-theirs",
                "s-mine",
            }
        assert await ownership.is_held("s-free") is False
        async with other.hold("s-free"):  # asked about, free
            assert await ownership.is_held("s-free") is True
        with pytest.raises(SessionBusy):
            async with ownership.hold("s-theirs"):
                pass


async def test_a_turn_that_meets_another_replicas_question_takes_the_session_when_it_is_over(
    ownership: PostgresOwnership, database_url: str
) -> None:
    # Another replica's status question holds the session's key shared for its statement:
    # a turn taking the session just then was refused by nobody, and answered 409. It waits
    # for the question to be over; so does a turn taking again a session it had held on a
    # lock connection that ended.
    asking = await asyncpg.connect(asyncpg_dsn(database_url))
    admin = await asyncpg.connect(asyncpg_dsn(database_url))

    async def held_by_a_question_for(seconds: float, session_id: str) -> None:
        async with asking.transaction():  # a question caught in the middle of its statement
            assert await asking.fetchval(
                "SELECT pg_try_advisory_xact_lock_shared($1)", lock_key(session_id)
            )
            await asyncio.sleep(seconds)

    question = asyncio.create_task(held_by_a_question_for(0.3, "s-asked"))
    try:
        await asyncio.sleep(0.05)
        async with ownership.hold("s-asked"):
            assert question.done()
            await ownership.check("s-asked")
            assert await admin.fetchval("SELECT pg_terminate_backend($1, 5000)", ownership.lock_pid)
            await ownership.ping()  # a new lock connection, holding nothing
            question = asyncio.create_task(held_by_a_question_for(0.3, "s-asked"))
            await asyncio.sleep(0.05)
            assert await ownership.retake("s-asked", unchanged=_unchanged) is True
            assert question.done()
            await ownership.check("s-asked")
    finally:
        question.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await question
        await asking.close()
        await admin.close()


async def test_a_statement_on_a_lock_connection_the_server_ended_unseen_is_sent_again(
    database_url: str,
) -> None:
    # The server ended the lock connection and the driver had not read its goodbye when the
    # next statement went out: a session's GET, a DELETE or a new turn answered 503 though
    # the database was up.
    admin = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        async with a_replica_told_of_ends_late(database_url) as owner:
            ended = owner.lock_pid
            assert await admin.fetchval("SELECT pg_terminate_backend($1, 5000)", ended)
            assert await owner.is_held("s-unseen") is False
            async with owner.hold("s-unseen"):
                assert owner.lock_pid != ended
                await owner.check("s-unseen")
    finally:
        await admin.close()
