"""Whether runners hold sessions, asked on a PostgreSQL connection of its own, and the time
every statement of the ownership (services/pg_ownership.py) is given to answer.

The questions (a session's status, a page of them, a 409's wait for the holder's run) go on a
connection that holds no lock: in the lock connection's line, they held up every take and
release of the replica under load. That connection holds nothing past its statement, so
losing it costs nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Collection
from typing import Any, TypeVar

import asyncpg

from app.db.outages import PG_CONNECTION_ERRORS
from app.services.pg_locks import HELD_AMONG_SQL, STALLED_AMONG_SQL, key_parts

T = TypeVar("T")

# How long a lock statement whose deadline has passed is still given, from when the event loop
# runs again, before the lock connection is dropped (see `answered_within`): room for the
# round trip a prepared statement still needs on a loaded server, short against the takeover
# (at most half the statement's deadline, itself half the takeover). No dispatch is let
# through by it: `check` goes by when the last heartbeat was sent.
LAST_LOOK_S = 0.5


async def close_within(conn: asyncpg.Connection, *, timeout_s: float) -> None:
    """Close the connection within a statement's deadline: one whose server no longer
    answers is dropped, not waited for."""
    try:
        await conn.close(timeout=timeout_s)
    except Exception:
        conn.terminate()


async def answered_within(statement: Awaitable[T], *, timeout_s: float) -> T:
    """The statement's result, or TimeoutError if it has none `timeout_s` after it was asked for.

    Timed here, not by asyncpg, so that a deadline that passed while the event loop was held
    up (a tool that blocks it) gets one last look once the loop runs again: the deadline's
    timer can fire before the loop reads the answer that came meanwhile, or before it sends
    the statement's second round trip (asyncpg prepares a statement on its first use).
    """
    task = asyncio.ensure_future(statement)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
        if not done:
            done, _ = await asyncio.wait({task}, timeout=min(LAST_LOOK_S, timeout_s / 2))
    finally:
        task.cancel()  # no-op once done; otherwise timed out, or the caller was cancelled
    if not done:
        raise TimeoutError
    return task.result()


async def once_more_if_ended(attempt: Callable[[], Awaitable[T]]) -> T:
    """`attempt()`, made once more if its connection had ended (ConnectionError): the server
    may have ended it unseen. Not after a timeout: a database that does not answer is down."""
    try:
        return await attempt()
    except ConnectionError as lost:
        if isinstance(lost.__cause__, TimeoutError):
            raise
        return await attempt()


class HoldQuestions:
    """Which sessions other runners hold, asked on a connection opened on demand."""

    def __init__(
        self,
        open_connection: Callable[[], Awaitable[asyncpg.Connection]],
        *,
        timeout_s: float,
        takeover_after_s: float,
    ) -> None:
        self._open = open_connection
        self._timeout_s = timeout_s
        self._takeover_after_s = takeover_after_s
        self._conn: asyncpg.Connection | None = None
        self._io = asyncio.Lock()  # one question at a time
        self._stopped = False
        self.statements = 0

    async def held_by_others(self, sessions: dict[int, str]) -> set[str]:
        """Of these sessions (by lock key), those a runner holds, but for a stalled runner's
        (SIGSTOP, a partition): the next turn takes the session from it, and reads had shown
        it `running` for as long as the stall lasted. ConnectionError (503) if the database
        cannot be asked."""
        rows = await self._ask(HELD_AMONG_SQL, list(sessions))
        parts = {key_parts(row["k"]): sessions[row["k"]] for row in rows}
        if parts:
            his, los = zip(*parts, strict=True)
            stalled = await self._ask(
                STALLED_AMONG_SQL, list(his), list(los), self._takeover_after_s
            )
            for row in stalled:
                del parts[(row["hi"], row["lo"])]
        return set(parts.values())

    async def stop(self) -> None:
        """Close the connection (once a question in flight is answered), within a
        statement's deadline; no connection is opened after this."""
        self._stopped = True
        async with self._io:
            if self._conn is not None:
                await close_within(self._conn, timeout_s=self._timeout_s)

    async def _ask(self, sql: str, *args: Any) -> list[asyncpg.Record]:
        """A question's rows. A connection that fails is closed and, unless it did not answer
        in time, the question asked once more on a new one (the server may have ended it
        unseen), as on the lock connection; else ConnectionError."""
        async with self._io:
            return await once_more_if_ended(lambda: self._ask_once(sql, args=args))

    async def _ask_once(self, sql: str, *, args: Collection[Any]) -> list[asyncpg.Record]:
        """`_ask`'s one try (call with `_io` held)."""
        if self._stopped:
            raise ConnectionError("the ownership is stopped")
        if self._conn is None or self._conn.is_closed():
            try:
                self._conn = await answered_within(self._open(), timeout_s=self._timeout_s)
            except (*PG_CONNECTION_ERRORS, asyncpg.PostgresError, TimeoutError) as exc:
                raise ConnectionError("the ownership connection is down") from exc
        conn: asyncpg.Connection = self._conn
        self.statements += 1
        try:
            rows: list[asyncpg.Record] = await answered_within(
                conn.fetch(sql, *args), timeout_s=self._timeout_s
            )
        except (*PG_CONNECTION_ERRORS, TimeoutError) as exc:
            if self._conn is not None:
                self._conn.terminate()
                self._conn = None
            raise ConnectionError("the ownership connection is down") from exc
        return rows
