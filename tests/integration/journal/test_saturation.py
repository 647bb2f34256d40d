"""PostgreSQL out of connections (SQLSTATE 53300): a turn that has started, and may have run
tools, waits for one to store what it holds; a turn not started yet is refused at once."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest
from sqlalchemy.engine import make_url
from sqlalchemy.util import greenlet_spawn

from app.db.outages import EXHAUSTED_DETAIL
from app.db.session import Database
from app.db.urls import asyncpg_dsn
from app.domain import Message, Role
from app.errors import DatabaseUnavailable
from app.metrics import Metrics
from tests.integration.journal.support import CALLS, journal_on, read, start

pytestmark = pytest.mark.parametrize("backend", ["postgres"], indirect=True)


@pytest.fixture
async def one_connection_url(database_url: str) -> AsyncIterator[str]:
    """The database as a role allowed one connection (a superuser has no limit)."""
    role = f"ar_one_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        await admin.execute(f'CREATE ROLE "{role}" LOGIN CONNECTION LIMIT 1')
        await admin.execute(f'GRANT ALL ON ALL TABLES IN SCHEMA public TO "{role}"')
        await admin.execute(f'GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO "{role}"')
        yield make_url(database_url).set(username=role).render_as_string(hide_password=False)
    finally:
        await admin.execute(f'DROP OWNED BY "{role}"')
        await admin.execute(f'DROP ROLE "{role}"')
        await admin.close()


@pytest.fixture
async def one_connection_db(one_connection_url: str) -> AsyncIterator[Database]:
    # A pool of two on a role allowed one: the pool's second connection is the server's to refuse.
    db = await Database.connect(one_connection_url, pool_size=2)
    try:
        yield db
    finally:
        await db.dispose()


async def test_a_started_turns_write_waits_for_a_connection_the_server_has_none_for(
    one_connection_db: Database,
) -> None:
    journal = journal_on(one_connection_db, Metrics())
    turn = await start(journal, "buy it")
    turn.iterations = 1
    held = await one_connection_db.engine.raw_connection()  # the role's one connection

    async def release_soon() -> None:
        await asyncio.sleep(1.0)
        await greenlet_spawn(held.close)

    releasing = asyncio.create_task(release_soon())
    # Write #1 needs a second connection: "too many connections" until the first is back.
    await journal.record_step(turn, assistant=Message.assistant("on it", tool_calls=CALLS))
    await releasing
    stored = await read(one_connection_db)
    assert [m.role for m in stored.history] == [Role.USER, Role.ASSISTANT]


async def test_a_turn_not_started_is_refused_at_once_saying_why(
    one_connection_db: Database,
) -> None:
    journal = journal_on(one_connection_db, Metrics())
    held = await one_connection_db.engine.raw_connection()
    try:
        with pytest.raises(DatabaseUnavailable) as refused:
            await asyncio.wait_for(start(journal, "buy it"), timeout=5)
    finally:
        await greenlet_spawn(held.close)
    assert refused.value.detail == EXHAUSTED_DETAIL
