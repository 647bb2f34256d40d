"""The service-layer bench: the real RunService on the given database, no HTTP.

Built as the app's lifespan builds it (main.open_services), with the scenario's python tools
and its scripted model; sessions go through `RunService.create`, stateless without a
session_id, durable with a fresh one each.
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace

from app.bench.database import (
    TransactionCounter,
    commit_floor,
    database_version,
    others_held,
    stored_bytes,
)
from app.bench.report import (
    CommitFloor,
    Crowded,
    LongSession,
    ServiceFigures,
    Sessions,
    SideEffectCount,
    Stats,
    Throughput,
    Transactions,
)
from app.bench.scenario import (
    AGENT,
    FINAL_TEXT,
    LONG_AGENT,
    SLACK,
    USER_MESSAGE,
    BenchError,
    BenchModel,
    BenchOptions,
    agents_yaml,
    durable_writes,
    messages_per_session,
)
from app.db.session import Database
from app.failpoints import Failpoints
from app.lifecycle import Lifecycle
from app.llm.scripted import PREFIX as SCRIPTED
from app.llm.scripted import ScriptedLLMClient
from app.main import open_services
from app.metrics import Metrics
from app.schemas.runs import RunCreate, RunRead
from app.services.runs import RunService
from app.settings import Settings
from app.tools.agents_file import parse_registry


def check_run(run: RunRead, *, steps: int) -> None:
    """Fail loudly unless the run went through the whole scenario."""
    expected = messages_per_session(steps)
    if run.status.value != "complete" or run.response != FINAL_TEXT:
        raise BenchError(f"run {run.run_id} ended {run.status.value}: {run.error}")
    if len(run.messages) != expected:
        raise BenchError(f"run {run.run_id} has {len(run.messages)} messages, not {expected}")


@dataclass
class Rig:
    """The RunService under test, and how many post_slack calls its sessions should make."""

    service: RunService
    long_model: BenchModel
    expected_effects: int = 0

    @property
    def db(self) -> Database:
        """The service's database."""
        return self.service.db

    @classmethod
    @asynccontextmanager
    async def open(cls, database_url: str, *, options: BenchOptions) -> AsyncIterator[Rig]:
        """The service as the app's lifespan builds it, with the scenario's agents and model."""
        agents = {
            AGENT: (f"{SCRIPTED}{AGENT}", options.steps),
            LONG_AGENT: (f"{SCRIPTED}{LONG_AGENT}", options.long_steps),
        }
        long_model = BenchModel(options.long_steps)
        async with open_services(
            Settings(database_url=database_url),
            registry=parse_registry(agents_yaml(agents), label="bench scenario"),
            failpoints=Failpoints.parse(None),
            llm=ScriptedLLMClient(
                scripts={AGENT: BenchModel(options.steps), LONG_AGENT: long_model}
            ),
            metrics=Metrics(),
            lifecycle=Lifecycle(),
        ) as services:
            yield cls(services.runs, long_model)

    async def session(
        self, *, durable: bool, steps: int, agent: str = AGENT
    ) -> tuple[float, float]:
        """Run one session of the scenario; its wall time and this process's CPU time, in ms."""
        session_id = f"bench-{uuid.uuid4().hex}" if durable else None
        body = RunCreate(agent=agent, message=USER_MESSAGE, session_id=session_id)
        start, cpu = time.perf_counter(), time.process_time()
        result = await self.service.create(body, tenant_id=None)
        elapsed = (time.perf_counter() - start) * 1000, (time.process_time() - cpu) * 1000
        check_run(result.run, steps=steps)
        self.expected_effects += steps
        return elapsed


async def time_sessions(rig: Rig, *, options: BenchOptions) -> Sessions:
    """Stateless and durable sessions, interleaved so drift hits both alike."""
    stateless: list[tuple[float, float]] = []
    durable: list[tuple[float, float]] = []
    for index in range(options.warmup + options.sessions):
        a = await rig.session(durable=False, steps=options.steps)
        b = await rig.session(durable=True, steps=options.steps)
        if index >= options.warmup:
            stateless.append(a)
            durable.append(b)
    wall = sessions_of(
        [a for a, _ in stateless], durable=[b for b, _ in durable], steps=options.steps
    )
    cpu = sessions_of(
        [a for _, a in stateless], durable=[b for _, b in durable], steps=options.steps
    )
    return replace(
        wall,
        stateless_cpu_ms=cpu.stateless_ms,
        durable_cpu_ms=cpu.durable_ms,
        overhead_cpu_ms_per_step=cpu.overhead_ms_per_step,
    )


def sessions_of(stateless: list[float], *, durable: list[float], steps: int) -> Sessions:
    """Summaries of both kinds and the durable overhead per step."""
    a, b = Stats.of(stateless), Stats.of(durable)
    return Sessions(a, b, (b.median - a.median) / steps)


async def count_transactions(rig: Rig, *, steps: int) -> Transactions:
    """What one durable session asks of the database."""
    with TransactionCounter(rig.db, rig.service.store, rig.service.ownership) as counter:
        await rig.session(durable=True, steps=steps)
    return counter.result()


async def throughput(rig: Rig, *, options: BenchOptions) -> Throughput:
    """Durable sessions per second with `concurrency` workers running sessions back to back."""

    async def worker(count: int) -> None:
        for _ in range(count):
            await rig.session(durable=True, steps=options.steps)

    workers = options.concurrency
    if options.warmup:  # fills the connection pool
        await asyncio.gather(*(worker(1) for _ in range(workers)))
    start = time.perf_counter()
    await asyncio.gather(*(worker(options.per_worker) for _ in range(workers)))
    seconds = time.perf_counter() - start
    sessions = workers * options.per_worker
    return Throughput(workers, sessions, seconds, sessions / seconds)


async def long_session(rig: Rig, *, database_url: str, steps: int) -> LongSession:
    """One durable session of `steps` steps: per-step times early and late, bytes stored."""
    before = await stored_bytes(rig.db, database_url=database_url)
    model = rig.long_model
    model.calls.clear()
    model.recording = True
    try:
        await rig.session(durable=True, steps=steps, agent=LONG_AGENT)
    finally:
        model.recording = False
    after = await stored_bytes(rig.db, database_url=database_url)
    calls = model.calls
    # Step k is the service's work between the end of model call k and the start of call k+1.
    per_step = [(calls[k + 1][0] - calls[k][1]) * 1000 for k in range(steps)]
    window = min(10, steps)
    early = statistics.median(per_step[:window])
    late = statistics.median(per_step[-window:])
    stored = after - before
    return LongSession(
        steps, early, late, late / early, stored, stored / steps, messages_per_session(steps)
    )


# Sessions whose locks another connection holds for `crowded`: a few replicas' worth of
# running turns, well inside PostgreSQL's default lock table (64 x max_connections).
OTHER_SESSIONS = 1000


async def crowded(rig: Rig, *, database_url: str, options: BenchOptions) -> Crowded | None:
    """Durable sessions alone and with OTHER_SESSIONS other sessions' locks held meanwhile,
    interleaved (PostgreSQL; None on SQLite, where one process holds every session)."""
    if rig.db.dialect != "postgresql":
        return None
    alone: list[float] = []
    among: list[float] = []
    async with others_held(database_url, count=OTHER_SESSIONS) as hold:
        for index in range(options.warmup + options.sessions):
            ms_alone, _ = await rig.session(durable=True, steps=options.steps)
            await hold(True)
            try:
                ms_among, _ = await rig.session(durable=True, steps=options.steps)
            finally:
                await hold(False)
            if index >= options.warmup:
                alone.append(ms_alone)
                among.append(ms_among)
    a, b = Stats.of(alone), Stats.of(among)
    return Crowded(OTHER_SESSIONS, a, b, (b.median - a.median) / options.steps)


def check_side_effects(expected: int) -> SideEffectCount:
    """post_slack's count since SLACK was reset; fails loudly unless each of the `expected`
    calls ran exactly once."""
    count = SideEffectCount(expected, SLACK.total, len(SLACK.repeated))
    if not count.exactly_once:
        raise BenchError(
            f"post_slack ran {count.counted} times for {expected} expected calls;"
            f" calls that ran more than once: {count.repeated}"
        )
    return count


async def measure_service(
    database_url: str, *, options: BenchOptions
) -> tuple[ServiceFigures, str]:
    """Every service-layer figure, and the database's version."""
    SLACK.reset()
    async with Rig.open(database_url, options=options) as rig:
        sessions = await time_sessions(rig, options=options)
        transactions = await count_transactions(rig, steps=options.steps)
        # Before the concurrent sessions: PostgreSQL extends a table by many empty pages at
        # once when writers queue for it, and the long session's rows would fill those.
        long = await long_session(rig, database_url=database_url, steps=options.long_steps)
        rate = await throughput(rig, options=options)
        others = await crowded(rig, database_url=database_url, options=options)
        floor = await commit_floor(rig.db, store=rig.service.store, options=options)
        version = await database_version(rig.db)
    side_effects = check_side_effects(rig.expected_effects)
    overhead = sessions.overhead_ms_per_step * options.steps
    figures = ServiceFigures(
        sessions=sessions,
        transactions=transactions,
        throughput=rate,
        long_session=long,
        commit_floor=CommitFloor(durable_writes(options.steps), floor, overhead / floor.median),
        side_effects=side_effects,
        crowded=others,
    )
    return figures, version
