"""PostgreSQL: each durable write ONE statement (data-modifying CTEs) in autocommit."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC
from typing import Any

import asyncpg
from sqlalchemy import PoolProxiedConnection
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.util import greenlet_spawn
from typing_extensions import override

from app.db.journal.sql import (
    JSON_COLUMNS,
    LAST_MESSAGE_SQL,
    MESSAGE_COLUMNS,
    RUN_COLUMNS,
    SESSION_COLUMNS,
    STORED_COLUMNS,
    claim_sql,
    interrupted_sql,
    run_update_sql,
)
from app.db.journal.write import JournalStore, JournalWrite, StoredTail, WriteOutcomeUnknown
from app.db.outages import (
    PG_CONNECTION_ERRORS,
    pg_read_only,
    saturated,
    unavailable,
)
from app.db.repositories import message_to_row
from app.errors import DatabaseUnavailable, SessionConflict

log = logging.getLogger(__name__)

# How long a durable write waits for a pooled connection while all are in use.
JOURNAL_CHECKOUT_WAIT_S = 120
# Between its tries for a connection the server or this process has no resource for.
_SATURATED_FIRST_PAUSE_S = 0.05
_SATURATED_MAX_PAUSE_S = 1.0


_NAMED = re.compile(r"(?<![:\w]):(\w+)")


class _ConnectionLost(Exception):
    """The connection failed under a statement: whether the server ran it is unknown."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(type(error).__name__)
        self.error = error


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
class PostgresJournalStore(JournalStore):
    """Each write one statement: claim the seqs (or create the session) under the fence, then
    insert the messages and the run and update runs, all conditioned on the claim."""

    engine: AsyncEngine
    fence_sql: str
    observers: list[Callable[[int], None]] = field(default_factory=list)
    _statements: dict[_Shape, _Statement] = field(default_factory=dict)
    _state: _Statement = field(init=False)
    _stored: _Statement = field(init=False)
    _last: _Statement = field(init=False)

    def __post_init__(self) -> None:
        self._stored = _Statement.of(f"SELECT {STORED_COLUMNS}")
        self._last = _Statement.of(LAST_MESSAGE_SQL)
        # What tells whether a write whose connection died had committed (`_resend_after`).
        self._state = _Statement.of(f"SELECT {self.fence_sql} AS owned, {STORED_COLUMNS}")

    @override
    async def stored(self, session_id: str, *, run_id: str) -> tuple[int | None, str | None]:
        params = {"session_id": session_id, "run_id": run_id}
        try:
            row = await self._read(self._stored, params=params, patient=True)
        except _ConnectionLost as lost:
            raise unavailable(lost.error) from lost.error
        return row["count"], row["status"]

    @override
    async def last_message(self, session_id: str) -> StoredTail | None:
        try:
            row = await self._read(self._last, params={"session_id": session_id}, patient=True)
        except _ConnectionLost as lost:
            raise unavailable(lost.error) from lost.error
        if row is None:
            return None
        return StoredTail.of_row(tuple(row.values()), timestamp=lambda t: t.astimezone(UTC))

    async def _read(self, statement: _Statement, *, params: dict[str, Any], patient: bool) -> Any:
        """The statement's one row; read once more on a new connection if its connection
        ended under it (as the write's own often has a moment before: the server or a proxy
        ending several at once). A read may run twice."""
        try:
            return await self._fetch(
                statement.sql,
                args=statement.args(params),
                before_commit=None,
                patient=patient,
                row=True,
            )
        except _ConnectionLost:
            return await self._fetch(
                statement.sql,
                args=statement.args(params),
                before_commit=None,
                patient=patient,
                row=True,
            )

    @override
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
        args = statement.args(self._params(write))
        # Once the turn is started: it may have run tools whose results would be lost.
        patient = write.new_run is None
        try:
            try:
                claimed = await self._fetch(
                    statement.sql, args=args, before_commit=write.before_commit, patient=patient
                )
            except _ConnectionLost as lost:
                if not await self._resend_after(lost, write=write, patient=patient):
                    return  # it had committed
                claimed = await self.fetchval(statement.sql, args=args, patient=patient)
        except asyncpg.UniqueViolationError as exc:  # another writer stored these keys first
            raise SessionConflict(write.session_id) from exc
        if claimed != 1:
            raise SessionConflict(write.session_id)

    async def _resend_after(
        self, lost: _ConnectionLost, *, write: JournalWrite, patient: bool
    ) -> bool:
        """The connection died under the write (a server or proxy ending it, even while it
        sat idle in the pool): did the write commit? While this runner still holds the
        session, no other can have written to it since, so the session's state says. True:
        it did not, send it again; False: it did. Where that cannot be told (the session is
        no longer held: WriteOutcomeUnknown) the journal may take the session again and
        tell; a database that cannot be asked is a 503, the write's outcome unknown."""
        params = {"session_id": write.session_id, "run_id": write.run_id, **write.fence}
        try:
            state = await self._read(self._state, params=params, patient=patient)
        except (_ConnectionLost, DatabaseUnavailable):
            raise unavailable(lost.error) from lost.error
        if state is None:
            raise unavailable(lost.error) from lost.error
        if not state["owned"]:
            raise WriteOutcomeUnknown(lost.error) from lost.error
        if write.messages:
            committed = state["count"] == write.new_count
        elif write.new_run is not None:
            committed = state["status"] is not None
        else:  # only run updates: the same values again change nothing
            committed = False
        log.warning(
            "the database connection ended under a durable write, which %s",
            "had committed" if committed else "had not committed: sent again",
        )
        return not committed

    async def fetchval(
        self,
        sql: str,
        *,
        args: Sequence[Any],
        before_commit: Callable[[], None] | None = None,
        patient: bool = False,
    ) -> Any:
        """One statement in its own transaction on a pooled connection's driver: one round
        trip (two more, BEGIN and COMMIT, only when `before_commit` must run in between)."""
        try:
            return await self._fetch(sql, args=args, before_commit=before_commit, patient=patient)
        except _ConnectionLost as lost:
            raise unavailable(lost.error) from lost.error

    async def _fetch(
        self,
        sql: str,
        *,
        args: Sequence[Any],
        before_commit: Callable[[], None] | None,
        patient: bool,
        row: bool = False,
    ) -> Any:
        """`fetchval` (or the first row: `row`), but a connection lost under the statement
        raises _ConnectionLost.

        The pool's raw connection costs a quarter of an AsyncConnection's checkout. What
        SQLAlchemy would do on failure is done here: a connection that failed other than by
        a statement error is invalidated, and on a lost connection the pool's older ones
        too."""
        pooled = await self._checkout(patient=patient)
        try:
            raw = pooled.driver_connection
            assert raw is not None
            fetch = raw.fetchrow if row else raw.fetchval
            if before_commit is None:
                value = await fetch(sql, *args)
            else:
                async with raw.transaction():
                    value = await fetch(sql, *args)
                    before_commit()
        except BaseException as exc:  # cancellation too: its connection's state is unknown
            if isinstance(exc, asyncpg.PostgresError) and not isinstance(exc, PG_CONNECTION_ERRORS):
                if pg_read_only(exc):  # its read-only default may be the connection's own
                    await greenlet_spawn(pooled.invalidate, exc)  # (see app/db/session.py)
                    raise unavailable(exc) from exc
                await greenlet_spawn(pooled.close)  # the statement failed, not the connection
                if saturated(exc):
                    raise unavailable(exc) from exc
                raise
            if isinstance(exc, PG_CONNECTION_ERRORS):
                # As SQLAlchemy does on a disconnect (its Connection calls this private method
                # of the pool): this connection is closed, and the pool's others, as old as
                # it, are replaced at their next checkout. Disposing of the engine instead
                # left the connections checked out meanwhile in the old pool, open for good.
                await greenlet_spawn(self.engine.pool._invalidate, pooled, exc)
                raise _ConnectionLost(exc) from exc
            await greenlet_spawn(pooled.invalidate, exc)
            raise
        # Giving it back may do I/O (the pool's reset of it, or closing it at shutdown),
        # which SQLAlchemy's async adapter can only do inside greenlet_spawn.
        await greenlet_spawn(pooled.close)
        for observer in self.observers:
            observer(1)
        return value

    async def _checkout(self, *, patient: bool) -> PoolProxiedConnection:
        """A pooled connection. While every one is in use, or no new one can be had for want
        of a resource (the server's max_connections, this process's file descriptors), a
        `patient` write (one of a turn that has started: it may have run tools whose results
        would be lost) waits for one for JOURNAL_CHECKOUT_WAIT_S and the pool's timeout
        more; any other gives up at once or after the pool's timeout, as requests that have
        not started do. An outage (refused, the database gone) is not waited for."""
        deadline = time.monotonic() + JOURNAL_CHECKOUT_WAIT_S
        pause = _SATURATED_FIRST_PAUSE_S
        while True:
            try:
                return await self.engine.raw_connection()
            except PoolTimeoutError as exc:
                if patient and time.monotonic() < deadline:
                    continue
                raise unavailable(exc) from exc
            except Exception as exc:
                # No connection could be made: the pool raises the driver's own error, which
                # no handler of SQLAlchemy's errors knows.
                if patient and saturated(exc) and time.monotonic() + pause < deadline:
                    log.warning("no database connection to be had now: waiting %.2fs", pause)
                    await asyncio.sleep(pause)
                    pause = min(pause * 2, _SATURATED_MAX_PAUSE_S)
                    continue
                raise unavailable(exc) from exc

    def _sql(self, shape: _Shape) -> str:
        claim = claim_sql(
            self.fence_sql,
            create=shape.create,
            touch=shape.touch,
            postgres=True,
            runs=bool(shape.run_columns) or shape.interrupted,
        )
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
            update = run_update_sql(shape.run_columns, where=f"id = :run_id AND {claimed}")
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
            "locked_runs": ([write.run_id] if write.run_values else []) + list(write.interrupted),
            **write.fence,
        }
        if write.new_session is not None:
            params.update(
                {f"s_{c}": _value(c, value=write.new_session[c]) for c in SESSION_COLUMNS}
            )
        if write.new_run is not None:
            params.update({f"r_{c}": _value(c, value=write.new_run[c]) for c in RUN_COLUMNS})
        for column, value in (write.run_values or {}).items():
            params[f"u_{column}"] = _value(column, value=value)
        if write.messages:
            rows = [message_to_row(m, now=write.now) for m in write.messages]
            params["messages"] = json.dumps([{c: row[c] for c in MESSAGE_COLUMNS} for row in rows])
        return params


def _value(column: str, *, value: Any) -> Any:
    if column in JSON_COLUMNS and value is not None:
        return json.dumps(value)
    return value
