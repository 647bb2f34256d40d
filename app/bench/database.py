"""What the bench asks of the database and what it leaves there: transactions, bytes, floor."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import sqlite3
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import asyncpg
from sqlalchemy import Column, Integer, MetaData, Table, Text, event, text
from sqlalchemy.engine import make_url

from app.bench.report import Stats, Transactions
from app.bench.scenario import USER_MESSAGE, BenchError, BenchOptions, durable_writes
from app.db.journal import JournalStore, PostgresJournalStore
from app.db.session import Database, InlineTransactor
from app.db.urls import pg_connector, sqlite_file
from app.services.ownership import Ownership

log = logging.getLogger(__name__)

FLOOR_TABLE = Table(
    "bench_commit_floor",
    MetaData(),
    Column("id", Integer, primary_key=True),
    Column("payload", Text, nullable=False),
)
FLOOR_SQL_PG = "INSERT INTO bench_commit_floor (payload) VALUES ($1)"
WRITES = ("INSERT", "UPDATE", "DELETE")


@dataclass
class TransactionCounter:
    """Counts COMMITs, writing transactions, statements and pool checkouts: SQLAlchemy's on
    the read engine, and those the journal store reports for the writes it sends on the
    driver itself; and the statements ownership sends on its own connection."""

    db: Database
    store: JournalStore
    ownership: Ownership
    commits: int = 0
    writing: int = 0
    statements: int = 0
    checkouts: int = 0
    _dirty: set[int] = field(default_factory=set)
    _locks_before: int = 0
    _locks: int = 0

    def _on_commit(self, conn: Any) -> None:
        self.commits += 1
        if id(conn) in self._dirty:
            self.writing += 1
            self._dirty.discard(id(conn))

    def _on_rollback(self, conn: Any) -> None:
        self._dirty.discard(id(conn))

    # Positional: SQLAlchemy calls it so.
    def _on_execute(self, conn: Any, cursor: Any, statement: str, *args: Any) -> None:  # noqa: PLR0917
        verb = statement.lstrip()[:6].upper()
        if verb.startswith("BEGIN"):
            return
        self.statements += 1
        if verb in WRITES:
            self._dirty.add(id(conn))

    def _on_checkout(self, *args: Any) -> None:
        self.checkouts += 1

    def _on_store_commit(self, statements: int) -> None:
        self.commits += 1  # every transaction of the journal store is a write
        self.writing += 1
        self.statements += statements

    def _listeners(self) -> list[tuple[Any, str, Any]]:
        # Reads go through SQLAlchemy (db.read_engine); durable writes through the journal
        # store, which sends its statements on the driver and reports its commits; on SQLite
        # on an engine of its own (db.writes), whose pool checkouts count too.
        reads = self.db.read_engine
        return [
            (reads, "commit", self._on_commit),
            (reads, "rollback", self._on_rollback),
            (reads, "before_cursor_execute", self._on_execute),
            *(
                (engine.pool, "checkout", self._on_checkout)
                for engine in {reads, self.db.writes.engine}
            ),
        ]

    def __enter__(self) -> TransactionCounter:
        for target, name, fn in self._listeners():
            event.listen(target, name, fn)
        self.store.observers.append(self._on_store_commit)
        self._locks_before = self.ownership.statements
        return self

    # Positional: the context-manager protocol.
    def __exit__(  # noqa: PLR0917
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for target, name, fn in self._listeners():
            event.remove(target, name, fn)
        self.store.observers.remove(self._on_store_commit)
        self._locks = self.ownership.statements - self._locks_before

    def result(self) -> Transactions:
        """What was counted, split by kind."""
        return Transactions(
            self.commits,
            self.writing,
            self.commits - self.writing,
            self.statements,
            self.checkouts,
            self._locks,
        )


async def stored_bytes(db: Database, *, database_url: str) -> int:
    """SQLite: the pages the file uses (its free pages, left by deleted rows, not counted);
    PostgreSQL: the scenario tables' size (in the bench's own schema: see own_schema)."""
    if db.dialect == "sqlite":
        path = sqlite_file(database_url)
        assert path is not None
        return await asyncio.to_thread(_used_bytes, path)
    async with db.engine.connect() as conn:
        size = await conn.scalar(
            text(
                "SELECT pg_total_relation_size('\"session\"') + pg_total_relation_size('run')"
                " + pg_total_relation_size('message')"
            )
        )
    return int(size or 0)


def _used_bytes(path: Path) -> int:
    conn = sqlite3.connect(path)
    try:
        pages, free, page_size = (
            conn.execute(f"PRAGMA {name}").fetchone()[0]
            for name in ("page_count", "freelist_count", "page_size")
        )
    finally:
        conn.close()
    return int((pages - free) * page_size)


@contextmanager
def own_schema(database_url: str) -> Iterator[str]:
    """The URL the bench works on: on PostgreSQL, in a schema of its own, dropped at the end,
    so it leaves nothing in the database and finds no free space there that would hide what
    its sessions store; any other store as given."""
    if make_url(database_url).get_backend_name() not in ("postgresql", "postgres"):
        yield database_url
        return
    schema = f"agent_runner_bench_{uuid.uuid4().hex[:12]}"
    try:
        _execute(database_url, sql=f'CREATE SCHEMA "{schema}"', what="create the bench's schema")
    except BenchError:
        raise  # refused, or the database is out of reach: nothing was made
    except BaseException:
        # Stopped while it was being made: committed, it is there (a signal landing after the
        # commit, as the connection closed, left it behind).
        _drop_if_able(database_url, schema=schema)
        raise
    try:
        url = make_url(database_url).update_query_dict({"search_path": schema})
        yield url.render_as_string(hide_password=False)
    except BaseException:
        _drop_if_able(database_url, schema=schema)
        raise
    _drop(database_url, schema=schema)


def _drop_if_able(database_url: str, *, schema: str) -> None:
    """The bench failed or was stopped: say so, whether or not the schema goes too."""
    with contextlib.suppress(BenchError):
        _drop(database_url, schema=schema)


def _drop(database_url: str, *, schema: str) -> None:
    what = f"drop the bench's schema {schema} (drop it by hand)"
    _execute(database_url, sql=f'DROP SCHEMA IF EXISTS "{schema}" CASCADE', what=what)


def _execute(database_url: str, *, sql: str, what: str) -> None:
    async def run() -> None:
        conn = await pg_connector(database_url)()
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    try:
        asyncio.run(run())
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        log.warning("could not %s: %s", what, exc)
        raise BenchError(f"could not {what}: {exc}") from exc


@asynccontextmanager
async def others_held(
    database_url: str, *, count: int
) -> AsyncIterator[Callable[[bool], Awaitable[None]]]:
    """On one connection of its own, `hold(True)` takes `count` session-level advisory locks
    on random bigint keys, as many running sessions' owners hold theirs, and `hold(False)`
    lets them go (PostgreSQL)."""
    conn = await pg_connector(database_url)()
    keys = [secrets.randbits(64) - 2**63 for _ in range(count)]
    verb = {True: "pg_advisory_lock", False: "pg_advisory_unlock"}

    async def hold(held: bool) -> None:
        await conn.execute(f"SELECT {verb[held]}(k) FROM unnest($1::bigint[]) AS k", keys)

    try:
        yield hold
    finally:
        await conn.close()  # lets go of whatever it holds


async def commit_floor(db: Database, *, store: JournalStore, options: BenchOptions) -> Stats:
    """2 x steps + 1 bare INSERT+COMMIT transactions the way durable writes go, in ms: on
    the driver, on PostgreSQL one statement in autocommit, on SQLite a `db.writes` body."""

    def bare(driver: sqlite3.Connection) -> None:
        driver.execute("INSERT INTO bench_commit_floor (payload) VALUES (?)", (USER_MESSAGE,))

    async def transaction() -> None:
        if isinstance(store, PostgresJournalStore):
            await store.fetchval(FLOOR_SQL_PG, args=[USER_MESSAGE])
        else:
            assert isinstance(db.writes, InlineTransactor)
            await db.writes.transact_driver(bare)

    await db.writes.transact(lambda conn: FLOOR_TABLE.create(conn, checkfirst=True))
    times: list[float] = []
    try:
        for index in range(options.warmup + max(30, options.sessions)):
            start = time.perf_counter()
            for _ in range(durable_writes(options.steps)):
                await transaction()
            if index >= options.warmup:
                times.append((time.perf_counter() - start) * 1000)
    finally:
        await db.writes.transact(lambda conn: FLOOR_TABLE.drop(conn, checkfirst=True))
    return Stats.of(times)


async def database_version(db: Database) -> str:
    """The server's version (SQLite: the library's)."""
    if db.dialect == "sqlite":
        return sqlite3.sqlite_version
    async with db.engine.connect() as conn:
        return str(await conn.scalar(text("SELECT current_setting('server_version')")))
