"""Creating and reading runs: session checks, resume, then the runner."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.db import models
from app.db.repositories import MessageRepository, RunRepository, SessionRepository, row_to_message
from app.domain import Message, RunStatus
from app.errors import (
    MemoryStoreNotDurable,
    RunNotFound,
    SessionAccessDenied,
    SessionAgentMismatch,
    SessionBusy,
    SessionNotFound,
)
from app.failpoints import Failpoints
from app.schemas.runs import MessageRead, RunCreate, RunErrorRead, RunRead, RunSummary, UsageRead
from app.services.journal import DurableJournal, Journal, Turn
from app.services.runner import AgentRunner, RunOutcome
from app.tools.registry import ToolRegistry

log = logging.getLogger(__name__)


class ActiveRuns:
    """The sessions this process is running a turn on, so a second request is refused early."""

    def __init__(self) -> None:
        self._runs: dict[str, str] = {}

    def claim(self, session_id: str, run_id: str) -> None:
        """Take the session for `run_id`, or raise SessionBusy."""
        active = self._runs.get(session_id)
        if active is not None:
            raise SessionBusy(session_id, active)
        self._runs[session_id] = run_id

    def release(self, session_id: str) -> None:
        """Give the session back."""
        self._runs.pop(session_id, None)

    def active_run(self, session_id: str) -> str | None:
        """The run in progress on the session here, if any."""
        return self._runs.get(session_id)


def check_session_access(
    row: models.Session, *, tenant_id: str | None, user_id: str | None
) -> None:
    """Another tenant's session does not exist for the caller; another user's is forbidden."""
    if row.tenant_id != tenant_id:
        raise SessionNotFound(row.id)
    if row.user_id is not None and row.user_id != user_id:
        raise SessionAccessDenied(row.id)


@dataclass
class RunService:
    """The unit of work behind POST /v1/runs and GET /v1/runs/{id}."""

    sessions: async_sessionmaker[AsyncSession]
    durable: bool
    registry: ToolRegistry
    runner: AgentRunner
    failpoints: Failpoints
    active: ActiveRuns

    async def create(self, body: RunCreate, *, tenant_id: str | None) -> RunRead:
        """Run one turn and answer when it ends."""
        agent = self.registry.agent(body.agent)
        if body.session_id is not None and not self.durable:
            raise MemoryStoreNotDurable()
        turn = Turn(
            run_id=str(uuid.uuid4()),
            agent=agent.name,
            user_message=Message.user(body.message),
            session_id=body.session_id,
            tenant_id=tenant_id,
            user_id=body.user_id,
            session_metadata=dict(body.metadata or {}),
            run_metadata=dict(body.metadata or {}),
        )
        if body.session_id is None:
            outcome = await self.runner.run(turn, Journal(), [], agent)
            return self._outcome_read(outcome)
        self.active.claim(body.session_id, turn.run_id)
        try:
            journal = DurableJournal(self.sessions, self.failpoints)
            history, unfinished = await self._load(turn, body)
            await self.runner.repair(turn, journal, history, agent, unfinished_runs=unfinished)
            outcome = await self.runner.run(turn, journal, history, agent)
        finally:
            self.active.release(body.session_id)
        return self._outcome_read(outcome)

    async def _load(self, turn: Turn, body: RunCreate) -> tuple[list[Message], list[str]]:
        """Check the caller may use the session; its history and unfinished runs."""
        assert body.session_id is not None
        async with self.sessions.begin() as session:
            row = await SessionRepository(session).get(body.session_id)
            if row is None:
                return [], []
            check_session_access(row, tenant_id=turn.tenant_id, user_id=body.user_id)
            if row.agent != body.agent:
                raise SessionAgentMismatch(row.id, row.agent, body.agent)
            turn.session_exists = True
            turn.stored_count = row.message_count
            history = await MessageRepository(session).history(row.id)
            unfinished = await RunRepository(session).unfinished(row.id)
        return history, unfinished

    async def get(self, run_id: str, *, tenant_id: str | None) -> RunRead:
        """A stored run with its messages; stateless runs are never stored."""
        async with self.sessions.begin() as session:
            run = await RunRepository(session).get(run_id)
            if run is None:
                raise RunNotFound(run_id)
            owner = await SessionRepository(session).get(run.session_id)
            if owner is None or owner.tenant_id != tenant_id:
                raise RunNotFound(run_id)
            rows = await MessageRepository(session).for_run(run_id)
        summary = run_summary(run)
        return RunRead(
            **summary.model_dump(exclude={"session_id"}),
            session_id=summary.session_id,
            messages=[MessageRead.of(row_to_message(r)) for r in rows],
        )

    @staticmethod
    def _outcome_read(outcome: RunOutcome) -> RunRead:
        turn, end = outcome.turn, outcome.end
        error = None
        if end.error_type is not None:
            error = RunErrorRead(type=end.error_type, message=end.error_message or "")
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
            error=error,
            metadata=turn.run_metadata,
            created_at=turn.created_at,
            finished_at=turn.finished_at,
        )


def run_summary(run: models.Run) -> RunSummary:
    """The API shape of a stored run, without messages."""
    error = None
    if run.error_type is not None:
        error = RunErrorRead(type=run.error_type, message=run.error_message or "")
    return RunSummary(
        run_id=run.id,
        session_id=run.session_id,
        agent=run.agent,
        status=RunStatus(run.status),
        response=run.response,
        iterations=run.iterations,
        usage=UsageRead(input_tokens=run.input_tokens, output_tokens=run.output_tokens),
        error=error,
        metadata=run.metadata_ or {},
        created_at=run.created_at,
        finished_at=run.finished_at,
    )
