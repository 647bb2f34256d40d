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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

import asyncpg
from sqlalchemy import Update, bindparam, insert, text, update
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
    async def write(self, write: JournalWrite) -> None:
        """Commit the write, or raise SessionConflict having written nothing."""
        ...


def journal_store(db: Database, fence_sql: str) -> JournalStore:
    """The store's way of writing, fenced by the ownership's SQL condition."""
    if db.dialect == "postgresql":
        return PostgresJournalStore(db.engine, fence_sql)
    return CoreJournalStore(db.writes, fence_sql)


class CoreJournalStore:
    """Core statements, built once, in one transaction body per write."""

    def __init__(self, writes: Transactor, fence_sql: str) -> None:
        session, run = models.Session, models.Run
        fence = text(fence_sql)
        claim = update(session).where(
            session.id == bindparam("b_session_id"),
            session.message_count == bindparam("b_expected"),
            fence,
        )
        self._writes = writes
        self._owned = text(f"SELECT {fence_sql}")
        self._advance = claim.values(message_count=bindparam("b_new"))
        self._advance_touch = claim.values(
            message_count=bindparam("b_new"), updated_at=bindparam("b_now")
        )
        self._insert_session = insert(session)
        self._insert_messages = insert(models.Message)
        self._insert_run = insert(run)
        self._run = run
        self._run_updates: dict[tuple[str, ...], Update] = {}

    async def write(self, write: JournalWrite) -> None:
        try:
            await self._writes.transact(lambda conn: self._body(conn, write))
        except IntegrityError as exc:
            raise SessionConflict(write.session_id) from exc

    def _body(self, conn: Connection, write: JournalWrite) -> None:
        if not self._claim(conn, write):
            raise SessionConflict(write.session_id)
        if write.messages:
            rows = [
                message_to_row(m, session_id=write.session_id, now=write.now)
                for m in write.messages
            ]
            conn.execute(self._insert_messages, rows)
        if write.new_run is not None:
            conn.execute(self._insert_run, write.new_run)
        if write.run_values is not None:
            values = {f"u_{c}": v for c, v in write.run_values.items()}
            conn.execute(
                self._run_update(tuple(write.run_values)), {"b_run_id": write.run_id, **values}
            )
        if write.interrupted:
            conn.execute(
                update(self._run)
                .where(self._run.id.in_(write.interrupted))
                .values(status=RunStatus.INTERRUPTED.value, finished_at=write.now)
            )
        if write.before_commit is not None:
            write.before_commit()

    def _run_update(self, columns: tuple[str, ...]) -> Update:
        """The update of these run columns, built once per set of columns."""
        statement = self._run_updates.get(columns)
        if statement is None:
            run = self._run
            statement = self._run_updates[columns] = (
                update(run)
                .where(run.id == bindparam("b_run_id"))
                .values({c: bindparam(f"u_{c}") for c in columns})
            )
        return statement

    def _claim(self, conn: Connection, write: JournalWrite) -> bool:
        if write.new_session is not None:
            if not conn.scalar(self._owned, write.fence):
                return False
            conn.execute(self._insert_session, write.new_session)
            return True
        params = {
            "b_session_id": write.session_id,
            "b_expected": write.expected,
            "b_new": write.new_count,
            **write.fence,
        }
        if write.touch:
            result = conn.execute(self._advance_touch, {**params, "b_now": write.now})
        else:
            result = conn.execute(self._advance, params)
        return result.rowcount == 1


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
    # Called with each statement's SQL once it committed (the bench counts transactions).
    observers: list[Callable[[str], None]] = field(default_factory=list)
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
            observer(sql)
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
