"""The durable writes of a turn, one transaction each (CONTRACT §2), on either store.

A write is described by a `JournalWrite` and carried out by the store's `JournalStore`:
- SQLite: `CoreJournalStore`, Core statements built once, run as one transaction body on
  `Database.writes` (on the event loop's thread; app/db/session.py).
- PostgreSQL: `PostgresJournalStore`, ONE statement per write (data-modifying CTEs), sent on
  the driver's connection in autocommit: a write is one round trip and one commit.

Every write claims the session's next `seq` values with a compare-and-set on
`session.message_count` (or creates the session) under the ownership fence
(services/ownership.py), and only a successful claim inserts anything. A runner that lost the
session, or a second writer, therefore writes nothing and gets SessionConflict; a repeated
write conflicts on `(session_id, seq)` instead of duplicating.
"""

from __future__ import annotations

import json
import re
import sqlite3
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

import asyncpg
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.util import greenlet_spawn

from app.db import models
from app.db.repositories import message_to_row
from app.db.session import Database, Transactor
from app.domain import Message, RunStatus
from app.errors import DatabaseUnavailable, SessionConflict


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
    return SqliteJournalStore(db.writes, fence_sql)


class SqliteJournalStore:
    """Each write one transaction body on `Database.writes` (on the loop's thread): the
    claim, then the inserts and updates, as SQL on the stdlib driver's own connection.

    Values go through the columns' own SQLAlchemy bind processors (dates, JSON, booleans),
    so rows read back exactly as the ORM wrote them; the statements are fixed text, which
    the driver keeps prepared."""

    def __init__(self, writes: Transactor, fence_sql: str) -> None:
        self._writes = writes
        self._fence_sql = fence_sql
        self.observers: list[Callable[[int], None]] = []
        dialect = writes.engine.dialect
        self._bind = {
            model.__tablename__: {
                column.name: processor
                for column in model.__table__.columns
                if (processor := column.type.bind_processor(dialect)) is not None
            }
            for model in (models.Session, models.Run, models.Message)
        }
        self._run_updates: dict[tuple[str, ...], str] = {}

    async def write(self, write: JournalWrite) -> None:
        try:
            statements = await self._writes.transact(lambda conn: self._body(conn, write))
        except IntegrityError as exc:
            raise SessionConflict(write.session_id) from exc
        for observer in self.observers:
            observer(statements)

    def _body(self, conn: Connection, write: JournalWrite) -> int:
        driver = conn.connection.dbapi_connection
        assert isinstance(driver, sqlite3.Connection)
        try:
            statements = self._statements(driver, write)
        except sqlite3.IntegrityError as exc:  # a second writer got these seqs first
            raise SessionConflict(write.session_id) from exc
        if write.before_commit is not None:
            write.before_commit()
        return statements

    def _statements(self, driver: sqlite3.Connection, write: JournalWrite) -> int:
        """Run the write's statements; how many it took."""
        if not self._claim(driver, write):
            raise SessionConflict(write.session_id)
        statements = 1
        if write.messages:
            rows = [
                self._row("message", message_to_row(m, session_id=write.session_id, now=write.now))
                for m in write.messages
            ]
            driver.executemany(_insert("message", MESSAGE_ROW), rows)
            statements += 1
        if write.new_run is not None:
            driver.execute(_insert("run", RUN_COLUMNS), self._row("run", write.new_run))
            statements += 1
        if write.run_values is not None:
            values = self._row("run", write.run_values)
            driver.execute(self._run_update(tuple(values)), {**values, "b_run_id": write.run_id})
            statements += 1
        if write.interrupted:
            statements += 1
            driver.executemany(
                "UPDATE run SET status = :status, finished_at = :finished_at WHERE id = :id",
                [
                    self._row(
                        "run",
                        {
                            "id": run_id,
                            "status": RunStatus.INTERRUPTED.value,
                            "finished_at": write.now,
                        },
                    )
                    for run_id in write.interrupted
                ],
            )
        return statements

    def _claim(self, driver: sqlite3.Connection, write: JournalWrite) -> bool:
        if write.new_session is not None:
            values = ", ".join(f":{c}" for c in SESSION_COLUMNS)
            sql = (
                f"INSERT INTO session ({', '.join(SESSION_COLUMNS)}) SELECT {values}"
                f" WHERE {self._fence_sql}"
            )
            row = {**self._row("session", write.new_session), **write.fence}
            return driver.execute(sql, row).rowcount == 1
        touch = ", updated_at = :now" if write.touch else ""
        sql = (
            f"UPDATE session SET message_count = :new_count{touch}"
            " WHERE id = :session_id AND message_count = :expected"
            f" AND {self._fence_sql}"
        )
        params = {
            "session_id": write.session_id,
            "expected": write.expected,
            "new_count": write.new_count,
            **write.fence,
        }
        if write.touch:
            params["now"] = self._bind["session"]["updated_at"](write.now)
        return driver.execute(sql, params).rowcount == 1

    def _row(self, table: str, values: dict[str, Any]) -> dict[str, Any]:
        """Values as the driver stores them, by the column's own bind processor."""
        bind = self._bind[table]
        return {c: bind[c](v) if c in bind else v for c, v in values.items()}

    def _run_update(self, columns: tuple[str, ...]) -> str:
        sql = self._run_updates.get(columns)
        if sql is None:
            sets = ", ".join(f"{c} = :{c}" for c in columns)
            sql = self._run_updates[columns] = f"UPDATE run SET {sets} WHERE id = :b_run_id"
        return sql


def _insert(table: str, columns: Iterable[str]) -> str:
    names = list(columns)
    return f"INSERT INTO {table} ({', '.join(names)}) VALUES ({', '.join(':' + c for c in names)})"


# The columns a write inserts and their SQL types: an INSERT … SELECT of parameters needs
# them spelled out, as nothing else tells PostgreSQL what type a parameter has.
SESSION_COLUMNS = {
    "id": "text",
    "agent": "text",
    "tenant_id": "text",
    "user_id": "text",
    "metadata": "json",
    "message_count": "int",
    "created_at": "timestamptz",
    "updated_at": "timestamptz",
}
RUN_COLUMNS = {
    "id": "text",
    "session_id": "text",
    "agent": "text",
    "user_id": "text",
    "status": "text",
    "metadata": "json",
    "idempotency_key": "text",
    "request_fingerprint": "text",
    "created_at": "timestamptz",
    "iterations": "int",
    "input_tokens": "int",
    "output_tokens": "int",
}
# Messages go as one JSON array of objects (json_to_recordset): one parameter, encoded at C
# speed, however many messages a write holds.
MESSAGE_COLUMNS = {
    "seq": "int",
    "role": "text",
    "content": "text",
    "tool_calls": "json",
    "tool_call_id": "text",
    "tool_name": "text",
    "is_error": "bool",
    "run_id": "text",
}
JSON_COLUMNS = frozenset({"metadata", "tool_calls"})
MESSAGE_ROW = ("session_id", *MESSAGE_COLUMNS, "created_at")
# Errors that mean the connection, not the statement, failed.
CONNECTION_ERRORS = (asyncpg.PostgresConnectionError, asyncpg.InterfaceError, OSError)
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
        except asyncpg.IntegrityConstraintViolationError as exc:
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
        a statement error is invalidated, never reused."""
        pooled = await self.engine.raw_connection()
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
            if isinstance(exc, asyncpg.PostgresError) and not isinstance(exc, CONNECTION_ERRORS):
                await greenlet_spawn(pooled.close)  # the statement failed, not the connection
                raise
            await greenlet_spawn(pooled.invalidate, exc)
            if isinstance(exc, CONNECTION_ERRORS):
                raise DatabaseUnavailable("The database cannot be reached; retry later.") from exc
            raise
        # Closing may close the driver's connection (pool overflow), which SQLAlchemy's async
        # adapter can only do inside greenlet_spawn.
        await greenlet_spawn(pooled.close)
        for observer in self.observers:
            observer(1)
        return value

    def _sql(self, shape: _Shape) -> str:
        ctes: list[str] = []
        if shape.create:
            columns = ", ".join(SESSION_COLUMNS)
            values = ", ".join(f"CAST(:s_{c} AS {t})" for c, t in SESSION_COLUMNS.items())
            ctes.append(
                f"claim AS (INSERT INTO session ({columns}) SELECT {values}"
                f" WHERE {self.fence_sql} RETURNING id)"
            )
        else:
            touch = ", updated_at = :now" if shape.touch else ""
            ctes.append(
                f"claim AS (UPDATE session SET message_count = :new_count{touch}"
                " WHERE id = :session_id AND message_count = :expected"
                f" AND {self.fence_sql} RETURNING id)"
            )
        if shape.messages:
            columns = ", ".join(MESSAGE_COLUMNS)
            typed = ", ".join(f"{c} {t}" for c, t in MESSAGE_COLUMNS.items())
            ctes.append(
                f"messages AS (INSERT INTO message (session_id, {columns}, created_at)"
                f" SELECT claim.id, {', '.join(f'm.{c}' for c in MESSAGE_COLUMNS)}, :now"
                f" FROM claim, json_to_recordset(CAST(:messages AS json)) AS m({typed}))"
            )
        if shape.new_run:
            columns = ", ".join(RUN_COLUMNS)
            values = ", ".join(f"CAST(:r_{c} AS {t})" for c, t in RUN_COLUMNS.items())
            ctes.append(f"new_run AS (INSERT INTO run ({columns}) SELECT {values} FROM claim)")
        if shape.run_columns:
            sets = ", ".join(f"{c} = :u_{c}" for c in shape.run_columns)
            ctes.append(
                f"run_update AS (UPDATE run SET {sets}"
                " WHERE id = :run_id AND EXISTS (SELECT 1 FROM claim))"
            )
        if shape.interrupted:
            ctes.append(
                f"interrupted AS (UPDATE run SET status = '{RunStatus.INTERRUPTED.value}',"
                " finished_at = :now WHERE id = ANY(CAST(:interrupted AS text[]))"
                " AND EXISTS (SELECT 1 FROM claim))"
            )
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
            rows = [
                message_to_row(m, session_id=write.session_id, now=write.now)
                for m in write.messages
            ]
            params["messages"] = json.dumps([{c: row[c] for c in MESSAGE_COLUMNS} for row in rows])
        return params


def _value(column: str, value: Any) -> Any:
    if column in JSON_COLUMNS and value is not None:
        return json.dumps(value)
    return value
