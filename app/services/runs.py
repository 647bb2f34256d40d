"""Creating and reading runs: ownership, idempotency, session checks, resume, the runner."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field

from sqlalchemy.ext.asyncio import AsyncSession

from app import logs
from app.db import models
from app.db.journal import journal_store
from app.db.outages import read_again_if_disconnected
from app.db.repositories import (
    MessageRepository,
    RunRepository,
    SessionRepository,
    row_to_message,
)
from app.db.session import Database
from app.domain import Message, Role, RunStatus, Usage
from app.errors import (
    IdempotencyKeyReused,
    MemoryStoreNotDurable,
    RunNotFound,
    SessionAgentMismatch,
    SessionBusy,
    SessionConflict,
    SessionDeleted,
    SessionHoldLost,
    ValidationFailed,
)
from app.failpoints import Failpoints
from app.metrics import Metrics
from app.schemas.runs import MessageRead, RunCreate, RunErrorRead, RunRead, UsageRead
from app.services.access import active_run, check_session_access, read_runs_owned, run_summary
from app.services.idempotency import fingerprint
from app.services.journal import DurableJournal, StatelessJournal, Turn
from app.services.ownership import ActiveRuns, Ownership
from app.services.runner import AgentRunner, RunOutcome
from app.tools.registry import ToolRegistry

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunResult:
    """The API's answer to a turn, and whether it is a stored one given again (a replay)."""

    run: RunRead
    replayed: bool = False


@dataclass
class RunService:
    """The unit of work behind POST /v1/runs and GET /v1/runs/{id}."""

    db: Database
    registry: ToolRegistry
    runner: AgentRunner
    failpoints: Failpoints
    ownership: Ownership
    metrics: Metrics

    def __post_init__(self) -> None:
        self.store = journal_store(self.db, fence_sql=self.ownership.fence_sql)

    async def settle(self) -> None:
        """At shutdown, before the database, the ownership and the tools' clients close: wait
        for the turns cut off, which finish the tool-call step they are in (AgentRunner) and
        then give their session back."""
        await self.runner.settle()
        await self.ownership.active.given_back()

    async def create(
        self, body: RunCreate, *, tenant_id: str | None, idempotency_key: str | None = None
    ) -> RunResult:
        """Run one turn (or replay / continue the turn named by the key) and answer at its end."""
        start = time.perf_counter()
        logs.bind(session_id=body.session_id, agent=body.agent)
        try:
            result = await self._create(body, tenant_id=tenant_id, idempotency_key=idempotency_key)
        except SessionBusy as exc:
            if not isinstance(exc, SessionConflict):
                self.metrics.session_busy.inc()
            raise
        if not result.replayed:
            self.metrics.runs.labels(body.agent, result.run.status.value).inc()
            self.metrics.run_duration.labels(body.agent).observe(time.perf_counter() - start)
        return result

    async def _create(
        self, body: RunCreate, *, tenant_id: str | None, idempotency_key: str | None
    ) -> RunResult:
        agent = self.registry.agent(body.agent)
        if body.session_id is None:
            if idempotency_key is not None:
                raise ValidationFailed(
                    "Idempotency-Key names a turn of a session; send a session_id with it."
                )
            turn = self._turn(body, tenant_id=tenant_id, key=None)
            logs.bind(run_id=turn.run_id)
            return RunResult(
                self._outcome_read(
                    await self.runner.run(turn, journal=StatelessJournal(), history=[], agent=agent)
                )
            )
        if not self.db.durable:
            raise MemoryStoreNotDurable()
        turn = self._turn(body, tenant_id=tenant_id, key=idempotency_key)
        if idempotency_key is not None or self.ownership.shared:
            # Asked before the session is held: held, it refuses the turns other replicas
            # are asked to run meanwhile, so a caller with no right to the session (another
            # tenant's, another user's) must not hold it, and a keyed turn whose record is
            # its answer (the record never changes once it is) is answered without holding
            # it. (In one process a turn waits for a hold that runs no turn.)
            earlier = await self._precheck(turn, body=body)
            if earlier is not None:
                return await self._replay(earlier, turn=turn)
        deadline = time.monotonic() + ActiveRuns.SETTLE_WAIT_S
        try:
            while True:
                async with AsyncExitStack() as stack:
                    try:
                        await stack.enter_async_context(self.ownership.hold(body.session_id))
                    except SessionBusy as busy:
                        refused = await self._refuse(
                            busy, turn=turn, body=body, retry_until=deadline
                        )
                        if refused is None:  # the holder left without running a turn
                            continue
                        return refused
                    return await _answer(await self._run_owned(turn, body=body), held=stack)
        except SessionConflict as lost:
            if await self._deleted_under(turn):
                raise SessionDeleted(body.session_id) from lost
            if await self._hold_ended_untaken(turn):
                raise SessionHoldLost(body.session_id) from lost
            # Another runner took the session over: name its run.
            raise SessionConflict(
                body.session_id, active_run_id=await self._active_run(lost, turn=turn)
            ) from lost

    async def _refuse(
        self, busy: SessionBusy, *, turn: Turn, body: RunCreate, retry_until: float
    ) -> RunResult | None:
        """The session is busy: answer as if it were not for what does not depend on that
        (404/403 to other tenants and users, 409 agent mismatch, 422 key reuse, the replay of
        a keyed turn that will not run again); otherwise 409 naming the run that holds it.
        None: nobody ran a turn on it after all (another replica held it to refuse or replay
        a request), so try again, until `retry_until`."""
        assert body.session_id is not None
        earlier = await self._precheck(turn, body=body)
        if earlier is not None:  # a keyed turn that will not run again: its record
            return await self._replay(earlier, turn=turn)
        active = await self._active_run(busy, turn=turn)
        if active is None and time.monotonic() < retry_until:
            return None
        raise SessionBusy(body.session_id, active_run_id=active)

    async def _replay(self, earlier: models.Run, *, turn: Turn) -> RunResult:
        """The stored answer of the keyed run `earlier`, logged under its id (not the one this
        request would have used)."""
        logs.bind(run_id=earlier.id)
        replay = await self.get(earlier.id, tenant_id=turn.tenant_id, user_id=turn.user_id)
        return RunResult(replay, replayed=True)

    @read_again_if_disconnected
    async def _deleted_under(self, turn: Turn) -> bool:
        """Whether the session this turn had stored to, or found, is gone: a runner that took
        it over deleted it."""
        if not turn.session_exists:
            return False
        assert turn.session_id is not None
        async with self.db.reads.begin() as session:
            return await SessionRepository(session).get(turn.session_id) is None

    @read_again_if_disconnected
    async def _hold_ended_untaken(self, turn: Turn) -> bool:
        """Whether this replica lost the session with no other runner taking it: its hold
        ended with its connection to the database (a restart of it, a backend ended), not
        with a second request. Nobody holds the session, and this turn's run still shows
        the status the turn last stored or read (`running`; `interrupted` for a continued
        turn before its start record: a runner that took over would have ended or continued
        it), or was never stored (the hold ended before the turn's start record)."""
        assert turn.session_id is not None
        if await self.ownership.is_held(turn.session_id):
            return False
        async with self.db.reads.begin() as session:
            run = await RunRepository(session).get(turn.run_id)
        return run is None or run.status == turn.stored_status

    async def _active_run(self, busy: SessionBusy, *, turn: Turn) -> str | None:
        assert turn.session_id is not None
        return await active_run(
            self.db,
            ownership=self.ownership,
            busy=busy,
            session_id=turn.session_id,
            since=turn.created_at,
        )

    async def _run_owned(self, turn: Turn, *, body: RunCreate) -> RunResult:
        logs.bind(run_id=turn.run_id)
        agent = self.registry.agent(body.agent)
        stored = await self._load(turn, body=body)
        history, earlier = stored.history, stored.earlier
        if earlier is not None:
            if not stored.goes_on:
                return await self._replay(earlier, turn=turn)
            self._continue(turn, earlier=earlier, history=history)
            logs.bind(run_id=turn.run_id)
        journal = DurableJournal(
            self.store, failpoints=self.failpoints, ownership=self.ownership, metrics=self.metrics
        )
        # The run is stored, and the dead runs end, before any repair re-runs a tool (which
        # may take a while): meanwhile a 409 names this run, and no dead run looks alive.
        interrupted = [r for r in stored.left_running if r != turn.run_id]
        await journal.record_start(turn, interrupted=interrupted)
        if interrupted:  # their runners died: this is where they end
            self.metrics.runs.labels(body.agent, RunStatus.INTERRUPTED.value).inc(len(interrupted))
        assert turn.session_id is not None
        self.ownership.active.confirm(turn.session_id, run_id=turn.run_id)
        history.extend(
            await self.runner.repair(turn, journal=journal, history=history, agent=agent)
        )
        if earlier is not None:
            turn.messages = [m for m in history if m.run_id == turn.run_id]
        return RunResult(
            self._outcome_read(
                await self.runner.run(turn, journal=journal, history=history, agent=agent)
            )
        )

    def _turn(self, body: RunCreate, *, tenant_id: str | None, key: str | None) -> Turn:
        return Turn(
            run_id=str(uuid.uuid4()),
            agent=body.agent,
            user_message=Message.user(body.message),
            session_id=body.session_id,
            tenant_id=tenant_id,
            user_id=body.user_id,
            session_metadata=dict(body.metadata or {}),
            run_metadata=dict(body.metadata or {}),
            idempotency_key=key,
            fingerprint=fingerprint(body) if key is not None else None,
        )

    async def replay_recorded(
        self, body: RunCreate, *, tenant_id: str | None, idempotency_key: str | None
    ) -> RunResult | None:
        """The stored answer of the keyed turn this request names, if its record is its
        answer (it will not run again): a replica that takes no new runs (shutting down)
        still answers those."""
        if body.session_id is None or idempotency_key is None or not self.db.durable:
            return None
        turn = self._turn(body, tenant_id=tenant_id, key=idempotency_key)
        earlier = await self._precheck(turn, body=body)
        return None if earlier is None else await self._replay(earlier, turn=turn)

    @read_again_if_disconnected
    async def _precheck(self, turn: Turn, *, body: RunCreate) -> models.Run | None:
        """May the caller use the session? The run an earlier request with this key started,
        if it will not run again (its record is the answer; see `_goes_on`)."""
        async with self.db.reads.begin() as session:
            row = await self._usable_session(session, turn=turn, body=body)
            if row is None:
                return None
            earlier = await self._keyed(
                RunRepository(session), session_id=row.id, turn=turn, body=body
            )
            if earlier is None or await _goes_on(
                MessageRepository(session), session_key=row.key, earlier=earlier
            ):
                return None
            return earlier

    @staticmethod
    async def _usable_session(
        session: AsyncSession, *, turn: Turn, body: RunCreate
    ) -> models.Session | None:
        """The session this turn names, once the caller may run a turn of this agent on it."""
        assert body.session_id is not None
        row = await SessionRepository(session).get(body.session_id)
        if row is not None:
            check_session_access(row, tenant_id=turn.tenant_id, user_id=body.user_id, for_turn=True)
            if row.agent != body.agent:
                raise SessionAgentMismatch(row.id, bound=row.agent, requested=body.agent)
        return row

    @staticmethod
    async def _keyed(
        runs: RunRepository, *, session_id: str, turn: Turn, body: RunCreate
    ) -> models.Run | None:
        """The run an earlier request with this turn's key started; another body is refused."""
        if turn.idempotency_key is None:
            return None
        run = await runs.by_idempotency_key(session_id, key=turn.idempotency_key)
        if run is None or run.request_fingerprint == turn.fingerprint:
            return run
        if run.request_fingerprint != fingerprint(body, floats_as_sent=True):
            raise IdempotencyKeyReused(turn.idempotency_key)
        return run

    @read_again_if_disconnected
    async def _load(self, turn: Turn, *, body: RunCreate) -> _Stored:
        """Check the caller may use the session; what it holds for this turn."""
        async with self.db.reads.begin() as session:
            row = await self._usable_session(session, turn=turn, body=body)
            if row is None:
                return _Stored()
            turn.session_exists = True
            turn.stored_count = row.message_count
            runs, messages = RunRepository(session), MessageRepository(session)
            earlier = await self._keyed(runs, session_id=row.id, turn=turn, body=body)
            return _Stored(
                history=await messages.history(row.key),
                left_running=await runs.running_ids(row.id),
                earlier=earlier,
                goes_on=earlier is not None
                and await _goes_on(messages, session_key=row.key, earlier=earlier),
            )

    @staticmethod
    def _continue(turn: Turn, *, earlier: models.Run, history: list[Message]) -> None:
        """Pick an interrupted turn up where it stopped, under its own run_id."""
        turn.run_id = earlier.id
        turn.stored_status = earlier.status  # `interrupted`, or `running` if no turn found it
        turn.created_at = earlier.created_at
        turn.run_metadata = earlier.metadata_ or {}
        turn.iterations = earlier.iterations
        turn.usage = Usage(earlier.input_tokens, earlier.output_tokens)
        turn.user_stored = any(m.run_id == earlier.id and m.role is Role.USER for m in history)

    @read_again_if_disconnected
    async def get(
        self, run_id: str, *, tenant_id: str | None, user_id: str | None = None
    ) -> RunRead:
        """A stored run with its messages; stateless runs are never stored."""

        async def read() -> tuple[models.Run, Sequence[models.Message]]:
            async with self.db.reads.begin() as session:
                run = await RunRepository(session).get(run_id)
                owner = await SessionRepository(session).get(run.session_id) if run else None
                if run is None or owner is None or owner.tenant_id != tenant_id:
                    raise RunNotFound(run_id)
                check_session_access(owner, tenant_id=tenant_id, user_id=user_id, for_turn=False)
                return run, await MessageRepository(session).for_run(owner.key, run_id=run_id)

        (run, rows), ownerless = await read_runs_owned(
            self.ownership, read=read, runs_of=lambda stored: [stored[0]]
        )
        summary = run_summary(run, ownerless=run.id in ownerless)
        messages = [MessageRead.of(row_to_message(r)) for r in rows]
        return RunRead(**dict(summary), messages=messages)

    @staticmethod
    def _outcome_read(outcome: RunOutcome) -> RunRead:
        turn, end = outcome.turn, outcome.end
        return RunRead(
            run_id=turn.run_id,
            session_id=turn.session_id,
            agent=turn.agent,
            status=end.status,
            response=end.response,
            iterations=turn.iterations,
            messages=[MessageRead.of(m) for m in turn.messages],
            usage=UsageRead(
                input_tokens=turn.usage.input_tokens, output_tokens=turn.usage.output_tokens
            ),
            error=RunErrorRead.of(end.error_type, message=end.error_message),
            stop_reason=turn.stop_reason,
            metadata=turn.run_metadata,
            created_at=turn.created_at,
            finished_at=turn.finished_at,
        )


@dataclass
class _Stored:
    """What a session holds for a turn about to run on it (empty for a new session)."""

    history: list[Message] = field(default_factory=list)
    left_running: list[str] = field(default_factory=list)  # runs whose runner died
    earlier: models.Run | None = None  # the run an earlier request with this key started
    goes_on: bool = False  # whether `earlier` is continued (see `_goes_on`)


async def _goes_on(messages: MessageRepository, *, session_key: int, earlier: models.Run) -> bool:
    """Whether the keyed turn `earlier`, found again, is continued rather than answered from
    its record: one still stored `running` (its runner died, no turn has started since), or
    one a later turn's start stored `interrupted` (the database's order, not the replicas'
    clocks) while no message of another run follows its own: it then goes on where it
    stopped (a later turn's repair of its calls is its own; one that stored nothing simply
    runs after the later turn). Once another run's message follows its own (overtaken), the
    rest of it would be stored after that run's: its record is the answer, as a finished
    turn's is, and no longer changes."""
    if earlier.status == RunStatus.RUNNING.value:
        return True
    return earlier.status == RunStatus.INTERRUPTED.value and not await messages.overtaken(
        session_key, run_id=earlier.id
    )


async def _answer(result: RunResult, *, held: AsyncExitStack) -> RunResult:
    """Release the session and answer the turn, which is stored by now. Shutdown may cancel
    the release (on PostgreSQL a round trip): the answer stands all the same, since a 503
    "cut off before the run finished" would have its client run the finished turn again."""
    try:
        await held.aclose()
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is None or task.cancelling() > 1:
            raise  # cancelled more than once: not ours to swallow
        task.uncancel()
    return result
