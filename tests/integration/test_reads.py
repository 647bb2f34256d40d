"""Reads (`Database.reads`): on SQLite they run on the event loop's thread, on the stdlib
driver, with a connection for every transaction open at once; every kind of statement reads
alike on both stores."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from sqlalchemy import event, literal, select, text

from app.db import models
from app.db.repositories import SessionRepository
from app.db.session import Database

sqlite_only = pytest.mark.parametrize("backend", ["sqlite"], indirect=True)


@sqlite_only
async def test_a_sqlite_read_runs_on_the_event_loops_thread(db: Database) -> None:
    threads: list[int] = []  # where SQLite itself ran each statement

    def on_checkout(dbapi_connection: Any, *_args: Any) -> None:
        dbapi_connection.set_trace_callback(lambda _sql: threads.append(threading.get_ident()))

    event.listen(db.read_engine.pool, "checkout", on_checkout)
    try:
        async with db.reads.begin() as session:
            assert await SessionRepository(session).get("nobody") is None
    finally:
        event.remove(db.read_engine.pool, "checkout", on_checkout)
    assert len(threads) >= 2, threads  # BEGIN and the SELECT
    assert set(threads) == {threading.get_ident()}


@sqlite_only
async def test_more_sqlite_reads_open_at_once_than_the_pool_keeps_each_get_a_connection(
    db: Database,
) -> None:
    # The fixture's pool keeps 5. A read waiting for a connection on the loop's thread would
    # wait for good: the reads holding them could never go on to end.
    readers = 8
    all_open = asyncio.Barrier(readers)

    async def read() -> int | None:
        async with db.reads.begin() as session:
            assert await SessionRepository(session).get("nobody") is None
            await all_open.wait()  # every transaction open, each on a connection
            return await session.scalar(select(literal(1)))

    got = await asyncio.wait_for(asyncio.gather(*(read() for _ in range(readers))), 10)
    assert got == [1] * readers
    # A QueuePool's count; Pool, the type the engine declares, has none.
    assert db.read_engine.pool.checkedout() == 0  # type: ignore[attr-defined]


async def test_statements_naming_no_orm_entity_read_on_every_store(db: Database) -> None:
    async with db.reads.begin() as session:
        assert (await session.execute(text("SELECT 2"))).scalar() == 2
        assert await session.scalar(select(literal(3))) == 3
        assert list(await session.scalars(select(models.Session.id))) == []
