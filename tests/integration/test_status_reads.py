"""A status read while a turn ends: a session and its runs are read, then whether a runner holds
the session is asked. A turn that ended between the two looked dead: its complete run read
`interrupted` (which tells a client to send its turn again) and its session `needs_resume`."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass

import pytest

from app.db.session import Database
from app.domain import RunStatus, SessionStatus
from app.errors import SessionNotFound
from app.failpoints import Failpoints
from app.llm import scripted
from app.llm.scripted import ScriptedLLMClient
from app.main import build_ownership
from app.metrics import Metrics
from app.schemas.runs import RunCreate
from app.services.ownership import Ownership
from app.services.runner import AgentRunner
from app.services.runs import RunService
from app.services.sessions import SessionService
from app.settings import Settings
from app.tools.agents_file import load_registry


@dataclass
class Services:
    runs: RunService
    sessions: SessionService
    ownership: Ownership


@asynccontextmanager
async def services(database_url: str) -> AsyncIterator[Services]:
    """The run and session services on the example agents, as `serve` builds them."""
    db = await Database.connect(database_url, pool_size=3)
    ownership = build_ownership(db, settings=Settings(database_url=database_url))
    await ownership.start()
    registry = load_registry(None)
    metrics = Metrics()
    runner = AgentRunner(llm=ScriptedLLMClient(), registry=registry, metrics=metrics)
    try:
        yield Services(
            RunService(db, registry, runner, Failpoints.parse(None), ownership, metrics),
            SessionService(db, ownership, metrics),
            ownership,
        )
    finally:
        await ownership.stop()
        await registry.aclose()
        await db.dispose()


@pytest.fixture(autouse=True)
def emails_take_a_while(monkeypatch: pytest.MonkeyPatch) -> None:
    # "slow" in a support message makes its email take this long: the turn is then read in
    # the middle of its call, which waits for a result.
    monkeypatch.setattr(scripted, "SLOW_DELAY_S", 0.3)


async def turn_in_its_email_call(s: Services, session_id: str) -> tuple[asyncio.Task[object], str]:
    """A support turn on a new session, once its email call is stored and waits for a
    result; and its run's id."""
    body = RunCreate(agent="support", message="slow please: order A-1001?", session_id=session_id)
    turn: asyncio.Task[object] = asyncio.create_task(s.runs.create(body, tenant_id=None))
    deadline = time.monotonic() + 10
    while True:
        assert time.monotonic() < deadline and not turn.done()
        with contextlib.suppress(SessionNotFound):  # not stored yet
            page = await s.sessions.messages(
                session_id, tenant_id=None, user_id=None, after=None, limit=50
            )
            if any(c.name == "send_email" for m in page.data for c in m.tool_calls):
                return turn, page.data[-1].run_id or ""
        await asyncio.sleep(0.01)


@contextmanager
def asked_once_ended(s: Services, turn: asyncio.Task[object]) -> Iterator[None]:
    """In the block, a question whether a runner holds a session is answered only after
    `turn` ended: as if the turn had ended between the read and the question."""
    held_among: Callable[[Collection[str]], Awaitable[set[str]]] = s.ownership.held_among

    async def late_held_among(session_ids: Collection[str]) -> set[str]:
        await turn
        return await held_among(session_ids)

    async def late_is_held(session_id: str) -> bool:
        return session_id in await late_held_among([session_id])

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(s.ownership, "held_among", late_held_among)
        patch.setattr(s.ownership, "is_held", late_is_held)
        yield


async def test_a_run_whose_turn_ends_while_it_is_read_is_not_interrupted(
    database_url: str,
) -> None:
    async with services(database_url) as s:
        turn, run_id = await turn_in_its_email_call(s, "s-run")
        with asked_once_ended(s, turn):
            got = await s.runs.get(run_id, tenant_id=None)
        assert got.status is RunStatus.COMPLETE
        assert got.messages[-1].content == got.response  # as stored at its end

        turn, run_id = await turn_in_its_email_call(s, "s-runs")
        with asked_once_ended(s, turn):
            page = await s.sessions.runs(
                "s-runs", tenant_id=None, user_id=None, after=None, limit=5
            )
        assert [(r.run_id, r.status) for r in page.data] == [(run_id, RunStatus.COMPLETE)]


async def test_a_session_whose_turn_ends_while_it_is_read_is_idle_not_in_need_of_a_resume(
    database_url: str,
) -> None:
    async with services(database_url) as s:
        turn, _ = await turn_in_its_email_call(s, "s-one")
        with asked_once_ended(s, turn):
            got = await s.sessions.get("s-one", tenant_id=None, user_id=None)
        assert got.status is SessionStatus.IDLE

        turn, _ = await turn_in_its_email_call(s, "s-two")
        with asked_once_ended(s, turn):
            page = await s.sessions.list(
                tenant_id=None, agent=None, user_id=None, after=None, limit=10
            )
        assert {(r.id, r.status) for r in page.data} == {
            ("s-one", SessionStatus.IDLE),
            ("s-two", SessionStatus.IDLE),
        }
