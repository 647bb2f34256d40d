"""SQLite: each durable write one transaction body of fixed statements on the stdlib driver."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from sqlalchemy.engine import Dialect
from typing_extensions import override

from app.db import models
from app.db.base import Base
from app.db.journal.sql import (
    LAST_MESSAGE_SQL,
    MESSAGE_COLUMNS,
    RUN_COLUMNS,
    STORED_COLUMNS,
    claim_sql,
    interrupted_sql,
    run_update_sql,
)
from app.db.journal.write import JournalStore, JournalWrite, StoredTail
from app.db.outages import sqlite_statement_error, unavailable
from app.db.repositories import message_to_row
from app.db.session import InlineTransactor
from app.errors import SessionConflict

# Constraint errors that mean another writer stored the same keys first (a message's seq, the
# session's id, a run's id or idempotency key); any other is a bug, not a conflict.
_SQLITE_ANOTHER_WRITER = frozenset({"SQLITE_CONSTRAINT_PRIMARYKEY", "SQLITE_CONSTRAINT_UNIQUE"})


class SqliteJournalStore(JournalStore):
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

    def __init__(self, writes: InlineTransactor, *, fence_sql: str) -> None:
        self._writes = writes
        self.observers: list[Callable[[int], None]] = []
        self._claims = {
            (create, touch): claim_sql(fence_sql, create=create, touch=touch, postgres=False)
            for create in (False, True)
            for touch in (False, True)
        }
        self._run_updates: dict[tuple[str, ...], str] = {}
        dialect = writes.engine.dialect
        self._bind = {
            model.__tablename__: _bind_processors(model, dialect=dialect)
            for model in (models.Session, models.Run, models.Message)
        }
        self._timestamp = self._bind["session"]["updated_at"]  # how a UTCDateTime is stored

    @override
    async def write(self, write: JournalWrite) -> None:
        try:
            statements = await self._writes.transact_driver(
                lambda d: self._body(d, write=write), flush=write.flush
            )
        except sqlite3.IntegrityError as exc:
            if exc.sqlite_errorname in _SQLITE_ANOTHER_WRITER:  # it got these seqs first
                raise SessionConflict(write.session_id) from exc
            raise  # a bug (a NOT NULL, a CHECK), not a conflict
        except sqlite3.OperationalError as exc:  # locked for too long, disk full, I/O error
            if sqlite_statement_error(exc):
                raise  # no such table or column: a schema that is not the code's
            raise unavailable(exc) from exc
        for observer in self.observers:
            observer(statements)

    @override
    async def stored(self, session_id: str, *, run_id: str) -> tuple[int | None, str | None]:
        def read(driver: sqlite3.Connection) -> tuple[int | None, str | None]:
            params = {"session_id": session_id, "run_id": run_id}
            count, status = driver.execute(f"SELECT {STORED_COLUMNS}", params).fetchone()
            return count, status

        return await self._writes.transact_driver(read)

    @override
    async def last_message(self, session_id: str) -> StoredTail | None:
        def read(driver: sqlite3.Connection) -> StoredTail | None:
            row = driver.execute(LAST_MESSAGE_SQL, {"session_id": session_id}).fetchone()
            return None if row is None else StoredTail.of_row(row, timestamp=_stored_time)

        return await self._writes.transact_driver(read)

    def _body(self, driver: sqlite3.Connection, *, write: JournalWrite) -> int:
        statements = self._statements(driver, write=write)
        if write.before_commit is not None:
            write.before_commit()
        return statements

    def _statements(self, driver: sqlite3.Connection, *, write: JournalWrite) -> int:
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
            claim.update(self._values("session", prefix="s_", values=write.new_session))
        sql = self._claims[(write.new_session is not None, write.touch)]
        if driver.execute(sql, claim).rowcount != 1:
            raise SessionConflict(write.session_id)
        statements = 1
        if write.messages:
            rows = [
                {
                    "session_id": write.session_id,
                    **self._values("message", prefix="", values=message_to_row(m, now=write.now)),
                }
                for m in write.messages
            ]
            driver.executemany(self.INSERT_MESSAGE, rows)
            statements += 1
        if write.new_run is not None:
            driver.execute(self.INSERT_RUN, self._values("run", prefix="r_", values=write.new_run))
            statements += 1
        if write.run_values is not None:
            columns = tuple(write.run_values)
            if columns not in self._run_updates:
                self._run_updates[columns] = run_update_sql(columns, where="id = :run_id")
            values = self._values("run", prefix="u_", values=write.run_values)
            driver.execute(self._run_updates[columns], {**values, "run_id": write.run_id})
            statements += 1
        if write.interrupted:
            driver.executemany(self.INTERRUPTED, [{"id": i, "now": now} for i in write.interrupted])
            statements += 1
        return statements

    def _values(self, table: str, *, prefix: str, values: dict[str, Any]) -> dict[str, Any]:
        """Parameters named `<prefix><column>`, as the column's bind processor stores them."""
        bind = self._bind[table]
        return {prefix + c: bind[c](v) if c in bind else v for c, v in values.items()}


def _bind_processors(model: type[Base], *, dialect: Dialect) -> dict[str, Callable[[Any], Any]]:
    """Each column's bind processor on `dialect`, where it has one. Asked of the dialect's own
    type: a TypeDecorator's generic impl has none for dates, and a datetime left to the stdlib
    driver's default adapter (deprecated since Python 3.12) is stored in another format."""
    processors: dict[str, Callable[[Any], Any]] = {}
    for column in model.__table__.columns:
        processor = column.type.dialect_impl(dialect).bind_processor(dialect)
        if processor is not None:
            processors[column.name] = processor
    return processors


def _stored_time(value: str) -> datetime:
    """A UTCDateTime as the driver reads it back: the naive UTC text its write stored."""
    return datetime.fromisoformat(value).replace(tzinfo=UTC)
