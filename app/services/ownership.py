"""Who may run a session: one runner at a time, across every replica sharing the database.

Two layers:
- In this process, `ActiveRuns` refuses a second request on a session (after waiting up to
  SETTLE_WAIT_S for a claim that has no run yet, so that its 409 can name one).
- Across processes, an `Ownership`: on PostgreSQL advisory locks that die with the process
  (`PostgresOwnership`, services/pg_ownership.py); on SQLite one process owns the file (a
  second is refused at start), so `LocalOwnership` is the in-process layer alone, and a
  restart releases everything.

Fencing: every durable write includes the ownership's `fence_sql` in its own transaction, so a
runner that lost the session writes nothing more; before each tool dispatch the runner also
asks `check`, so a runner that lost it dispatches nothing. A hold that ended with a
connection, not to another runner, may be taken again (`retake`).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from typing_extensions import override

from app.db.urls import sqlite_file
from app.errors import ConfigError, SessionBusy, SqliteFileBusy


@dataclass
class _Claim:
    run_id: str | None = None
    settled: asyncio.Event = field(default_factory=asyncio.Event)
    released: asyncio.Event = field(default_factory=asyncio.Event)


class ActiveRuns:
    """The sessions this process is working on, and the run on each once it has started.

    A claim is pending until its run is stored (`confirm`). A second request waits briefly for
    a pending claim to settle, so its 409 names the run that won — never a run that was only
    waiting for the lock and lost, nor one that does not exist yet.
    """

    SETTLE_WAIT_S = 2.0

    def __init__(self) -> None:
        self._claims: dict[str, _Claim] = {}

    async def claim(self, session_id: str) -> None:
        """Take the session for this process, or raise SessionBusy.

        A claim given back without a run (a request refused, a replay answered) never made
        the session busy: the waiter takes the session then."""
        deadline = time.monotonic() + self.SETTLE_WAIT_S
        while (existing := self._claims.get(session_id)) is not None:
            left = deadline - time.monotonic()
            if existing.run_id is None and left > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(existing.settled.wait(), left)
            if existing.run_id is not None or self._claims.get(session_id) is existing:
                raise SessionBusy(session_id, active_run_id=existing.run_id)
        self._claims[session_id] = _Claim()

    def confirm(self, session_id: str, *, run_id: str) -> None:
        """The session is owned and `run_id`, now stored, runs on it."""
        claim = self._claims[session_id]
        claim.run_id = run_id
        claim.settled.set()

    def release(self, session_id: str) -> None:
        """Give the session back."""
        claim = self._claims.pop(session_id, None)
        if claim is not None:
            claim.settled.set()
            claim.released.set()

    def holds(self, session_id: str) -> bool:
        """Whether this process is working on the session."""
        return session_id in self._claims

    async def given_back(self) -> None:
        """Wait until this process works on no session (at shutdown: a few milliseconds)."""
        while self._claims:
            await next(iter(self._claims.values())).released.wait()


class Ownership(Protocol):
    active: ActiveRuns
    # Whether other processes see this one's holds: a session held here refuses their
    # requests (409), where a request of this process waits for a hold that runs no turn.
    shared: bool

    @property
    def statements(self) -> int:
        """Statements sent on ownership's own connections, outside the pool, each a
        transaction of its own (PostgreSQL: taking, releasing and taking over locks, the
        heartbeats and readiness pings, and the questions who holds sessions); the bench
        counts those a session's turn sends."""
        ...

    def hold(self, session_id: str) -> contextlib.AbstractAsyncContextManager[None]:
        """Own the session for the block, or raise SessionBusy (active_run_id may be None).

        The owner names its run with `active.confirm` once the run is stored."""
        ...

    @property
    def fence_sql(self) -> str:
        """A SQL condition, true while this process still owns the session named by the
        bind parameters (`:name`) that `fence_params` gives; written once, so statements
        that carry it can be prepared once."""
        ...

    def fence_params(self, session_id: str) -> dict[str, Any]:
        """The bind parameters of `fence_sql` for a session."""
        ...

    async def check(self, session_id: str) -> None:
        """Raise SessionConflict if this process can no longer be sure it owns the session."""
        ...

    async def retake(self, session_id: str, *, unchanged: Callable[[], Awaitable[bool]]) -> bool:
        """After a SessionConflict of a session this process holds: whether it took the
        session again, its hold having ended with a connection rather than to another runner,
        and `unchanged()` says nothing was stored to it meanwhile (another runner may have
        come and gone)."""
        ...

    async def is_held(self, session_id: str) -> bool:
        """Whether any live runner owns the session now."""
        ...

    async def held_among(self, session_ids: Collection[str]) -> set[str]:
        """Which of these sessions a live runner owns now (one lookup for a page of them)."""
        ...

    async def start(self) -> None:
        """Open what ownership needs."""
        ...

    async def ping(self) -> None:
        """Raise ConnectionError unless ownership can be taken now."""
        ...

    async def stop(self) -> None:
        """Release everything."""
        ...


def serving_lock_file(database_url: str) -> Path | None:
    """The file whose lock a process serving this SQLite database holds (None: not a file)."""
    database = sqlite_file(database_url)
    return None if database is None else Path(f"{database}.lock")


def take_serving_lock(lock_file: Path) -> int:
    """Lock the file for this process (an fd to keep open); SqliteFileBusy if another has it,
    ConfigError if it cannot be made."""
    try:
        # As `migrate` does: the database's folder is made if missing.
        lock_file.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise ConfigError(
            f"cannot use the SQLite database beside {lock_file}: {exc.strerror}"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise SqliteFileBusy(lock_file) from None
    return fd


class LocalOwnership(Ownership):
    """One process owns the store (SQLite, memory://): the in-process layer is all it takes.

    "One process" is enforced on a SQLite file: `start` takes an exclusive lock on
    `<file>.lock` (flock) for the life of the process, and a second process serving the same
    file is refused at start (its runs would not see this one's). The kernel drops the lock
    when the process dies, so a restart after `kill -9` owns everything again.
    """

    def __init__(self, lock_file: Path | None = None) -> None:
        self.active = ActiveRuns()
        self.shared = False
        self._lock_file = lock_file
        self._lock_fd: int | None = None

    @property
    @override
    def statements(self) -> int:
        return 0  # none: the lock is this process's memory

    @asynccontextmanager
    @override
    async def hold(self, session_id: str) -> AsyncIterator[None]:
        await self.active.claim(session_id)
        try:
            yield
        finally:
            self.active.release(session_id)

    @property
    @override
    def fence_sql(self) -> str:
        return "1 = 1"

    @override
    def fence_params(self, session_id: str) -> dict[str, Any]:
        return {}

    @override
    async def check(self, session_id: str) -> None:
        return None

    @override
    async def retake(self, session_id: str, *, unchanged: Callable[[], Awaitable[bool]]) -> bool:
        return False  # a hold here ends only with the process

    @override
    async def is_held(self, session_id: str) -> bool:
        return self.active.holds(session_id)

    @override
    async def held_among(self, session_ids: Collection[str]) -> set[str]:
        return {s for s in session_ids if self.active.holds(s)}

    @override
    async def start(self) -> None:
        if self._lock_file is not None:
            self._lock_fd = take_serving_lock(self._lock_file)

    @override
    async def ping(self) -> None:
        return None

    @override
    async def stop(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the lock
            self._lock_fd = None
