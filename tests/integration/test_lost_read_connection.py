"""PostgreSQL: a read whose pooled connection the server had ended, unseen by the driver
(the backend's end racing the checkout), is read again on a new connection, not a 503; a
session's delete, told done or not, is sent again."""

from __future__ import annotations

from typing import Any

import asyncpg
import pytest
from sqlalchemy.engine import Connection

import app.services.sessions as services_sessions
from app.db.migrate import database_state
from app.db.repositories import delete_session
from app.db.session import Database
from app.db.urls import asyncpg_dsn
from app.errors import SessionNotFound
from app.metrics import Metrics
from app.services.ownership import LocalOwnership
from app.services.sessions import SessionService
from tests.integration.journal.support import SESSION, journal_on, start

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.parametrize("backend", ["postgres"], indirect=True),
]


async def _end_pooled_connections(database_url: str) -> int:
    admin = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        pids = await admin.fetch(
            "SELECT pid FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        for row in pids:
            # With a timeout, pg_terminate_backend waits for the backend to go.
            await admin.fetchval("SELECT pg_terminate_backend($1, 5000)", row["pid"])
        return len(pids)
    finally:
        await admin.close()


@pytest.mark.parametrize("read", ["sessions list", "readiness"])
async def test_a_read_on_a_pooled_connection_the_server_ended_unseen_is_read_again(
    db: Database, database_url: str, monkeypatch: pytest.MonkeyPatch, read: str
) -> None:
    sessions = SessionService(db, LocalOwnership(), Metrics())

    async def reads() -> object:
        if read == "readiness":
            return (await database_state(db)).revision
        page = await sessions.list(tenant_id=None, agent=None, user_id=None, after=None, limit=5)
        return len(page.data)

    expected = await reads()  # and a connection now sits in the pool
    assert await _end_pooled_connections(database_url) >= 1
    staged = _stage_the_race(monkeypatch)
    assert await reads() == expected
    assert staged  # the race was staged


async def test_a_session_delete_whose_pooled_connection_the_server_ended_unseen_deletes(
    db: Database, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its reads (may the caller see the session?) answered 503 though the database was up.
    await start(journal_on(db, Metrics()), "to be deleted")
    sessions = SessionService(db, LocalOwnership(), Metrics())
    await sessions.get(SESSION, tenant_id="tenant-1", user_id=None)  # a connection in the pool
    assert await _end_pooled_connections(database_url) >= 1
    staged = _stage_the_race(monkeypatch)
    await sessions.delete(SESSION, tenant_id="tenant-1", user_id=None)
    assert staged
    with pytest.raises(SessionNotFound):
        await sessions.get(SESSION, tenant_id="tenant-1", user_id=None)


async def test_a_session_delete_whose_own_connection_ends_under_it_is_sent_again(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    # It answered 503 though the database was up, and the session was still there.
    await start(journal_on(db, Metrics()), "to be deleted")
    sessions = SessionService(db, LocalOwnership(), Metrics())
    ended: list[bool] = []

    def delete_on_an_ending_connection(conn: Connection, **kwargs: Any) -> None:
        if not ended:
            ended.append(True)
            conn.exec_driver_sql("SELECT pg_terminate_backend(pg_backend_pid())")
        delete_session(conn, **kwargs)

    monkeypatch.setattr(services_sessions, "delete_session", delete_on_an_ending_connection)
    await sessions.delete(SESSION, tenant_id="tenant-1", user_id=None)
    assert ended
    with pytest.raises(SessionNotFound):
        await sessions.get(SESSION, tenant_id="tenant-1", user_id=None)


def _stage_the_race(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """The race: the pool's check at checkout (is the driver's connection closed?) runs just
    before the driver reads the server's goodbye. The list says whether it was staged."""
    staged: list[bool] = []
    real = asyncpg.Connection.is_closed

    def is_closed(self: asyncpg.Connection) -> bool:
        if staged:
            return bool(real(self))
        staged.append(True)
        return False

    monkeypatch.setattr(asyncpg.Connection, "is_closed", is_closed)
    return staged
