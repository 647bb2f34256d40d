"""The durable writes of a turn, one transaction each (CONTRACT §2), on either store.

A write is described by a `JournalWrite` and carried out by the store's `JournalStore`, in
SQL sent on the database driver itself (SQLAlchemy's layers cost more than the statements):
- SQLite: `SqliteJournalStore`, a few fixed statements in one transaction body on
  `Database.writes`, on the event loop's thread (app/db/session.py, InlineTransactor).
- PostgreSQL: `PostgresJournalStore`, ONE statement per write (data-modifying CTEs) in
  autocommit: a write is one round trip and one commit.

Every write claims the session's next `seq` values with a compare-and-set on
`session.message_count` (or creates the session) under the ownership fence
(services/ownership.py), and only a successful claim inserts anything. A runner that lost the
session, or a second writer, therefore writes nothing and gets SessionConflict; a repeated
write conflicts on `(session_key, seq)` instead of duplicating. Messages name their session
by its `key` (app/db/models.py), which the write finds from the session's id.
"""

from __future__ import annotations

import json
import logging
import re
import sqlite3
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

import asyncpg
from sqlalchemy import String
from sqlalchemy.dialects import postgresql
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.util import greenlet_spawn

from app.db import models
from app.db.base import Base
from app.db.repositories import message_to_row
from app.db.session import PG_CONNECTION_ERRORS, Database, InlineTransactor
from app.domain import Message, RunStatus
from app.errors import DatabaseUnavailable, SessionConflict

log = logging.getLogger(__name__)


@dataclass
class JournalWrite:
    """One durable write: messages appended after `expected`, and the run rows it touches.

    `messages` have their `seq` set. `new_session` (the row's values) creates the session
    instead of advancing it; `new_run` inserts the turn's run, `run_values` updates it;
    `interrupted` marks other runs of the session `interrupted`. `touch` moves the session's
    `updated_at` (start and end of a turn only: it is indexed). `before_commit` runs after
    every row is sent and before the commit (the `in-write-2` failpoint).
    """

    session_id: str
    run_id: str
    expected: int
    now: datetime
    fence: dict[str, Any]
    messages: Sequence[Message] = ()
    touch: bool = False
    new_session: dict[str, Any] | None = None
    new_run: dict[str, Any] | None = None
    run_values: dict[str, Any] | None = None
    interrupted: Sequence[str] = ()
    before_commit: Callable[[], None] | None = None

    @property
    def new_count(self) -> int:
        return self.expected + len(self.messages)


class JournalStore(Protocol):
    # Called after each commit with the number of statements it held (the bench counts).
    observers: list[Callable[[int], None]]

    async def write(self, write: JournalWrite) -> None:
        """Commit the write, or raise SessionConflict having written nothing."""
        ...


def journal_store(db: Database, fence_sql: str) -> JournalStore:
    """The store's way of writing, fenced by the ownership's SQL condition."""
    if db.dialect == "postgresql":
        return PostgresJournalStore(db.engine, fence_sql)
    assert isinstance(db.writes, InlineTransactor)
    return SqliteJournalStore(db.writes, fence_sql)


_PG = postgresql.dialect()  # type: ignore[no-untyped-call]


def _typed(model: type[Base], names: Iterable[str]) -> dict[str, str]:
    """Columns of the model and the PostgreSQL types their parameters are cast to (an INSERT
    … SELECT must spell them out). Strings go as text: the column's own length limit then
    refuses a value too long, where a cast to varchar(n) would cut it."""
    columns = model.__table__.columns
    return {
        name: "text" if isinstance(columns[name].type, String) else columns[name].type.compile(_PG)
        for name in names
    }


# The columns each write inserts (a session's `key` is the database's to number).
SESSION_COLUMNS = _typed(
    models.Session, (c.name for c in models.Session.__table__.columns if c.name != "key")
)
RUN_COLUMNS = _typed(
    models.Run,
    (
        "id",
        "session_id",
        "agent",
        "user_id",
        "status",
        "metadata",
        "idempotency_key",
        "request_fingerprint",
        "created_at",
        "iterations",
        "input_tokens",
        "output_tokens",
    ),
)
MESSAGE_COLUMNS = _typed(
    models.Message,
    (
        c.name
        for c in models.Message.__table__.columns
        if c.name not in ("session_key", "created_at")
    ),
)
JSON_COLUMNS = frozenset(
    name
    for table in (SESSION_COLUMNS, RUN_COLUMNS, MESSAGE_COLUMNS)
    for name, type_ in table.items()
    if type_ == "JSON"
)


def claim_sql(fence_sql: str, *, create: bool, touch: bool, types: bool) -> str:
    """The claim every write starts with: create the session, or advance its message count
    from `:expected` to `:new_count` — only while the fence holds. `types` casts the
    parameters of a created session to their column types."""
    if create:
        values = ", ".join(
            f"CAST(:s_{c} AS {t})" if types else f":s_{c}" for c, t in SESSION_COLUMNS.items()
        )
        return (
            f"INSERT INTO session ({', '.join(SESSION_COLUMNS)}) SELECT {values} WHERE {fence_sql}"
        )
    return (
        f"UPDATE session SET message_count = :new_count{', updated_at = :now' if touch else ''}"
        f" WHERE id = :session_id AND message_count = :expected AND {fence_sql}"
    )


def run_update_sql(columns: Iterable[str], where: str) -> str:
    """Set these run columns from `:u_<column>` parameters."""
    return f"UPDATE run SET {', '.join(f'{c} = :u_{c}' for c in columns)} WHERE {where}"


def interrupted_sql(where: str) -> str:
    return (
        f"UPDATE run SET status = '{RunStatus.INTERRUPTED.value}', finished_at = :now WHERE {where}"
    )


# Constraint errors that mean another writer stored the same keys first (a message's seq, the
# session's id, a run's id or idempotency key); any other is a bug, not a conflict.
_SQLITE_ANOTHER_WRITER = frozenset({"SQLITE_CONSTRAINT_PRIMARYKEY", "SQLITE_CONSTRAINT_UNIQUE"})


class SqliteJournalStore:
    """Each write one transaction body on `Database.writes`: the claim, then the inserts and
    updates, as fixed SQL text (kept prepared by the driver) on the stdlib driver.

    Values go through the columns' own SQLAlchemy bind processors (dates, JSON, booleans),
    so rows read back exactly as the ORM would have written them."""

    INSERT_MESSAGE = (
        f"INSERT INTO message (session_key, {', '.join(MESSAGE_COLUMNS)}, created_at)"
        " VALUES ((SELECT key FROM session WHERE id = :session_id),"
        f" {', '.join(f':{c}' for c in MESSAGE_COLUMNS)}, :created_at)"
    )
    INSERT_RUN = (
        f"INSERT INTO run ({', '.join(RUN_COLUMNS)})"
        f" VALUES ({', '.join(f':r_{c}' for c in RUN_COLUMNS)})"
    )
    INTERRUPTED = interrupted_sql("id = :id")

    def __init__(self, writes: InlineTransactor, fence_sql: str) -> None:
        self._writes = writes
        self.observers: list[Callable[[int], None]] = []
        self._claims = {
            (create, touch): claim_sql(fence_sql, create=create, touch=touch, types=False)
            for create in (False, True)
            for touch in (False, True)
        }
        self._run_updates: dict[tuple[str, ...], str] = {}
        dialect = writes.engine.dialect
        self._bind = {
            model.__tablename__: {
                column.name: processor
                for column in model.__table__.columns
                if (processor := column.type.bind_processor(dialect)) is not None
            }
            for model in (models.Session, models.Run, models.Message)
        }
        self._timestamp = self._bind["session"]["updated_at"]  # how a UTCDateTime is stored

    async def write(self, write: JournalWrite) -> None:
        try:
            statements = await self._writes.transact_driver(lambda d: self._body(d, write))
        except sqlite3.IntegrityError as exc:
            if exc.sqlite_errorname in _SQLITE_ANOTHER_WRITER:  # it got these seqs first
                raise SessionConflict(write.session_id) from exc
            raise  # a bug (a NOT NULL, a CHECK), not a conflict
        except sqlite3.OperationalError as exc:  # locked for too long, disk full, I/O error
            raise DatabaseUnavailable("The database cannot be written now; retry later.") from exc
        for observer in self.observers:
            observer(statements)

    def _body(self, driver: sqlite3.Connection, write: JournalWrite) -> int:
        statements = self._statements(driver, write)
        if write.before_commit is not None:
            write.before_commit()
        return statements

    def _statements(self, driver: sqlite3.Connection, write: JournalWrite) -> int:
        """Run the write's statements; how many it took."""
        now = self._timestamp(write.now)
        claim = {
            "session_id": write.session_id,
            "expected": write.expected,
            "new_count": write.new_count,
            "now": now,
            **write.fence,
        }
        if write.new_session is not None:
            claim.update(self._values("session", "s_", write.new_session))
        sql = self._claims[(write.new_session is not None, write.touch)]
        if driver.execute(sql, claim).rowcount != 1:
            raise SessionConflict(write.session_id)
        statements = 1
        if write.messages:
            rows = [
                {
                    "session_id": write.session_id,
                    **self._values("message", "", message_to_row(m, now=write.now)),
                }
                for m in write.messages
            ]
            driver.executemany(self.INSERT_MESSAGE, rows)
            statements += 1
        if write.new_run is not None:
            driver.execute(self.INSERT_RUN, self._values("run", "r_", write.new_run))
            statements += 1
        if write.run_values is not None:
            columns = tuple(write.run_values)
            if columns not in self._run_updates:
                self._run_updates[columns] = run_update_sql(columns, "id = :run_id")
            values = self._values("run", "u_", write.run_values)
            driver.execute(self._run_updates[columns], {**values, "run_id": write.run_id})
            statements += 1
        if write.interrupted:
            driver.executemany(self.INTERRUPTED, [{"id": i, "now": now} for i in write.interrupted])
            statements += 1
        return statements

    def _values(self, table: str, prefix: str, values: dict[str, Any]) -> dict[str, Any]:
        """Parameters named `<prefix><column>`, as the column's bind processor stores them."""
        bind = self._bind[table]
        return {prefix + c: bind[c](v) if c in bind else v for c, v in values.items()}


_NAMED = re.compile(r"(?<![:\w]):(\w+)")


@dataclass(frozen=True)
class _Shape:
    """What a write does, which decides its SQL text (one prepared statement per shape)."""

    create: bool
    touch: bool
    messages: bool
    new_run: bool
    run_columns: tuple[str, ...]
    interrupted: bool


@dataclass(frozen=True)
class _Statement:
    sql: str
    names: tuple[str, ...]

    @classmethod
    def of(cls, named_sql: str) -> _Statement:
        """`:name` parameters turned into asyncpg's `$n`, in order of first use."""
        names: list[str] = []

        def number(match: re.Match[str]) -> str:
            name = match.group(1)
            if name not in names:
                names.append(name)
            return f"${names.index(name) + 1}"

        return cls(_NAMED.sub(number, named_sql), tuple(names))

    def args(self, params: dict[str, Any]) -> list[Any]:
        return [params[name] for name in self.names]


@dataclass
class PostgresJournalStore:
    """Each write one statement: claim the seqs (or create the session) under the fence, then
    insert the messages and the run and update runs, all conditioned on the claim."""

    engine: AsyncEngine
    fence_sql: str
    observers: list[Callable[[int], None]] = field(default_factory=list)
    _statements: dict[_Shape, _Statement] = field(default_factory=dict)

    async def write(self, write: JournalWrite) -> None:
        shape = _Shape(
            create=write.new_session is not None,
            touch=write.touch,
            messages=bool(write.messages),
            new_run=write.new_run is not None,
            run_columns=tuple(sorted(write.run_values or ())),
            interrupted=bool(write.interrupted),
        )
        statement = self._statements.get(shape)
        if statement is None:
            statement = self._statements[shape] = _Statement.of(self._sql(shape))
        try:
            claimed = await self.fetchval(
                statement.sql, statement.args(self._params(write)), write.before_commit
            )
        except asyncpg.UniqueViolationError as exc:  # another writer stored these keys first
            raise SessionConflict(write.session_id) from exc
        if claimed != 1:
            raise SessionConflict(write.session_id)

    async def fetchval(
        self, sql: str, args: Sequence[Any], before_commit: Callable[[], None] | None = None
    ) -> Any:
        """One statement in its own transaction on a pooled connection's driver: one round
        trip (two more, BEGIN and COMMIT, only when `before_commit` must run in between).

        The pool's raw connection costs a quarter of an AsyncConnection's checkout. What
        SQLAlchemy would do on failure is done here: a connection that failed other than by
        a statement error is invalidated, and on a lost connection the whole pool with it."""
        try:
            pooled = await self.engine.raw_connection()
        except Exception as exc:
            # No connection could be had (refused, the pool exhausted): the pool raises the
            # driver's own error, which no handler of SQLAlchemy's errors knows.
            log.warning("database unavailable: no connection: %s", type(exc).__name__)
            raise DatabaseUnavailable("The database cannot be reached; retry later.") from exc
        try:
            raw = pooled.driver_connection
            assert raw is not None
            if before_commit is None:
                value = await raw.fetchval(sql, *args)
            else:
                async with raw.transaction():
                    value = await raw.fetchval(sql, *args)
                    before_commit()
        except BaseException as exc:
            if isinstance(exc, asyncpg.PostgresError) and not isinstance(exc, PG_CONNECTION_ERRORS):
                await greenlet_spawn(pooled.close)  # the statement failed, not the connection
                raise
            await greenlet_spawn(pooled.invalidate, exc)
            if isinstance(exc, PG_CONNECTION_ERRORS):
                # As SQLAlchemy does on a disconnect: the pool's other connections are as old
                # as this one, so none is reused.
                await self.engine.dispose()
                raise DatabaseUnavailable("The database cannot be reached; retry later.") from exc
            raise
        # Closing may close the driver's connection (pool overflow), which SQLAlchemy's async
        # adapter can only do inside greenlet_spawn.
        await greenlet_spawn(pooled.close)
        for observer in self.observers:
            observer(1)
        return value

    def _sql(self, shape: _Shape) -> str:
        claim = claim_sql(self.fence_sql, create=shape.create, touch=shape.touch, types=True)
        ctes = [f"claim AS ({claim} RETURNING key)"]
        if shape.messages:
            columns = ", ".join(MESSAGE_COLUMNS)
            typed = ", ".join(f"{c} {t}" for c, t in MESSAGE_COLUMNS.items())
            ctes.append(
                f"messages AS (INSERT INTO message (session_key, {columns}, created_at)"
                f" SELECT claim.key, {', '.join(f'm.{c}' for c in MESSAGE_COLUMNS)}, :now"
                f" FROM claim, json_to_recordset(CAST(:messages AS json)) AS m({typed}))"
            )
        if shape.new_run:
            columns = ", ".join(RUN_COLUMNS)
            values = ", ".join(f"CAST(:r_{c} AS {t})" for c, t in RUN_COLUMNS.items())
            ctes.append(f"new_run AS (INSERT INTO run ({columns}) SELECT {values} FROM claim)")
        claimed = "EXISTS (SELECT 1 FROM claim)"
        if shape.run_columns:
            update = run_update_sql(shape.run_columns, f"id = :run_id AND {claimed}")
            ctes.append(f"run_update AS ({update})")
        if shape.interrupted:
            update = interrupted_sql(f"id = ANY(CAST(:interrupted AS text[])) AND {claimed}")
            ctes.append(f"interrupted AS ({update})")
        return f"WITH {', '.join(ctes)} SELECT count(*) FROM claim"

    @staticmethod
    def _params(write: JournalWrite) -> dict[str, Any]:
        params: dict[str, Any] = {
            "session_id": write.session_id,
            "run_id": write.run_id,
            "expected": write.expected,
            "new_count": write.new_count,
            "now": write.now,
            "interrupted": list(write.interrupted),
            **write.fence,
        }
        if write.new_session is not None:
            params.update({f"s_{c}": _value(c, write.new_session[c]) for c in SESSION_COLUMNS})
        if write.new_run is not None:
            params.update({f"r_{c}": _value(c, write.new_run[c]) for c in RUN_COLUMNS})
        for column, value in (write.run_values or {}).items():
            params[f"u_{column}"] = _value(column, value)
        if write.messages:
            rows = [message_to_row(m, now=write.now) for m in write.messages]
            params["messages"] = json.dumps([{c: row[c] for c in MESSAGE_COLUMNS} for row in rows])
        return params


def _value(column: str, value: Any) -> Any:
    if column in JSON_COLUMNS and value is not None:
        return json.dumps(value)
    return value
