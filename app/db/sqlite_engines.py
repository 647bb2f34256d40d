"""SQLite: how its connections are set up (the async engine's too), and the engines on the
standard library's driver that its writes (`InlineTransactor`) and its reads run on."""

from __future__ import annotations

import asyncio
import sqlite3
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session
from typing_extensions import override

from app.db.urls import sqlite_file

SQLITE_BUSY_TIMEOUT_MS = 10_000


def check_sqlite_writable(database_url: str) -> None:
    """Raise sqlite3.Error unless this process can write the (migrated) SQLite file as serving
    does: a write rolled back ("attempt to write a readonly database" for a read-only file)."""
    database = sqlite_file(database_url)
    if database is None:
        return
    conn = sqlite3.connect(database, timeout=SQLITE_BUSY_TIMEOUT_MS / 1000, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.execute("UPDATE alembic_version SET version_num = version_num")
        finally:
            conn.execute("ROLLBACK")
    finally:
        conn.close()


def configure_sqlite(
    engine: Engine, *, begin: str, busy_timeout_ms: int, reads_only: bool = False
) -> None:
    """Every connection of `engine` in WAL mode with our own `begin` statement."""

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Take over transaction control from the driver so the BEGIN below is ours.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        if not reads_only:  # a connection that only reads takes no lock to set up
            cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")  # set-up may wait
            cursor.execute("PRAGMA foreign_keys = ON")
            cursor.execute("PRAGMA journal_mode = WAL")  # kept by the file once set
            # With WAL, NORMAL survives any process crash (kill -9); a power loss can drop the
            # last commits. A write that tool handlers wait for is flushed (`transact_driver`).
            cursor.execute("PRAGMA synchronous = NORMAL")
        cursor.execute(f"PRAGMA busy_timeout = {busy_timeout_ms}")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        conn.exec_driver_sql(begin)


def writer_engine(database_url: str, *, busy_timeout_ms: int) -> Engine:
    """An engine that writes: IMMEDIATE takes the write lock up front, so a body fails at
    BEGIN or not at all."""
    engine = _stdlib_engine(database_url)
    configure_sqlite(engine, begin="BEGIN IMMEDIATE", busy_timeout_ms=busy_timeout_ms)
    return engine


def _stdlib_engine(
    database_url: str, *, connection: type[sqlite3.Connection] = sqlite3.Connection, **pool: Any
) -> Engine:
    # The standard library's driver, whichever the URL names (sqlite+aiosqlite:// is accepted).
    url = make_url(database_url).set(drivername="sqlite")
    connect_args = {"check_same_thread": False, "factory": connection}
    return create_engine(url, connect_args=connect_args, **pool)


async def reads_engine(database_url: str, *, pool_size: int) -> Engine:
    """The engine reads run on, on the event loop's thread (see `Database.reads`).

    A connection that only reads never waits for a lock: in WAL mode a reader waits only
    while another connection runs recovery, closes the file's last connection or holds it in
    EXCLUSIVE locking mode, none of which can happen while this process has the file open
    (its writer connection is). Should one ever be refused, its read fails at once (busy
    timeout 0: a 503) rather than stall the loop. No pool limit: a read's statements never
    yield to the loop, so transactions overlap only where a body awaits something else, or
    for the instant its `async with` takes to end, and a wait for a connection on the loop's
    thread could never end. The first connection is opened now, off the loop."""
    engine = _stdlib_engine(
        database_url, connection=_ReadConnection, pool_size=pool_size, max_overflow=-1
    )
    configure_sqlite(engine, begin="BEGIN", busy_timeout_ms=0, reads_only=True)
    await asyncio.to_thread(lambda: engine.connect().close())
    return engine


class _ReadCursor(sqlite3.Cursor):
    """AsyncSession ends a Core result (one of a statement naming no ORM entity, such as
    `text()`) by awaiting its cursor's `_async_soft_close`, which SQLAlchemy's async driver
    adapters have; on the stdlib driver the result closes its cursor itself."""

    async def _async_soft_close(self) -> None:
        return None


class _ReadConnection(sqlite3.Connection):
    """A read connection, whose cursors are _ReadCursors."""

    @override
    def cursor(self, factory: Any = _ReadCursor) -> Any:
        return super().cursor(factory)


def sessions_of(engine: Engine) -> type[Session]:
    """A Session class bound to `engine`: an AsyncSession made with it runs every statement
    right where it is awaited, since no driver call of `engine` ever awaits (AsyncSession
    passes the Session it makes its own binds, None here)."""

    class BoundSession(Session):
        def __init__(self, *, bind: object = None, binds: object = None, **kw: Any) -> None:
            super().__init__(bind=engine, **kw)

    return BoundSession
