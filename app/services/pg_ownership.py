"""Session ownership across replicas on PostgreSQL (see services/ownership.py).

`PostgresOwnership` holds a session-level advisory lock per session on ONE dedicated
connection per process. PostgreSQL releases a session-level lock when its connection closes,
so ownership dies with the process: after `kill -9` the kernel closes the socket and the next
request takes the session over at once. A holder that is alive but stalled (SIGSTOP, a
partition) keeps its socket open, so the lock connection also sends a heartbeat query every
`heartbeat_s`; a request that finds the lock held by a connection idle for longer than
`takeover_after_s` terminates that backend (`pg_terminate_backend`), which frees the lock, and
takes the session.

Fencing: each lock connection also holds, for its whole life, an advisory lock on a random
token of its own (two int4 keys, which no session lock uses). A session is taken on one lock
connection and stays its own until that connection ends or lets it go, so `fence_sql` is "the
token of the connection this session was taken on is still held": a try for a shared lock on
it from the writing transaction fails only then. That is one lookup in the lock table,
where asking `pg_locks` who holds the session's lock copies every lock of the server (it
cost a write ~0.5 ms of server time per 1,000 sessions held). Before each tool dispatch
`check` makes sure the lock connection is alive and answered a heartbeat recently, beating
at once when the last one is late, so a runner resumed after a takeover dispatches nothing.

Whether another runner holds a session (a session's status, a 409's search for the holder)
is asked the same way, on a second connection that holds no lock (services/pg_questions.py):
a try for a shared lock on the session's key, for one statement, fails only while a runner
holds its lock. A turn taking the session at that very instant finds it refused by nobody
(`_holder` sees no runner's lock) and tries again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from contextlib import asynccontextmanager
from typing import Any, Literal

import asyncpg
from typing_extensions import override

from app.db.outages import PG_CONNECTION_ERRORS
from app.db.urls import pg_connector
from app.errors import SessionBusy, SessionConflict
from app.services.ownership import ActiveRuns, Ownership
from app.services.pg_locks import (
    HOLDER_SQL,
    PG_FENCE_SQL,
    Token,
    key_parts,
    lock_key,
    new_token,
)
from app.services.pg_questions import (
    HoldQuestions,
    answered_within,
    close_within,
    once_more_if_ended,
)

log = logging.getLogger(__name__)


class PostgresOwnership(Ownership):
    """Advisory locks on one connection per process, with heartbeat-based takeover."""

    def __init__(self, database_url: str, *, heartbeat_s: float, takeover_after_s: float) -> None:
        self.active = ActiveRuns()
        self.shared = True
        self._open = pg_connector(database_url)
        self._heartbeat_s = heartbeat_s
        self._takeover_after_s = takeover_after_s
        self._conn: asyncpg.Connection | None = None
        self._pid = -1
        # The current connection's token, and one never taken, for sessions not held.
        self._token = self._unheld = new_token()
        # Sessions locked, each with the token of the connection it was locked on.
        self._held: dict[str, Token] = {}
        # Sessions still held by a turn whose lock went with an earlier connection (`retake`).
        self._lost: set[str] = set()
        self._io = asyncio.Lock()  # one query at a time on the lock connection
        # Whether others hold sessions is asked on a connection of its own.
        self._questions = HoldQuestions(
            self._open, timeout_s=self._statement_timeout_s, takeover_after_s=takeover_after_s
        )
        # One retake at a time: a step's parallel calls find a lost hold all at once, and a
        # second pg_try_advisory_lock on the same connection would take the lock twice
        # (PostgreSQL counts them), so that the turn's one unlock would leave it held.
        self._retaking = asyncio.Lock()
        self._last_beat = 0.0
        self._beater: asyncio.Task[None] | None = None
        self._sent = 0  # statements on the lock connection
        # Releases still under way though their requests were cancelled (`_release`): `stop`
        # waits for them, and after it no connection is opened again.
        self._releasing: set[asyncio.Task[None]] = set()
        self._stopped = False

    @override
    async def start(self) -> None:
        try:
            await self._connect()
        except Exception as exc:  # the heartbeat keeps trying; requests answer 503 meanwhile
            log.warning("ownership connection failed (%s)", type(exc).__name__)
        self._beater = asyncio.create_task(self._beat(), name="ownership-heartbeat")

    @override
    async def stop(self) -> None:
        while self._releasing:  # one may start while another is waited for
            await asyncio.wait(set(self._releasing))
        self._stopped = True
        if self._beater is not None:
            self._beater.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._beater
        # Each in its line (a statement in flight ends first), and closed within a
        # statement's deadline: a server that no longer answers is not waited for.
        await self._questions.stop()
        async with self._io:
            if self._conn is not None:
                await close_within(self._conn, timeout_s=self._statement_timeout_s)

    @property
    @override
    def statements(self) -> int:
        return self._sent + self._questions.statements

    @asynccontextmanager
    @override
    async def hold(self, session_id: str) -> AsyncIterator[None]:
        await self.active.claim(session_id)
        try:
            key = lock_key(session_id)
            token = await self._take(key, from_stalled=True)
            if token is None:
                raise SessionBusy(session_id, active_run_id=None)
            self._held[session_id] = token
            try:
                yield
            finally:
                self._held.pop(session_id, None)
                self._lost.discard(session_id)
                await self._release(key)
        finally:
            self.active.release(session_id)

    @property
    @override
    def fence_sql(self) -> str:
        return PG_FENCE_SQL

    @override
    def fence_params(self, session_id: str) -> dict[str, Any]:
        hi, lo = self._held.get(session_id, self._unheld)
        return {"token_hi": hi, "token_lo": lo}

    @property
    def lock_pid(self) -> int:
        """The backend pid of the current lock connection (-1 before the first): what an
        administrator, or a test, ends to end this process's hold on its sessions."""
        return self._pid

    @override
    async def check(self, session_id: str) -> None:
        if self._stale():
            # The heartbeat is late: the event loop was held up (a tool that blocks it), or
            # the database answers slowly. Beat now: an answer means the lock connection, and
            # every lock on it, is alive, and restarts the idle time other replicas wait out
            # before taking over; no answer, and the session may be gone.
            with contextlib.suppress(ConnectionError):
                await self._heartbeat(if_stale=True)
        # Its lock went with an earlier connection.
        lost = self._held.get(session_id) != self._token
        if self._conn is None or self._conn.is_closed() or self._stale() or lost:
            raise SessionConflict(session_id)

    @override
    async def retake(self, session_id: str, *, unchanged: Callable[[], Awaitable[bool]]) -> bool:
        """Take again a session held by a turn of this process whose lock went with an earlier
        lock connection, if no other runner holds it now and `unchanged()` then says nothing
        was stored to it meanwhile (another runner may have taken it over and let it go).
        Otherwise it is let go for good: the turn's checks and writes fail from then on."""
        async with self._retaking:
            return await self._retake(session_id, unchanged=unchanged)

    async def _retake(self, session_id: str, *, unchanged: Callable[[], Awaitable[bool]]) -> bool:
        key = lock_key(session_id)
        try:
            # Asked, not looked at: a connection whose end is not seen yet (the turn's write
            # failed with it first) fails the statement and is replaced, and a new connection
            # counts the old one's sessions `_lost`.
            await self.ping()
            if session_id not in self._lost and self._held.get(session_id) == self._token:
                # Taken again, on this live connection, by a call of the same step: held, the
                # stored state is still the turn's own (asked, so the caller learns which).
                return await unchanged()
            token = await self._take(key, from_stalled=False) if session_id in self._lost else None
        except ConnectionError:
            return False
        if token is None:
            return False
        self._lost.discard(session_id)
        try:
            if not await unchanged():
                await self._unlock(key)
                return False
        except BaseException:  # cancellation too: a lock taken must not outlive the attempt
            await self._release(key)
            raise
        if token != self._token:  # lost again while the session was read
            self._lost.add(session_id)
            return False
        self._held[session_id] = token
        return True

    @property
    def _statement_timeout_s(self) -> float:
        """How long a statement on the lock connection may go unanswered before the connection
        is dropped: as long as a holder may go without a heartbeat and still dispatch."""
        return self._takeover_after_s / 2

    def _stale(self) -> bool:
        """The last heartbeat is older than a holder may go without one and still dispatch."""
        return time.monotonic() - self._last_beat > self._statement_timeout_s

    @override
    async def is_held(self, session_id: str) -> bool:
        return bool(await self.held_among([session_id]))

    @override
    async def held_among(self, session_ids: Collection[str]) -> set[str]:
        held = {s for s in session_ids if self.active.holds(s)}
        others = {lock_key(s): s for s in session_ids if s not in held}
        if not others:
            return held
        return held | await self._questions.held_by_others(others)

    async def _connect(self) -> None:
        """Open the lock connection and take its token (call with `_io` held, or before any
        other use: `start`). Opening it and its first statement are timed as every statement
        is: a server that accepts the connection and then answers nothing (a half-open path
        after a failover) would hold `_io`, and with it every request of the process, until
        the kernel gives up on the socket."""
        # The handshake too: the URL's connect_timeout (5 s unless set) may be longer.
        conn = await answered_within(self._open(), timeout_s=self._statement_timeout_s)
        try:
            while True:  # a token someone holds is one in 2**64: draw again
                token = new_token()
                row = await answered_within(
                    conn.fetchrow(
                        "SELECT pg_backend_pid() AS pid, pg_try_advisory_lock($1, $2) AS taken",
                        *token,
                    ),
                    timeout_s=self._statement_timeout_s,
                )
                if row["taken"]:
                    break
        except BaseException:
            conn.terminate()  # one left open per failed beat would use up the server's slots
            raise
        self._pid, self._token = row["pid"], token
        self._lost.update(self._held)  # a new connection holds no session's lock
        self._held = {}
        self._conn = conn
        self._last_beat = time.monotonic()

    async def _beat(self) -> None:
        """Heartbeat on the lock connection, re-opening it (holding nothing) when it was lost."""
        while True:
            await asyncio.sleep(self._heartbeat_s)
            with contextlib.suppress(ConnectionError):
                await self._heartbeat()

    async def _heartbeat(self, *, if_stale: bool = False) -> None:
        """One beat (with `if_stale`, none if another beat landed while this one waited its
        turn); a connection that fails it, or does not answer in as long as a holder may go
        without a beat before `check` stops its runs, is dropped (ConnectionError). A
        database that answers late, not never, costs no session."""
        try:
            async with self._io:
                if if_stale and not self._stale():
                    return
                conn = await self._connection()
                # As of sending: an answer that waited (this process stopped, its loop held
                # up) says the connection was alive then, not when it is read.
                sent = time.monotonic()
                await answered_within(
                    conn.fetchval("SELECT 1"), timeout_s=self._statement_timeout_s
                )
            self._last_beat = sent
        except ConnectionError:
            raise
        except Exception as exc:
            self._drop(exc)
            raise ConnectionError("the ownership connection is down") from exc

    def _drop(self, exc: BaseException) -> None:
        """Close the lock connection after a statement or heartbeat on it failed: every lock
        died with it, so runs in flight fail their next check and fence (the next connection
        counts their sessions lost: `_connect`)."""
        if self._conn is not None:
            log.warning("ownership connection lost (%s)", type(exc).__name__)
            self._conn.terminate()
            self._conn = None

    async def _connection(self) -> asyncpg.Connection:
        """The lock connection, re-opened on demand (call with `_io` held).

        A new connection holds a token of its own and no session's lock, and fences name the
        token of the connection each session was taken on: runs that held sessions on the old
        one keep failing their writes and checks until they take them again.
        """
        if self._stopped:  # a late statement must not open a connection nobody closes
            raise ConnectionError("the ownership is stopped")
        if self._conn is not None and self._conn.is_closed():
            log.warning("ownership connection lost; the sessions it held are to be taken again")
            self._conn = None
        if self._conn is None:
            try:
                await self._connect()
            except (*PG_CONNECTION_ERRORS, asyncpg.PostgresError, TimeoutError) as exc:
                raise ConnectionError("the ownership connection is down") from exc
        assert self._conn is not None
        return self._conn

    @override
    async def ping(self) -> None:
        """Raise ConnectionError unless the lock connection answers."""
        await self._query("SELECT 1")

    async def _query(
        self, sql: str, *args: Any, result: Literal["value", "row", "rows"] = "value"
    ) -> Any:
        """One statement on the lock connection: its value, its row (or None), or all its
        rows; a failed connection, or one that does not answer in `_statement_timeout_s`, is
        dropped and reported as ConnectionError (503)."""
        async with self._io:
            return await self._answer(sql, args=args, result=result)

    async def _answer(
        self, sql: str, *, args: tuple[Any, ...], result: Literal["value", "row", "rows"]
    ) -> Any:
        """`_query`'s statement (call with `_io` held). A connection that failed under it is
        replaced and the statement sent once more: the server had ended it unseen (a backend
        ended, a proxy's idle timeout; its goodbye raced the statement), which says nothing of
        the database. Every statement here may run again: a lock taken on the failed
        connection went with it."""
        return await once_more_if_ended(lambda: self._send(sql, args=args, result=result))

    async def _send(
        self, sql: str, *, args: tuple[Any, ...], result: Literal["value", "row", "rows"]
    ) -> Any:
        """`_query`'s one try (call with `_io` held)."""
        self._sent += 1
        conn = await self._connection()
        fetch = {"value": conn.fetchval, "row": conn.fetchrow, "rows": conn.fetch}[result]
        try:
            return await answered_within(fetch(sql, *args), timeout_s=self._statement_timeout_s)
        except (*PG_CONNECTION_ERRORS, TimeoutError) as exc:
            # Unanswered, it would hold `_io`, and with it the heartbeat that would have
            # noticed: every request of the process would wait on the connection forever.
            self._drop(exc)
            raise ConnectionError("the ownership connection is down") from exc

    async def _try_lock(self, key: int) -> Token | None:
        """The token of the lock connection that took the session's lock; None if another
        runner holds it."""
        async with self._io:
            taken = await self._answer(
                "SELECT pg_try_advisory_lock($1)", args=(key,), result="value"
            )
            return self._token if taken else None  # the connection that answered

    async def _release(self, key: int) -> None:
        """Unlock, shielded: a shutdown that cancels its request here (the turn stored) must
        not leave the lock held on a connection that lives on. The unlock goes on without
        it, and `stop` waits for it."""
        release = asyncio.ensure_future(self._unlock(key))
        self._releasing.add(release)
        release.add_done_callback(self._releasing.discard)
        await asyncio.shield(release)

    async def _unlock(self, key: int) -> None:
        """Release the session's lock on the lock connection. One that has ended took the
        lock with it: no connection is opened for this (nor after stop)."""
        with contextlib.suppress(Exception):
            async with self._io:
                if self._stopped or self._conn is None or self._conn.is_closed():
                    return
                await self._send("SELECT pg_advisory_unlock($1)", args=(key,), result="value")

    async def _holder(self, key: int) -> tuple[int, float] | None:
        """The pid holding `key` and how long its connection has been idle, if anyone does."""
        row = await self._query(HOLDER_SQL, *key_parts(key), result="row")
        if row is None:
            return None
        return int(row["pid"]), float(row["idle_s"] or 0.0)

    async def _take(self, key: int, *, from_stalled: bool) -> Token | None:
        """The token of the lock connection that took the session's lock (`_try_lock`): at
        once, once a refusal with no runner's lock to be seen is over, or (`from_stalled`)
        from a holder that missed its heartbeats; None while a runner holds it.

        Such a refusal is a holder letting the session go, a holder's backend exiting (it
        was ended here, or by an administrator), or another replica asking whether the
        session is held (`HELD_AMONG_SQL`: a shared lock for one statement)."""
        if (token := await self._try_lock(key)) is not None:
            return token
        holder = await self._holder(key)
        if holder is not None:
            pid, idle_s = holder
            if not from_stalled or idle_s < self._takeover_after_s:
                return None
            log.warning("taking over a session from a stalled runner", extra={"pid": pid})
            await self._query("SELECT pg_terminate_backend($1)", pid)
        # An ended backend exits asynchronously; its locks go with it.
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            if (token := await self._try_lock(key)) is not None:
                return token
            await asyncio.sleep(0.05)
        return None
