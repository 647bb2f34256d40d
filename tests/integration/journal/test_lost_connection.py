"""PostgreSQL: a durable write whose connection ends under it (the server or a proxy ending
it, a backend terminated) has an unknown outcome. While the runner still holds the session it
is told from the stored state: committed, it is done; not, it is sent again on a new
connection. Where the session is no longer held (the lock connection ended too) it is taken
again if nobody else holds it and its state is the write's before or after, and told the
same way; otherwise it fails (503), its outcome left to the resume."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AsyncExitStack, contextmanager
from typing import Any

import asyncpg
import pytest

from app.db.session import Database
from app.db.urls import asyncpg_dsn
from app.domain import Message, Role, RunStatus
from app.errors import DatabaseUnavailable
from app.metrics import Metrics
from app.services.journal import DurableJournal
from app.services.pg_ownership import PostgresOwnership
from tests.integration.journal.support import (
    CALLS,
    SESSION,
    journal_on,
    new_turn,
    overtaken_after_write_1,
    read,
    results_for,
    shape,
    start,
)

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.parametrize("backend", ["postgres"], indirect=True),
]

# What each write of a step stores: the user message and the assistant's calls.
STEP = [(1, Role.USER, None), (2, Role.ASSISTANT, None)]


@contextmanager
def next_statement_loses_its_connection(
    *, runs: bool, before: Callable[[], Awaitable[None]] | None = None, reads_too: int = 0
) -> Iterator[list[str]]:
    """The next statement sent on any asyncpg connection of this process ends its connection:
    after the server `runs` it (its answer lost), or before it is sent. `before` runs first.
    So do the next `reads_too` single-row reads after it, before they are sent. Yields the
    statements so ended."""
    real_fetchval, real_fetchrow = asyncpg.Connection.fetchval, asyncpg.Connection.fetchrow
    ended: list[str] = []

    def lost(conn: asyncpg.Connection) -> BaseException:
        conn.terminate()
        error: BaseException = asyncpg.ConnectionDoesNotExistError(
            "connection was closed in the middle of operation"
        )
        return error

    async def fetchval(self: asyncpg.Connection, query: str, *args: Any, **kwargs: Any) -> Any:
        if ended:
            return await real_fetchval(self, query, *args, **kwargs)
        ended.append(query)
        if before is not None:
            await before()
        if runs:
            await real_fetchval(self, query, *args, **kwargs)
        raise lost(self)

    async def fetchrow(self: asyncpg.Connection, query: str, *args: Any, **kwargs: Any) -> Any:
        if not ended or len(ended) > reads_too:
            return await real_fetchrow(self, query, *args, **kwargs)
        ended.append(query)
        raise lost(self)

    asyncpg.Connection.fetchval = fetchval
    asyncpg.Connection.fetchrow = fetchrow
    try:
        yield ended
    finally:
        asyncpg.Connection.fetchval = real_fetchval
        asyncpg.Connection.fetchrow = real_fetchrow


@pytest.mark.parametrize("runs", [True, False], ids=["committed", "never-ran"])
async def test_a_write_whose_connection_ended_is_stored_once(
    db: Database, journal: DurableJournal, runs: bool
) -> None:
    turn = await start(journal, "buy it")
    with next_statement_loses_its_connection(runs=runs) as ended:
        await journal.record_step(turn, assistant=Message.assistant("on it", tool_calls=CALLS))
    assert len(ended) == 1

    stored = await read(db, turn.run_id)
    assert shape(stored.history) == STEP
    assert stored.session is not None and stored.session.message_count == 2
    # The turn goes on: its next write finds the count it expects.
    await journal.record_results(turn, results=results_for(*CALLS))
    assert len((await read(db, turn.run_id)).history) == 4


@pytest.mark.parametrize("runs", [True, False], ids=["committed", "never-ran"])
async def test_a_write_whose_connection_ended_is_told_though_the_first_look_lost_its_own(
    db: Database, journal: DurableJournal, runs: bool
) -> None:
    # The server or a proxy ends several connections at once: the read that tells whether
    # the write committed lost its connection too, and the write answered 503.
    turn = await start(journal, "buy it")
    with next_statement_loses_its_connection(runs=runs, reads_too=1) as ended:
        await journal.record_step(turn, assistant=Message.assistant("on it", tool_calls=CALLS))
    assert len(ended) == 2
    assert shape((await read(db, turn.run_id)).history) == STEP


async def test_a_started_turn_whose_start_record_was_committed_is_not_started_twice(
    db: Database, metrics: Metrics
) -> None:
    # The start record stores no message: whether it committed is told by its run row.
    journal = journal_on(db, metrics)
    with next_statement_loses_its_connection(runs=True):
        turn = await start(journal, "buy it")
    stored = await read(db, turn.run_id)
    assert turn.run_id in stored.runs
    await journal.record_step(turn, assistant=Message.assistant("on it", tool_calls=CALLS))
    assert shape((await read(db, turn.run_id)).history) == STEP


@pytest.fixture
async def runner(database_url: str) -> AsyncIterator[PostgresOwnership]:
    ownership = PostgresOwnership(database_url, heartbeat_s=0.5, takeover_after_s=3)
    await ownership.start()
    try:
        yield ownership
    finally:
        await ownership.stop()


def _lose_the_lock(runner: PostgresOwnership, database_url: str) -> Callable[[], Awaitable[None]]:
    """End the runner's lock connection (and with it its hold on every session)."""

    async def lose() -> None:
        pid = runner.lock_pid
        admin = await asyncpg.connect(asyncpg_dsn(database_url))
        try:
            assert await admin.fetchval("SELECT pg_terminate_backend($1, 5000)", pid)
        finally:
            await admin.close()

    return lose


@pytest.mark.parametrize("runs", [True, False], ids=["committed", "never-ran"])
async def test_with_the_hold_lost_too_the_session_is_taken_again_and_the_write_stored_once(
    db: Database, metrics: Metrics, database_url: str, runner: PostgresOwnership, runs: bool
) -> None:
    # The lock connection ends with the write's: the write failed (503), though nobody else
    # had taken the session and its state still told whether the write had committed.
    journal = journal_on(db, metrics, ownership=runner)
    async with runner.hold(SESSION):
        turn = await start(journal, "buy it")
        with next_statement_loses_its_connection(
            runs=runs, before=_lose_the_lock(runner, database_url)
        ):
            await journal.record_step(turn, assistant=Message.assistant("on it", tool_calls=CALLS))
        assert shape((await read(db, turn.run_id)).history) == STEP
        await runner.check(SESSION)  # held again
        await journal.record_results(turn, results=results_for(*CALLS))
    assert len((await read(db, turn.run_id)).history) == 4


async def test_a_continued_turn_whose_hold_ended_before_its_start_record_takes_it_again(
    db: Database, metrics: Metrics, database_url: str, runner: PostgresOwnership
) -> None:
    # A keyed turn a later turn marked `interrupted`, continued: its hold ends before its
    # start record. Nothing was stored since it read the session (its run still reads
    # `interrupted`), so it takes the session again and starts. It expected `running`, so
    # it was refused as if another runner had taken the session over.
    journal = journal_on(db, metrics, ownership=runner)
    async with runner.hold(SESSION):
        crashed, _ = await overtaken_after_write_1(journal)
        continued = new_turn("buy it", stored_count=6)
        continued.run_id, continued.created_at = crashed.run_id, crashed.created_at
        continued.stored_status = RunStatus.INTERRUPTED.value  # as RunService._continue reads it
        continued.user_stored = True
        await _lose_the_lock(runner, database_url)()
        await journal.record_start(continued, interrupted=[])
        await runner.check(SESSION)  # held again
    assert (await read(db, crashed.run_id)).runs[crashed.run_id].status == RunStatus.RUNNING


async def test_with_the_session_taken_by_another_runner_meanwhile_the_outcome_is_left_unknown(
    db: Database, metrics: Metrics, database_url: str, runner: PostgresOwnership
) -> None:
    # Another runner holds the session once the lock connection has ended: the stored state
    # cannot be trusted to say whether the write committed (that runner may write), so the
    # write fails and the resume decides.
    journal = journal_on(db, metrics, ownership=runner)
    other = PostgresOwnership(database_url, heartbeat_s=0.5, takeover_after_s=3)
    await other.start()
    async with AsyncExitStack() as stack:
        stack.push_async_callback(other.stop)

        async def lose_the_session() -> None:
            await _lose_the_lock(runner, database_url)()
            await stack.enter_async_context(other.hold(SESSION))

        async with runner.hold(SESSION):
            turn = await start(journal, "buy it")
            with (
                next_statement_loses_its_connection(runs=False, before=lose_the_session),
                pytest.raises(DatabaseUnavailable),
            ):
                await journal.record_step(
                    turn, assistant=Message.assistant("on it", tool_calls=CALLS)
                )
    assert (await read(db, turn.run_id)).history == []
