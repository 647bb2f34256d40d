"""The durable writes of a turn (CONTRACT §2), each one short transaction.

Every write appends messages with the next `seq` values and advances the session's
`message_count` with a compare-and-set, in the same statement as the ownership fence
(services/ownership.py): a runner that lost the session, or a second writer, fails its write
instead of interleaving (SessionConflict), and a repeated write conflicts on
`(session_id, seq)` instead of duplicating.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError

from app.db.base import utcnow
from app.db.repositories import JournalWriter
from app.db.session import Transactor
from app.domain import Message, RunStatus, Usage
from app.errors import SessionConflict
from app.failpoints import Failpoints
from app.metrics import Metrics
from app.services.ownership import Ownership


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
    run_stored: bool = False
    user_stored: bool = False
    created_at: datetime = field(default_factory=utcnow)
    finished_at: datetime | None = None
    iterations: int = 0
    usage: Usage = field(default_factory=Usage)
    messages: list[Message] = field(default_factory=list)
    stored_progress: tuple[int, int, int] | None = None

    def progress(self) -> tuple[int, int, int]:
        """Iterations, input and output tokens so far."""
        return self.iterations, self.usage.input_tokens, self.usage.output_tokens

    def run_values(self) -> dict[str, Any]:
        """Columns of the run row that change as it goes."""
        return {
            "iterations": self.iterations,
            "input_tokens": self.usage.input_tokens,
            "output_tokens": self.usage.output_tokens,
        }


@dataclass(frozen=True)
class RunEnd:
    status: RunStatus
    response: str | None
    error_type: str | None = None
    error_message: str | None = None


class Journal:
    """Stateless runs: the same calls, nothing written."""

    async def record_start(
        self, turn: Turn, repairs: Sequence[Message], interrupted: Sequence[str]
    ) -> None:
        """Start of a turn: the run, results for orphaned calls, runs found dead."""

    async def record_step(self, turn: Turn, assistant: Message) -> None:
        """Write #1: the assistant message with its tool calls (and the user message)."""
        assistant.run_id = turn.run_id

    def check_owned(self, turn: Turn) -> None:
        """Raise SessionConflict if this runner may have lost the session (before a dispatch)."""

    async def record_results(self, turn: Turn, results: Sequence[Message]) -> None:
        """Write #2: every tool result of the step, or none."""

    async def record_end(self, turn: Turn, final: Message | None, end: RunEnd) -> None:
        """End of turn: the final answer (and the user message) and the run's outcome."""


class DurableJournal(Journal):
    """Writes each step of a session's turn in its own fenced transaction."""

    def __init__(
        self,
        writes: Transactor,
        writer: JournalWriter,
        failpoints: Failpoints,
        ownership: Ownership,
        metrics: Metrics,
    ) -> None:
        self._writes = writes
        self._writer = writer
        self._failpoints = failpoints
        self._ownership = ownership
        self._metrics = metrics

    async def record_start(
        self, turn: Turn, repairs: Sequence[Message], interrupted: Sequence[str]
    ) -> None:
        assert turn.session_id is not None
        kind = "repair" if repairs or interrupted else "start"
        with self._metrics.write(kind):
            await self._start(turn, repairs, interrupted)
        self._appended(turn, repairs)
        turn.run_stored = True

    async def _start(
        self, turn: Turn, repairs: Sequence[Message], interrupted: Sequence[str]
    ) -> None:
        assert turn.session_id is not None
        session_id = turn.session_id
        fence = self._ownership.fence_params(session_id)
        writer = self._writer

        def body(conn: Connection) -> None:
            now = utcnow()
            if not writer.owned(conn, fence):
                raise SessionConflict(session_id)
            self._advance(conn, turn, repairs, now=now, touch=True)
            for run_id in interrupted:
                values = {"status": RunStatus.INTERRUPTED.value, "finished_at": now}
                writer.update_run(conn, run_id, values)
            if turn.run_stored:  # a continued turn runs again
                values = {"status": RunStatus.RUNNING.value, "finished_at": None}
                writer.update_run(conn, turn.run_id, values)
            else:
                writer.insert_run(conn, self._new_run(turn))

        await self._transact(turn, body)
        turn.stored_progress = turn.progress()

    async def record_step(self, turn: Turn, assistant: Message) -> None:
        assistant.run_id = turn.run_id
        self._failpoints.reach("before-write-1")
        with self._metrics.write("write1"):
            await self._append(turn, [assistant], store_user=True)
        self._failpoints.reach("after-write-1")

    def check_owned(self, turn: Turn) -> None:
        assert turn.session_id is not None
        self._ownership.check(turn.session_id)

    async def record_results(self, turn: Turn, results: Sequence[Message]) -> None:
        for message in results:
            message.run_id = turn.run_id
        self._failpoints.reach("after-handlers")
        with self._metrics.write("write2"):
            await self._append(turn, results, store_user=True, failpoint="in-write-2")
        self._failpoints.reach("after-write-2")

    async def record_end(self, turn: Turn, final: Message | None, end: RunEnd) -> None:
        values = {
            **turn.run_values(),
            "status": end.status.value,
            "response": end.response,
            "error_type": end.error_type,
            "error_message": end.error_message,
            "finished_at": turn.finished_at,
        }
        if final is not None:
            final.run_id = turn.run_id
        self._failpoints.reach("before-final-write")
        # A model failure before any write leaves the history as it was: no user message.
        batch = [final] if final is not None else []
        with self._metrics.write("final"):
            await self._append(turn, batch, store_user=final is not None, run_values=values)

    async def _append(
        self,
        turn: Turn,
        messages: Sequence[Message],
        *,
        store_user: bool,
        run_values: dict[str, Any] | None = None,
        failpoint: str | None = None,
    ) -> None:
        """Append messages (after the user message, if due) and bring the run up to date."""
        assert turn.session_id is not None
        batch = list(messages)
        with_user = store_user and not turn.user_stored
        if with_user:
            turn.user_message.run_id = turn.run_id
            batch.insert(0, turn.user_message)
        progress = turn.progress()
        writer = self._writer

        def body(conn: Connection) -> None:
            self._advance(conn, turn, batch, now=utcnow(), touch=run_values is not None)
            if run_values is not None:
                writer.update_run(conn, turn.run_id, run_values)
            elif progress != turn.stored_progress:  # write #2 usually has nothing new
                iterations, input_tokens, output_tokens = progress
                writer.progress(
                    conn,
                    turn.run_id,
                    iterations=iterations,
                    input_tokens=input_tokens,
                    output_tokens=output_tokens,
                )
            if failpoint is not None and self._failpoints.armed:
                self._failpoints.reach(failpoint)  # the rows are sent, the commit is not

        await self._transact(turn, body)
        self._appended(turn, batch)
        turn.stored_progress = progress
        turn.user_stored = turn.user_stored or with_user

    def _advance(
        self,
        conn: Connection,
        turn: Turn,
        batch: Sequence[Message],
        *,
        now: datetime,
        touch: bool,
    ) -> None:
        """Number the batch after the stored history, claim those seqs, insert the rows."""
        assert turn.session_id is not None
        for offset, message in enumerate(batch, start=1):
            message.seq = turn.stored_count + offset
        new_count = turn.stored_count + len(batch)
        if not turn.session_exists:
            self._writer.create_session(
                conn,
                {
                    "id": turn.session_id,
                    "agent": turn.agent,
                    "tenant_id": turn.tenant_id,
                    "user_id": turn.user_id,
                    "metadata": turn.session_metadata,
                    "message_count": new_count,
                    "created_at": now,
                    "updated_at": now,
                },
            )
        elif not self._writer.advance(
            conn,
            turn.session_id,
            expected=turn.stored_count,
            new=new_count,
            touch=now if touch else None,
            fence=self._ownership.fence_params(turn.session_id),
        ):
            raise SessionConflict(turn.session_id)
        self._writer.add_messages(conn, turn.session_id, batch, now)

    @staticmethod
    def _appended(turn: Turn, batch: Sequence[Message]) -> None:
        turn.stored_count += len(batch)
        turn.session_exists = True

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

    async def _transact(self, turn: Turn, body: Callable[[Connection], None]) -> None:
        """One transaction; losing a race for the session's next seq is a SessionConflict."""
        try:
            await self._writes.transact(body)
        except IntegrityError as exc:
            raise SessionConflict(turn.session_id or "") from exc
