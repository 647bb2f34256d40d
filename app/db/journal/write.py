"""What a durable write is (`JournalWrite`) and what carries it out (`JournalStore`)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from app.domain import Message


@dataclass
class JournalWrite:
    """One durable write: messages appended after `expected`, and the run rows it touches.

    `messages` have their `seq` set. `new_session` (the row's values) creates the session
    instead of advancing it; `new_run` inserts the turn's run, `run_values` updates it;
    `interrupted` marks other runs of the session `interrupted`. `touch` moves the session's
    `updated_at` (start and end of a turn only: it is indexed). `before_commit` runs after
    every row is sent and before the commit (the `in-write-2` failpoint). `flush`: handlers
    not safe to retry run once it has committed, so the commit must survive a power loss
    too (SQLite syncs it; a PostgreSQL commit always is, unless `synchronous_commit` is off).
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
    flush: bool = False

    @property
    def new_count(self) -> int:
        """The session's message count once the write has committed."""
        return self.expected + len(self.messages)


class WriteOutcomeUnknown(Exception):
    """A write's connection ended under it while the session's hold ended too (the lock
    connection with it), so the stored state could not say whether it committed: another
    runner may have written since. `error` is the connection's."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(type(error).__name__)
        self.error = error


class JournalStore(Protocol):
    # Called after each commit with the number of statements it held (the bench counts).
    observers: list[Callable[[int], None]]

    async def write(self, write: JournalWrite) -> None:
        """Commit the write, or raise SessionConflict having written nothing (or
        WriteOutcomeUnknown, not knowing which)."""
        ...

    async def stored(self, session_id: str, *, run_id: str) -> tuple[int | None, str | None]:
        """The session's message count and the run's status as stored (None: no such row)."""
        ...

    async def last_message(self, session_id: str) -> StoredTail | None:
        """What tells whose the session's last stored message is (None: none stored)."""
        ...


@dataclass(frozen=True)
class StoredTail:
    """A stored message as far as telling whose it is goes: its role, text, the ids of the
    call it answers or the calls it makes, and when it was written. The model's ids are
    unique only when it makes them at random, and `scripted:` models make them from the
    history's place, so two runners' steps can match but for the time: every message of a
    write is stamped with the write's `now`."""

    role: str
    content: str | None
    tool_call_id: str | None
    tool_call_ids: tuple[str, ...]
    created_at: datetime

    @classmethod
    def of_row(cls, row: Sequence[Any], *, timestamp: Callable[[Any], datetime]) -> StoredTail:
        """From the row of LAST_MESSAGE_SQL (its JSON column as the driver gives it, its
        time read by `timestamp`)."""
        role, content, tool_call_id, tool_calls, created_at = row
        calls = json.loads(tool_calls) if isinstance(tool_calls, str) else tool_calls
        ids = tuple(c["id"] for c in calls or ())
        return cls(role, content, tool_call_id, ids, timestamp(created_at))

    @classmethod
    def of(cls, message: Message) -> StoredTail:
        """What a message of a write (its `created_at` the write's `now`) shows once stored."""
        assert message.created_at is not None
        return cls(
            message.role.value,
            message.content,
            message.tool_call_id,
            tuple(c.id for c in message.tool_calls),
            message.created_at,
        )
