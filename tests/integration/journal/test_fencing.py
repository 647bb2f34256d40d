"""Fencing on PostgreSQL: a runner that lost its session writes and deletes nothing more,
though the message count it expects still holds."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import asyncpg
import pytest
from sqlalchemy import Connection

from app.db.repositories import delete_session
from app.db.session import Database
from app.db.urls import asyncpg_dsn
from app.domain import Message, Role
from app.errors import SessionConflict
from app.metrics import Metrics
from app.services.pg_ownership import PostgresOwnership
from tests.integration.journal.support import (
    CALLS,
    SESSION,
    journal_on,
    new_turn,
    read,
    shape,
    start,
)

pytestmark = pytest.mark.parametrize(
    "backend", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)


@asynccontextmanager
async def two_runners(
    database_url: str,
) -> AsyncIterator[tuple[PostgresOwnership, PostgresOwnership, Callable[[], Awaitable[None]]]]:
    """Runners A and B on one database, and `lose_a()`, which ends A's lock connection (as
    another replica ends a stalled holder's), and with it A's locks."""
    a, b = (PostgresOwnership(database_url, heartbeat_s=0.5, takeover_after_s=3) for _ in range(2))
    await a.start()
    await b.start()
    admin = await asyncpg.connect(asyncpg_dsn(database_url))

    async def lose_a() -> None:
        pid = a.lock_pid
        # With a timeout, pg_terminate_backend waits for the backend (and its lock) to go.
        assert await admin.fetchval("SELECT pg_terminate_backend($1, 5000)", pid)

    try:
        yield a, b, lose_a
    finally:
        await admin.close()
        await a.stop()
        await b.stop()


def fenced_delete(owner: PostgresOwnership) -> Callable[[Connection], None]:
    """The session's delete as `owner` sends it, fenced by its lock."""
    return partial(
        delete_session,
        session_id=SESSION,
        fence_sql=owner.fence_sql,
        fence=owner.fence_params(SESSION),
    )


async def test_a_write_is_fenced_by_this_runners_lock_not_by_anyones(
    db: Database, metrics: Metrics, database_url: str
) -> None:
    # A's lock connection dies (as when another replica ends a stalled holder) and B takes
    # the session; A's next write must fail though the message count it expects still holds.
    async with two_runners(database_url) as (a, b, lose_a):
        journal = journal_on(db, metrics, ownership=a)
        async with a.hold(SESSION):
            turn = await start(journal, "buy it")
            await lose_a()
            async with b.hold(SESSION):
                with pytest.raises(SessionConflict):
                    await journal.record_step(
                        turn, assistant=Message.assistant("on it", tool_calls=CALLS)
                    )
    stored = await read(db, turn.run_id)
    assert stored.history == []
    assert stored.session is not None and stored.session.message_count == 0


@asynccontextmanager
async def row_written_uncommitted(
    database_url: str,
) -> AsyncIterator[Callable[[], Awaitable[None]]]:
    """Another runner's start write, not committed until `commit()`: the session's row
    touched, the run left `running` marked `interrupted`. Meanwhile a statement on the row
    waits for it, and on commit goes on with the row's newest version."""
    writer = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        await writer.execute("BEGIN")
        await writer.execute("UPDATE session SET updated_at = now() WHERE id = $1", SESSION)
        await writer.execute(
            "UPDATE run SET status = 'interrupted' WHERE session_id = $1 AND status = 'running'",
            SESSION,
        )
        yield partial(writer.execute, "COMMIT")
    finally:
        await writer.close()  # rolls back what was not committed


async def waiting_for_a_row(database_url: str) -> None:
    conn = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        for _ in range(500):
            waiting = await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE wait_event_type = 'Lock' AND datname = current_database()"
            )
            if waiting:
                return
            await asyncio.sleep(0.01)
        raise AssertionError("no statement waited for the session's row")
    finally:
        await conn.close()


@pytest.mark.parametrize("statement", ["journal write", "delete"])
async def test_a_statement_that_waited_for_the_sessions_row_is_fenced_again_after_the_wait(
    db: Database, metrics: Metrics, database_url: str, statement: str
) -> None:
    # A's statement starts while A holds the session, then waits for the session's row,
    # which another writer holds; meanwhile A's lock connection dies. After the wait it
    # must do nothing, though the message count a write expects is unchanged. The fence,
    # evaluated once when the statement started, let the delete go through (the journal's
    # write, a CTE, had its fence evaluated again, by luck of the plan's shape).
    async with two_runners(database_url) as (a, _, lose_a):
        journal = journal_on(db, metrics, ownership=a)
        async with a.hold(SESSION):
            turn = await start(journal, "buy it")
            async with row_written_uncommitted(database_url) as commit:
                sent: Coroutine[Any, Any, object] = (
                    db.writes.transact(fenced_delete(a))
                    if statement == "delete"
                    else journal.record_step(
                        turn, assistant=Message.assistant("on it", tool_calls=CALLS)
                    )
                )
                waiting = asyncio.create_task(sent)
                await waiting_for_a_row(database_url)
                await lose_a()
                await commit()
                with pytest.raises(SessionConflict):
                    await waiting
    stored = await read(db, turn.run_id)
    assert stored.history == [] and turn.run_id in stored.runs
    assert stored.session is not None and stored.session.message_count == 0


async def test_a_delete_is_fenced_by_this_runners_lock(
    db: Database, metrics: Metrics, database_url: str
) -> None:
    # A holds the session to delete it; its lock connection dies and B takes the session
    # (B's turn may already have run a tool). A's delete must delete nothing: it once
    # deleted B's committed write #1 under it, and B's keyed retry then ran its tools again.
    async with two_runners(database_url) as (a, b, lose_a):
        journal = journal_on(db, metrics, ownership=b)
        async with a.hold(SESSION):
            await lose_a()
            async with b.hold(SESSION):
                turn = await start(journal, "buy it")
                await journal.record_step(
                    turn, assistant=Message.assistant("on it", tool_calls=CALLS)
                )
                with pytest.raises(SessionConflict):
                    await db.writes.transact(fenced_delete(a))
        stored = await read(db, turn.run_id)
        assert shape(stored.history) == [(1, Role.USER, None), (2, Role.ASSISTANT, None)]
        async with b.hold(SESSION):  # its owner's delete goes through
            await db.writes.transact(fenced_delete(b))
    stored = await read(db, turn.run_id)
    assert stored.session is None and stored.history == [] and stored.runs == {}


@pytest.mark.parametrize("first", ["a dispatch's check", "a write"])
async def test_a_runner_whose_lock_connection_ended_takes_the_session_again_if_nobody_came(
    db: Database, metrics: Metrics, database_url: str, first: str
) -> None:
    # A's lock connection ends (an administrator, a proxy, a network blip) and no other
    # runner comes: A takes the session again on a new connection, finds nothing stored
    # since its last write, and goes on. It stopped, and its completed calls became
    # durability errors on resume.
    async with two_runners(database_url) as (a, _, lose_a):
        journal = journal_on(db, metrics, ownership=a)
        async with a.hold(SESSION):
            turn = await start(journal, "buy it")
            await lose_a()
            if first == "a dispatch's check":
                await journal.check_owned(turn)
            await journal.record_step(turn, assistant=Message.assistant("on it", tool_calls=CALLS))
            await journal.check_owned(turn)
    stored = await read(db, turn.run_id)
    assert shape(stored.history) == [(1, Role.USER, None), (2, Role.ASSISTANT, None)]


async def test_a_runner_whose_lock_connection_ended_does_not_go_on_after_another_came_and_went(
    db: Database, metrics: Metrics, database_url: str
) -> None:
    # Meanwhile B took the session, started a turn on it (marking A's run interrupted) and
    # let it go, its model failing: the message count is unchanged, but A must not go on.
    async with two_runners(database_url) as (a, b, lose_a):
        journal_a, journal_b = (
            journal_on(db, metrics, ownership=a),
            journal_on(db, metrics, ownership=b),
        )
        async with a.hold(SESSION):
            turn = await start(journal_a, "buy it")
            await lose_a()
            async with b.hold(SESSION):
                later = new_turn("other")
                later.session_exists = True
                await journal_b.record_start(later, interrupted=[turn.run_id])
            with pytest.raises(SessionConflict):
                await journal_a.check_owned(turn)
            with pytest.raises(SessionConflict):
                await journal_a.record_step(
                    turn, assistant=Message.assistant("on it", tool_calls=CALLS)
                )
    stored = await read(db, turn.run_id)
    assert stored.history == []
    assert stored.runs[turn.run_id].status == "interrupted"
