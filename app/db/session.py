"""Engine and sessionmaker set-up for the three stores: SQLite file, PostgreSQL, memory://."""

from __future__ import annotations

import asyncio
import shutil
import sqlite3
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from sqlalchemy import Connection, Engine, PoolProxiedConnection, event
from sqlalchemy.engine import ExceptionContext, make_url
from sqlalchemy.exc import DisconnectionError, OperationalError
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)
from typing_extensions import override

from app.db import models  # noqa: F401  # registers the tables on Base.metadata
from app.db.base import Base
from app.db.outages import PG_CONNECTION_ERRORS, pg_read_only
from app.db.sqlite_engines import (
    SQLITE_BUSY_TIMEOUT_MS,
    configure_sqlite,
    reads_engine,
    sessions_of,
    writer_engine,
)
from app.db.urls import MEMORY_URL, async_url, pg_connector


def _configure_postgres(engine: Engine) -> None:
    @event.listens_for(engine, "handle_error")
    def _on_error(context: ExceptionContext) -> None:
        # SQLAlchemy knows a lost connection by asyncpg's own verdict (is it closed?), which
        # lags PG_CONNECTION_ERRORS: without this the connection would go back to the pool.
        # A connection that could not be made at all (no `connection`: the database was
        # dropped, too many clients, the server is starting) is as much an outage.
        lost = isinstance(context.original_exception.__cause__, PG_CONNECTION_ERRORS)
        if lost or context.connection is None:
            context.is_disconnect = True
        elif pg_read_only(context.original_exception):
            # A connection made while the database was read-only (ALTER DATABASE ... SET
            # default_transaction_read_only) keeps that default for its life: it is
            # replaced, not pooled again, so the replica recovers once the database does.
            context.is_disconnect = True
            context.invalidate_pool_on_disconnect = False

    @event.listens_for(engine, "checkout")
    def _on_checkout(dbapi_connection: Any, _record: Any, _proxy: Any) -> None:
        # A pooled connection the server ended while it sat idle (its idle timeout, a proxy's,
        # pg_terminate_backend) is known closed to the driver, at no round trip: the pool
        # replaces it before anything is sent. Used, it would fail a write whose outcome is
        # then unknown, which costs a turn the results of the tools it ran.
        if dbapi_connection.driver_connection.is_closed():
            raise DisconnectionError("the server closed this pooled connection")


def _pool_options(database_url: str, *, pool_size: int) -> dict[str, Any]:
    """The async engine's pool: at most `pool_size` connections, kept once opened.

    No overflow: SQLAlchemy closes an overflow connection as soon as it is returned, so load
    just past the pool's size paid a new connection for every transaction past it (on
    PostgreSQL TCP, TLS negotiation and a server process, where a durable write is one round
    trip; on SQLite a file and a thread). A short wait for a pooled connection costs far
    less (measured at 16 concurrent sessions: about half the sessions per second on
    PostgreSQL with 10 + 10, a quarter less on SQLite with SQLAlchemy's 5 + 10)."""
    options: dict[str, Any] = {
        "pool_size": pool_size,
        "max_overflow": 0,
        # While every connection is in use: then 503, never a hang.
        "pool_timeout": 10,
    }
    if make_url(database_url).get_backend_name() == "sqlite":
        return options
    return {
        **options,
        # No pre-ping: it costs a round trip per transaction, i.e. per durable write. A
        # connection the driver knows is closed is replaced at checkout (_configure_postgres);
        # one that dies unnoticed fails its first use (a read is then read again:
        # read_again_if_disconnected), and the pool then replaces every connection older
        # than that failure. A connection is given 5 s (pg_connector): the API answers 503
        # when the database is gone.
        "async_creator": pg_connector(
            database_url,
            command_timeout=30,
            # A stalled runner's open transaction must not block its successor for long.
            server_settings={"idle_in_transaction_session_timeout": "5000"},
        ),
    }


def _scratch_dir() -> Path:
    """memory:// is not durable: a private SQLite file in memory-backed /dev/shm where there is
    one, removed on dispose. Same engine code as the SQLite store, none of its promises (a
    session_id is refused before any work)."""
    shm = Path("/dev/shm")
    return Path(tempfile.mkdtemp(prefix="agent-runner-", dir=shm if shm.is_dir() else None))


T = TypeVar("T")


class Transactor(Protocol):
    """Every write that is not the journal's (session deletes, the bench's set-up) goes
    through `Database.writes`: `body` gets a Connection inside BEGIN … COMMIT (rolled back if
    it raises). On SQLite that keeps every write of the process on one path, which is what
    lets reads never take the write lock (see InlineTransactor); the journal's own writes
    are in app/db/journal/."""

    @property
    def engine(self) -> Engine:
        """The (sync) engine whose connections run the bodies."""
        ...

    async def transact(self, body: Callable[[Connection], T]) -> T:
        """Run `body` in one transaction and return what it returns."""
        ...

    async def dispose(self) -> None:
        """Close every connection."""
        ...


class AsyncTransactor(Transactor):
    """PostgreSQL: the body runs on the async engine's connection (asyncpg, no thread)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    @property
    @override
    def engine(self) -> Engine:
        return self._engine.sync_engine

    @override
    async def transact(self, body: Callable[[Connection], T]) -> T:
        async with self._engine.begin() as conn:
            return await conn.run_sync(body)

    @override
    async def dispose(self) -> None:
        return None


class InlineTransactor(Transactor):
    """SQLite: the body runs right on the event loop's thread, on the stdlib driver.

    A WAL commit with synchronous=NORMAL takes tens of microseconds, several times less than
    handing the work to a thread and back. It cannot stall the loop on a lock: every write of
    this process goes through here, one at a time, and reads (`Database.reads`) never take
    the write lock. Only another process writing the same file can hold it; then BEGIN
    IMMEDIATE fails at once (busy timeout 0) and the body is run again in a worker thread
    that waits for the lock, so the loop never waits. Bodies must therefore be re-runnable:
    they only execute statements, all rolled back when BEGIN fails.

    `transact` hands the body a SQLAlchemy Connection; `transact_driver`, the hot path of
    the journal, the driver's own connection, held from the pool for the process's life.
    """

    def __init__(self, database_url: str) -> None:
        self._engine = writer_engine(database_url, busy_timeout_ms=0)
        self._waiting = writer_engine(database_url, busy_timeout_ms=SQLITE_BUSY_TIMEOUT_MS)
        self._held: PoolProxiedConnection | None = None

    @property
    @override
    def engine(self) -> Engine:
        return self._engine

    async def open(self) -> None:
        """Connect now, off the loop (a first connection's set-up may wait for the lock),
        and keep that connection for `transact_driver`."""
        self._held = await asyncio.to_thread(self._engine.raw_connection)

    @override
    async def transact(self, body: Callable[[Connection], T]) -> T:
        try:
            return self._run(self._engine, body=body)
        except OperationalError as exc:
            if getattr(exc.orig, "sqlite_errorcode", None) != sqlite3.SQLITE_BUSY:
                raise
        return await asyncio.to_thread(self._run, self._waiting, body=body)

    async def transact_driver(
        self, body: Callable[[sqlite3.Connection], T], *, flush: bool = False
    ) -> T:
        """Run `body` in one IMMEDIATE transaction on the held driver connection; with
        `flush`, its commit is on the disk when this returns (the WAL synced: a power loss
        keeps it), where other commits survive a process's death only."""
        assert self._held is not None, "open() first"
        driver = self._held.driver_connection
        assert isinstance(driver, sqlite3.Connection)
        try:
            return _driver_transaction(driver, body=body, flush=flush)
        except _Busy:
            return await asyncio.to_thread(self._run_driver_waiting, body, flush=flush)

    @staticmethod
    def _run(engine: Engine, *, body: Callable[[Connection], T]) -> T:
        with engine.begin() as conn:
            return body(conn)

    def _run_driver_waiting(self, body: Callable[[sqlite3.Connection], T], *, flush: bool) -> T:
        with self._waiting.connect() as conn:
            driver = conn.connection.driver_connection
            assert isinstance(driver, sqlite3.Connection)
            try:
                return _driver_transaction(driver, body=body, flush=flush)
            except _Busy as busy:  # still held after the busy timeout: the driver's error,
                raise busy.error from None  # which callers take for an outage (a 503)

    @override
    async def dispose(self) -> None:
        if self._held is not None:
            self._held.close()
        self._engine.dispose()
        self._waiting.dispose()


class _Busy(Exception):
    """Another process holds the SQLite file's write lock."""

    def __init__(self, error: sqlite3.OperationalError) -> None:
        super().__init__(str(error))
        self.error = error


def _driver_transaction(
    driver: sqlite3.Connection, *, body: Callable[[sqlite3.Connection], T], flush: bool
) -> T:
    """BEGIN IMMEDIATE, the body, COMMIT — or ROLLBACK if anything fails. With `flush`, the
    commit syncs the WAL (synchronous FULL for this transaction)."""
    if flush:
        driver.execute("PRAGMA synchronous = FULL")
    try:
        return _transaction(driver, body=body)
    finally:
        if flush:
            driver.execute("PRAGMA synchronous = NORMAL")


def _transaction(driver: sqlite3.Connection, *, body: Callable[[sqlite3.Connection], T]) -> T:
    try:
        driver.execute("BEGIN IMMEDIATE")
    except sqlite3.OperationalError as exc:
        if exc.sqlite_errorcode == sqlite3.SQLITE_BUSY:
            raise _Busy(exc) from exc
        raise
    try:
        result = body(driver)
        driver.execute("COMMIT")
    except BaseException:  # cancellation too: never leave the transaction open; re-raised
        if driver.in_transaction:
            driver.execute("ROLLBACK")
        raise
    return result


@dataclass
class Database:
    """An engine, its sessionmaker for reads, its way of writing and what kind of store it is.

    `reads` only ever reads: the journal's writes go through app/db/journal/ and
    every other write through `writes`. On SQLite its sessions run on `read_engine`, the
    stdlib driver on the event loop's thread (like the journal's writes): a WAL read takes
    microseconds, and the async engine's driver (aiosqlite) hands each call to a thread and
    back, nine times per read transaction (a read of one session by its id took 1.8 ms
    that way and 0.4 ms this one, on a machine of two CPUs). On PostgreSQL they run on
    `engine` (asyncpg, no thread)."""

    engine: AsyncEngine
    reads: async_sessionmaker[AsyncSession]
    durable: bool
    writes: Transactor
    _scratch: Path | None = None
    _read_engine: Engine | None = None

    @property
    def read_engine(self) -> Engine:
        """The (sync) engine whose connections `reads` use."""
        return self._read_engine or self.engine.sync_engine

    @property
    def dialect(self) -> str:
        """`sqlite` or `postgresql`."""
        return self.engine.dialect.name

    @classmethod
    async def connect(cls, database_url: str, *, pool_size: int) -> Database:
        """Create the engine; memory:// also gets its schema, since it has no migrations."""
        memory = database_url == MEMORY_URL
        scratch = None
        if memory:
            scratch = _scratch_dir()
            database_url = f"sqlite:///{scratch / 'memory.db'}"
        url = async_url(database_url)
        # An error's text must not quote statement parameters: they hold message contents.
        engine = create_async_engine(
            url, hide_parameters=True, **_pool_options(database_url, pool_size=pool_size)
        )
        writer: Transactor = AsyncTransactor(engine)
        read_engine = None
        if engine.dialect.name == "postgresql":
            _configure_postgres(engine.sync_engine)
            # Reads in autocommit: at READ COMMITTED every statement takes its own snapshot
            # anyway, so BEGIN and COMMIT would only add two round trips to each read.
            reads = async_sessionmaker(
                engine.execution_options(isolation_level="AUTOCOMMIT"), expire_on_commit=False
            )
        else:
            # The async engine serves the schema's checks (at start, /readyz) and the bench.
            configure_sqlite(
                engine.sync_engine, begin="BEGIN", busy_timeout_ms=SQLITE_BUSY_TIMEOUT_MS
            )
            writer = inline = InlineTransactor(database_url)
            await inline.open()
            # Reads only: every write goes through `writes`, so a read never takes the write
            # lock and never makes the loop-thread writer wait (see InlineTransactor).
            read_engine = await reads_engine(database_url, pool_size=pool_size)
            reads = async_sessionmaker(
                sync_session_class=sessions_of(read_engine), expire_on_commit=False
            )
        db = cls(engine, reads, durable=not memory, writes=writer)
        db._scratch = scratch
        db._read_engine = read_engine
        if memory:
            async with engine.begin() as conn:
                await conn.run_sync(Base.metadata.create_all)
        return db

    async def dispose(self) -> None:
        """Close every connection."""
        await self.writes.dispose()
        if self._read_engine is not None:
            self._read_engine.dispose()
        await self.engine.dispose()
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
