"""Looking into a transaction while it is open: a failpoint that raises instead of ending the
process, whether a write's rows were sent uncommitted, and a session's rows or the message
table held locked."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import asyncpg

from app.db.session import Database, InlineTransactor
from app.db.urls import asyncpg_dsn
from app.failpoints import Failpoints


class Crash(Exception):
    """Stands for the process ending at a failpoint (which would end the test too)."""


class CrashAt(Failpoints):
    """Armed at one point: reaching it runs `probe` (what a crash there would leave behind
    is looked at) and raises Crash instead of ending the process."""

    def __init__(self, name: str, probe: Callable[[], None]) -> None:
        super().__init__({name: 1})
        self.name, self.probe = name, probe

    def reach(self, name: str) -> None:
        if name == self.name:
            self.probe()
            raise Crash(name)


def results_sent_uncommitted(db: Database, results: int) -> bool:
    """Whether the journal's open write transaction has sent `results` tool messages and
    committed none (call it from inside the write, e.g. at `in-write-2`).

    SQLite: counted on the writing connection itself, which sees its own uncommitted rows
    (the transactor's held connection: there is no other way in). PostgreSQL: uncommitted
    rows are not visible elsewhere, so from another connection: no tool message committed,
    and the writer's transaction holding the lock an INSERT into `message` takes."""
    if db.dialect == "sqlite":
        assert isinstance(db.writes, InlineTransactor)
        held = db.writes._held
        driver = held.driver_connection if held is not None else None
        assert isinstance(driver, sqlite3.Connection) and driver.in_transaction
        sent = driver.execute("SELECT count(*) FROM message WHERE role = 'tool'").fetchone()[0]
        return bool(sent == results)

    async def look() -> bool:
        conn = await asyncpg.connect(
            asyncpg_dsn(db.engine.url.render_as_string(hide_password=False))
        )
        try:
            committed = await conn.fetchval("SELECT count(*) FROM message WHERE role = 'tool'")
            inserting = await conn.fetchval(
                "SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation"
                " JOIN pg_stat_activity a ON a.pid = l.pid"
                " WHERE c.relname = 'message' AND l.mode = 'RowExclusiveLock'"
                " AND a.state = 'idle in transaction'"
                " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            )
            return bool(committed == 0 and inserting == 1)
        finally:
            await conn.close()

    # Called inside the journal's write, on the event loop: look from another thread.
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, look()).result(timeout=30)


_ROWS = {
    "session": "SELECT 1 FROM session WHERE id = $1 FOR UPDATE",
    "message": "SELECT 1 FROM message WHERE session_key ="
    " (SELECT key FROM session WHERE id = $1) FOR UPDATE",
    "run": "SELECT 1 FROM run WHERE session_id = $1 FOR UPDATE",
}


class SessionRowLock:
    """Holds the session's row (or its messages' or runs' rows: `table`) FOR UPDATE in a transaction
    of another connection (PostgreSQL), so that a turn's writes on it, or a delete, wait;
    `blocked()` says whether a statement waits."""

    def __init__(
        self,
        database_url: str,
        *,
        session_id: str,
        table: Literal["session", "message", "run"] = "session",
    ) -> None:
        self._dsn = asyncpg_dsn(database_url)
        self._session_id = session_id
        self._rows = _ROWS[table]
        self._locked = threading.Event()
        self._release = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._hold()), daemon=True)

    async def _hold(self) -> None:
        conn = await asyncpg.connect(self._dsn)
        try:
            async with conn.transaction():
                await conn.execute(self._rows, self._session_id)
                self._locked.set()
                await asyncio.to_thread(self._release.wait, 60)
        finally:
            await conn.close()

    def blocked(self) -> bool:
        return self.waiting() > 0

    def waiting(self) -> int:
        """How many statements of the database wait on a lock."""

        async def count() -> int:
            conn = await asyncpg.connect(self._dsn)
            try:
                return int(
                    await conn.fetchval(
                        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                        " AND datname = current_database()"
                    )
                )
            finally:
                await conn.close()

        return asyncio.run(count())

    def __enter__(self) -> SessionRowLock:
        self._thread.start()
        assert self._locked.wait(15), "the row lock was not taken"
        return self

    def __exit__(self, *exc: object) -> None:
        self._release.set()
        self._thread.join(15)
        assert not self._thread.is_alive(), "the row lock was not given back"


class TableLock:
    """An ACCESS EXCLUSIVE lock on `message`, held by another client until released: every
    statement of the server that reads or writes messages waits, holding its connection."""

    def __init__(self, database_url: str) -> None:
        self._dsn = asyncpg_dsn(database_url)
        self._loop = asyncio.new_event_loop()
        self._conn: asyncpg.Connection | None = None

    def take(self) -> None:
        async def take() -> None:
            self._conn = await asyncpg.connect(self._dsn)
            await self._conn.execute("BEGIN; LOCK TABLE message IN ACCESS EXCLUSIVE MODE")

        self._loop.run_until_complete(take())

    def waiting(self) -> int:
        """How many other backends of this database wait for a lock."""
        return self._count_others("wait_event_type = 'Lock'")

    def connected(self) -> int:
        """How many other backends this database has (connections open to it)."""
        return self._count_others("true")

    def _count_others(self, condition: str) -> int:
        async def count() -> int:
            assert self._conn is not None
            sql = (
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                f" AND {condition} AND pid <> pg_backend_pid()"
            )
            # Inside the lock's transaction: a fresh look at the activity, not the first one.
            await self._conn.execute("SELECT pg_stat_clear_snapshot()")
            return int(await self._conn.fetchval(sql))

        return self._loop.run_until_complete(count())

    def release(self) -> None:
        async def release() -> None:
            if self._conn is not None:
                await self._conn.close()  # its transaction, and the lock, end with it

        self._loop.run_until_complete(release())
        self._loop.close()
