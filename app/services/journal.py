"""The durable writes of a turn (CONTRACT §2), each one short transaction.

The journal decides what each write holds (the turn's user message on its first write, the
run's progress, the session row of a new session); app/db/journal/ carries it out,
fenced and compare-and-set on the session's message count, so a runner that lost the
session writes nothing (SessionConflict). One whose hold ended only with its lock
connection takes the session again if nothing was stored to it since (`_regained`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import KW_ONLY, dataclass, field
from datetime import datetime
from functools import partial
from typing import Any

from typing_extensions import override

from app.db.base import utcnow
from app.db.journal import JournalStore, JournalWrite, StoredTail, WriteOutcomeUnknown
from app.db.outages import unavailable
from app.domain import Message, RunStatus, Usage
from app.errors import SessionConflict
from app.failpoints import Failpoints
from app.metrics import Metrics
from app.services.ownership import Ownership

log = logging.getLogger(__name__)


@dataclass
class Turn:
    """One run of one turn: who it is for and what of it is stored so far."""

    run_id: str
    agent: str
    user_message: Message
    session_id: str | None = None
    tenant_id: str | None = None
    user_id: str | None = None
    session_metadata: dict[str, Any] = field(default_factory=dict)
    run_metadata: dict[str, Any] = field(default_factory=dict)
    idempotency_key: str | None = None
    fingerprint: str | None = None
    stored_count: int = 0
    session_exists: bool = False
    stored_status: str | None = None  # this run's status as last stored (None: no row yet)
    user_stored: bool = False
    created_at: datetime = field(default_factory=utcnow)
    finished_at: datetime | None = None
    iterations: int = 0
    usage: Usage = field(default_factory=Usage)
    # The stop reason of the turn's last model answer (None before one): stored at its end.
    stop_reason: str | None = None
    messages: list[Message] = field(default_factory=list)
    stored_run_values: dict[str, Any] | None = None  # run_values() as last written

    def run_values(self) -> dict[str, Any]:
        """Columns of the run row that change as it goes."""
        return {
            "iterations": self.iterations,
            "input_tokens": self.usage.input_tokens,
            "output_tokens": self.usage.output_tokens,
        }

    def stored_state(self) -> tuple[int | None, str | None]:
        """The session's message count and this run's status as this turn last stored them
        (None: no such row yet), in the form of JournalStore.stored."""
        return (
            self.stored_count if self.session_exists else None,
            self.stored_status,
        )


@dataclass(frozen=True)
class RunEnd:
    """How a run ended, as its record stores it."""

    status: RunStatus
    response: str | None
    _: KW_ONLY
    error_type: str | None = None
    error_message: str | None = None


class Journal:
    """Where the runner records a turn: the interface, and what every journal does (name the
    run on each message of the turn, `run_id`). `StatelessJournal` writes nothing;
    `DurableJournal` writes each step."""

    async def record_start(self, turn: Turn, *, interrupted: Sequence[str]) -> None:
        """Start of a turn: the run, and the runs found dead (their runners died)."""

    async def record_repairs(self, turn: Turn, *, repairs: Sequence[Message]) -> None:
        """Results for the calls orphaned by a dead run, all in one write."""

    async def record_step(self, turn: Turn, *, assistant: Message, effects: bool = True) -> None:
        """Write #1: the assistant message with its tool calls (and the user message).
        `effects`: a handler not safe to retry may run once it is stored, so it is flushed
        to the disk first."""

    async def check_owned(self, turn: Turn) -> None:
        """Raise SessionConflict if this runner may have lost the session (before a dispatch)."""

    async def record_results(self, turn: Turn, *, results: Sequence[Message]) -> None:
        """Write #2: every tool result of the step, or none."""

    async def record_end(self, turn: Turn, *, final: Message | None, end: RunEnd) -> None:
        """End of turn: the final answer (and the user message) and the run's outcome."""

    @staticmethod
    def _stamp(turn: Turn, *, messages: Sequence[Message]) -> None:
        """The turn's messages, and its user message while not stored, name its run."""
        if not turn.user_stored:
            turn.user_message.run_id = turn.run_id
        for message in messages:
            message.run_id = turn.run_id


class StatelessJournal(Journal):
    """A run without a session: nothing is written (§2), but the turn's messages get the
    `seq` and `created_at` a stored turn's would; the turn is all the history there is, so
    its user message is 1."""

    @override
    async def record_step(self, turn: Turn, *, assistant: Message, effects: bool = True) -> None:
        self._number(turn, messages=[assistant])

    @override
    async def record_results(self, turn: Turn, *, results: Sequence[Message]) -> None:
        self._number(turn, messages=results)

    @override
    async def record_end(self, turn: Turn, *, final: Message | None, end: RunEnd) -> None:
        final_messages = [final] if final is not None else []
        self._number(turn, messages=final_messages, now=turn.finished_at)

    def _number(
        self, turn: Turn, *, messages: Sequence[Message], now: datetime | None = None
    ) -> None:
        self._stamp(turn, messages=messages)
        now = now or utcnow()
        if turn.user_message.seq is None:
            turn.user_message.seq, turn.user_message.created_at = 1, turn.created_at
        for offset, message in enumerate(messages, start=len(turn.messages) + 1):
            message.seq, message.created_at = offset, now


class DurableJournal(Journal):
    """Writes each step of a session's turn in its own fenced transaction."""

    def __init__(
        self, store: JournalStore, *, failpoints: Failpoints, ownership: Ownership, metrics: Metrics
    ) -> None:
        self._store = store
        self._failpoints = failpoints
        self._ownership = ownership
        self._metrics = metrics

    @override
    async def record_start(self, turn: Turn, *, interrupted: Sequence[str]) -> None:
        new_run, run_values = None, None
        if turn.stored_status is not None:  # a continued turn runs again
            run_values = {"status": RunStatus.RUNNING.value, "finished_at": None}
        else:
            new_run = self._new_run(turn)
        with self._metrics.write("start"):
            await self._write(
                turn,
                batch=[],
                touch=True,
                new_run=new_run,
                run_values=run_values,
                interrupted=interrupted,
            )
        turn.stored_status = RunStatus.RUNNING.value
        turn.stored_run_values = turn.run_values()

    @override
    async def record_repairs(self, turn: Turn, *, repairs: Sequence[Message]) -> None:
        with self._metrics.write("repair"):
            await self._write(turn, batch=repairs, touch=False)

    @override
    async def record_step(self, turn: Turn, *, assistant: Message, effects: bool = True) -> None:
        self._stamp(turn, messages=[assistant])
        self._failpoints.reach("before-write-1")
        with self._metrics.write("write1"):
            await self._append(turn, messages=[assistant], flush=effects)
        self._failpoints.reach("after-write-1")

    @override
    async def check_owned(self, turn: Turn) -> None:
        assert turn.session_id is not None
        try:
            await self._ownership.check(turn.session_id)
        except SessionConflict:
            if not await self._regained(turn):
                raise

    async def _regained(self, turn: Turn) -> bool:
        """After a SessionConflict: whether the session's hold had only ended with the
        ownership's connection (a backend ended, a network blip) and is taken again, with
        nothing stored to the session since this turn's last write. Another runner's turn
        on it would have moved its message count or, from its start record on, marked this
        turn's run `interrupted`. The turn then goes on, its results kept."""
        if await self._taken_again(turn, turn.stored_state()) is None:
            return False
        log.warning(
            "the session's hold ended with the ownership connection; taken again,"
            " nothing stored since: the turn goes on"
        )
        return True

    async def _settled(self, turn: Turn, *, write: JournalWrite) -> bool:
        """After the turn's write whose outcome is unknown (its connection and the session's
        hold ended together: a backend or the network, not the database): whether the session
        is taken again, its stored state either the one before this write (as `_regained`
        asks) or the one after it, and the write then stored (sent again if it had not
        committed). Any other state is another runner's doing."""
        after = (write.new_count, (write.run_values or {}).get("status", RunStatus.RUNNING.value))

        async def whose(index: int) -> bool:
            # Another runner continuing this keyed turn under its run_id can leave the same
            # count and status: the last stored message says whether the write is this one.
            if index == 0 or not write.messages:
                return True
            return await self._store.last_message(write.session_id) == StoredTail.of(
                write.messages[-1]
            )

        # Before and after alike (a run update that leaves the status): it is sent again.
        found = await self._taken_again(turn, turn.stored_state(), after, mine=whose)
        if found is None:
            return False
        committed = found == 1
        log.warning(
            "the session's hold ended with a durable write's connection; taken again, the write %s",
            "had committed" if committed else "had not committed: sent again",
        )
        if not committed:
            await self._send_again(write)
        return True

    async def _taken_again(
        self,
        turn: Turn,
        *states: tuple[int | None, str | None],
        mine: Callable[[int], Awaitable[bool]] | None = None,
    ) -> int | None:
        """Take the turn's session again if no other runner holds it and its stored state
        (message count, this run's status) is one of `states` (and `mine` says yes to its
        index): the index of the first it is, or None (the session not taken)."""
        session_id = turn.session_id
        assert session_id is not None
        found: list[int] = []

        async def expected() -> bool:
            state = await self._store.stored(session_id, run_id=turn.run_id)
            if state in states:
                index = states.index(state)
                if mine is None or await mine(index):
                    found.append(index)
            return bool(found)

        return found[0] if await self._ownership.retake(session_id, unchanged=expected) else None

    async def _send_again(self, write: JournalWrite) -> None:
        """The write once more, on the session taken again (as the store sends a write again:
        without its failpoint); its outcome unknown once more is a 503."""
        write.fence = self._ownership.fence_params(write.session_id)  # the new connection's
        write.before_commit = None
        try:
            await self._store.write(write)
        except WriteOutcomeUnknown as unknown:
            raise unavailable(unknown.error) from unknown.error

    @override
    async def record_results(self, turn: Turn, *, results: Sequence[Message]) -> None:
        self._stamp(turn, messages=results)
        self._failpoints.reach("after-handlers")
        before_commit = None
        if self._failpoints.armed:  # the rows are sent, the commit is not
            before_commit = partial(self._failpoints.reach, "in-write-2")
        with self._metrics.write("write2"):
            await self._append(turn, messages=results, before_commit=before_commit)
        self._failpoints.reach("after-write-2")

    @override
    async def record_end(self, turn: Turn, *, final: Message | None, end: RunEnd) -> None:
        values = {
            **turn.run_values(),
            "status": end.status.value,
            "response": end.response,
            "error_type": end.error_type,
            "error_message": end.error_message,
            "stop_reason": turn.stop_reason,
            "finished_at": turn.finished_at,
        }
        self._stamp(turn, messages=[final] if final is not None else [])
        self._failpoints.reach("before-final-write")
        with self._metrics.write("final"):
            # No final answer (every end but `complete`): only the run's end is written, and
            # a user message no step stored stays unstored (a failed first model call, §2).
            # Written at the run's finished_at: its final answer is not later than its end.
            if final is None:
                await self._write(
                    turn, batch=[], touch=True, run_values=values, now=turn.finished_at
                )
            else:
                await self._append(turn, messages=[final], end=values, now=turn.finished_at)
        turn.stored_status = end.status.value

    async def _append(
        self,
        turn: Turn,
        *,
        messages: Sequence[Message],
        end: dict[str, Any] | None = None,
        before_commit: Callable[[], None] | None = None,
        flush: bool = False,
        now: datetime | None = None,
    ) -> None:
        """Append messages (after the user message, if due) and bring the run up to date:
        to its `end` values, else to its progress if that moved (write #2: usually not)."""
        batch = list(messages)
        if not turn.user_stored:
            batch.insert(0, turn.user_message)
        progress = turn.run_values()
        run_values = end
        if run_values is None and progress != turn.stored_run_values:
            run_values = progress
        await self._write(
            turn,
            batch=batch,
            touch=end is not None,
            run_values=run_values,
            before_commit=before_commit,
            flush=flush,
            now=now,
        )
        turn.stored_run_values = progress
        turn.user_stored = True

    async def _write(
        self,
        turn: Turn,
        *,
        batch: Sequence[Message],
        touch: bool,
        new_run: dict[str, Any] | None = None,
        run_values: dict[str, Any] | None = None,
        interrupted: Sequence[str] = (),
        before_commit: Callable[[], None] | None = None,
        flush: bool = False,
        now: datetime | None = None,
    ) -> None:
        """Number the batch after the stored history and write it with the run's changes, as
        of `now` (the time of the write if not given)."""
        assert turn.session_id is not None
        now = now or utcnow()
        for offset, message in enumerate(batch, start=1):
            message.seq = turn.stored_count + offset
            message.created_at = now
        new_session = (
            None if turn.session_exists else self._new_session(turn, added=len(batch), now=now)
        )
        write = JournalWrite(
            session_id=turn.session_id,
            run_id=turn.run_id,
            expected=turn.stored_count,
            now=now,
            fence=self._ownership.fence_params(turn.session_id),
            messages=batch,
            touch=touch,
            new_session=new_session,
            new_run=new_run,
            run_values=run_values,
            interrupted=interrupted,
            before_commit=before_commit,
            flush=flush,
        )
        try:
            await self._store.write(write)
        except SessionConflict:
            if not await self._regained(turn):
                raise
            await self._send_again(write)
        except WriteOutcomeUnknown as unknown:
            if not await self._settled(turn, write=write):
                raise unavailable(unknown.error) from unknown.error
        turn.stored_count += len(batch)
        turn.session_exists = True

    @staticmethod
    def _new_session(turn: Turn, *, added: int, now: datetime) -> dict[str, Any]:
        return {
            "id": turn.session_id,
            "agent": turn.agent,
            "tenant_id": turn.tenant_id,
            "user_id": turn.user_id,
            "metadata": turn.session_metadata,
            "message_count": turn.stored_count + added,
            "created_at": turn.created_at,  # as its first run's: the turn that created it began
            "updated_at": now,
        }

    @staticmethod
    def _new_run(turn: Turn) -> dict[str, Any]:
        return {
            "id": turn.run_id,
            "session_id": turn.session_id,
            "agent": turn.agent,
            "user_id": turn.user_id,
            "status": RunStatus.RUNNING.value,
            "metadata": turn.run_metadata,
            "idempotency_key": turn.idempotency_key,
            "request_fingerprint": turn.fingerprint,
            "created_at": turn.created_at,
            **turn.run_values(),
        }
