"""A page of a stored list (app/db/pages.py): at most `limit` rows, none that would take the
bytes of their text past the budget but the first, read as one snapshot, on both stores."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from functools import partial

import pytest
from sqlalchemy import insert, update
from sqlalchemy.engine import Connection

from app.db import models
from app.db.repositories import MessageRepository, RunRepository
from app.db.session import Database


async def _history(db: Database, contents: list[str]) -> int:
    """A session holding messages of these contents; its key."""

    def write(conn: Connection) -> int:
        key: int = conn.execute(
            insert(models.Session)
            .values(id="paged", agent="echo", message_count=len(contents))
            .returning(models.Session.key)
        ).scalar_one()
        for seq, content in enumerate(contents, start=1):
            conn.execute(
                insert(models.Message).values(
                    session_key=key, seq=seq, role="user", content=content, is_error=False
                )
            )
        return key

    return await db.writes.transact(write)


async def _walk(db: Database, key: int, *, limit: int, budget: int) -> list[list[str]]:
    """Every page of the history, as their contents."""
    pages: list[list[str]] = []
    after: int | None = None
    while True:
        async with db.reads.begin() as session:
            page = await MessageRepository(session).page(
                key, after_seq=after, limit=limit, budget=budget
            )
        pages.append([m.content for m in page.rows])
        if not page.more:
            return pages
        after = page.rows[-1].seq


@pytest.mark.parametrize(
    ("contents", "limit", "pages"),
    [
        ([], 5, [[]]),
        (["aaa", "bbb", "ccc"], 5, [["aaa", "bbb", "ccc"]]),
        (["aaa", "bbb", "ccc", "ddd"], 3, [["aaa", "bbb", "ccc"], ["ddd"]]),  # the limit
        (["aaaa", "bbbb", "cccc"], 5, [["aaaa", "bbbb"], ["cccc"]]),  # the third passes 10
        (["aaaaa", "bbbbb"], 5, [["aaaaa", "bbbbb"]]),  # exactly the budget fits
        (["a" * 25, "b"], 5, [["a" * 25], ["b"]]),  # a first row past it is a page
        (["a", "b" * 25, "c"], 5, [["a"], ["b" * 25], ["c"]]),
        (["éé", "éé", "éé"], 5, [["éé", "éé"], ["éé"]]),  # bytes: 4 each, not 2
    ],
)
async def test_a_history_page_holds_limit_rows_within_the_budget(
    db: Database, contents: list[str], limit: int, pages: list[list[str]]
) -> None:
    key = await _history(db, contents)

    assert await _walk(db, key, limit=limit, budget=10) == pages


async def test_a_runs_page_is_one_snapshot_while_a_run_moves(db: Database) -> None:
    # Read in two statements, on PostgreSQL (where each statement sees what has committed
    # when it starts) a page lost a row, and said none followed, when a run moved between them.
    await _history(db, [])
    runs = [
        {
            "id": f"run-{n:02d}",
            "session_id": "paged",
            "agent": "echo",
            "status": "complete",
            "iterations": 0,
            "input_tokens": 0,
            "output_tokens": 0,
            "metadata_": {},
            "created_at": datetime(2026, 1, 1, tzinfo=UTC) + timedelta(minutes=n),
        }
        for n in range(30)
    ]
    await db.writes.transact(lambda conn: conn.execute(insert(models.Run), runs))
    moves = [datetime(2999, 1, 1, tzinfo=UTC), datetime(2000, 1, 1, tzinfo=UTC)]  # newest, oldest
    stop = asyncio.Event()

    def move(conn: Connection, *, to: datetime) -> None:
        conn.execute(update(models.Run).where(models.Run.id == "run-00").values(created_at=to))

    async def mover() -> None:
        while not stop.is_set():
            for to in moves:
                await db.writes.transact(partial(move, to=to))
                await asyncio.sleep(0)

    moving = asyncio.create_task(mover())
    try:
        for _ in range(300):
            async with db.reads.begin() as session:
                page = await RunRepository(session).list_for_session(
                    "paged", after=None, limit=50, budget=1 << 20
                )
            assert (len(page.rows), page.more) == (30, False)
            await asyncio.sleep(0)
    finally:
        stop.set()
        await moving
