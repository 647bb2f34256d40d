"""The service-layer bench: the real RunService on the given database, no HTTP.

Built as the app's lifespan builds it (Database.connect, the agents file, build_ownership),
with the scenario's python tools and its scripted model; sessions go through
`RunService.create`, stateless without a session_id, durable with a fresh one each.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import statistics
import time
import uuid
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Any

from sqlalchemy import Column, Integer, MetaData, Table, Text, event, insert, text
from sqlalchemy.engine import make_url

from app.bench.report import (
    CommitFloor,
    LongSession,
    ServiceFigures,
    Sessions,
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
    messages_per_session,
)
from app.db.session import Database
from app.failpoints import Failpoints
from app.llm.scripted import ScriptedLLMClient
from app.main import build_ownership
from app.metrics import Metrics
from app.schemas.runs import RunCreate, RunRead
from app.services.ownership import Ownership
from app.services.runner import AgentRunner
from app.services.runs import RunService
from app.settings import Settings
from app.tools.registry import ToolRegistry, parse_registry

FLOOR_TABLE = Table(
    "bench_commit_floor",
    MetaData(),
    Column("id", Integer, primary_key=True),
    Column("payload", Text, nullable=False),
)
WRITES = ("INSERT", "UPDATE", "DELETE")


def check_run(run: RunRead, steps: int) -> None:
    """Fail loudly unless the run went through the whole scenario."""
    expected = messages_per_session(steps)
    if run.status.value != "complete" or run.response != FINAL_TEXT:
        raise BenchError(f"run {run.run_id} ended {run.status.value}: {run.error}")
    if len(run.messages) != expected:
        raise BenchError(f"run {run.run_id} has {len(run.messages)} messages, not {expected}")


@dataclass
class Rig:
    """The RunService under test, and how many post_slack calls its sessions should make."""

    db: Database
    service: RunService
    ownership: Ownership
    registry: ToolRegistry
    long_model: BenchModel
    expected_effects: int = 0

    @classmethod
    async def open(cls, database_url: str, options: BenchOptions) -> Rig:
        """Build the service as the app's lifespan does."""
        settings = Settings(database_url=database_url)
        db = await Database.connect(database_url, pool_size=settings.database_pool_size)
        agents = {
            AGENT: (f"scripted:{AGENT}", options.steps),
            LONG_AGENT: (f"scripted:{LONG_AGENT}", options.long_steps),
        }
        registry = parse_registry(agents_yaml(agents), label="bench scenario")
        long_model = BenchModel(options.long_steps)
        llm = ScriptedLLMClient(scripts={AGENT: BenchModel(options.steps), LONG_AGENT: long_model})
        metrics = Metrics()
        ownership = build_ownership(db, settings)
        await ownership.start()
        runner = AgentRunner(llm=llm, registry=registry, metrics=metrics)
        service = RunService(
            db.sessions, db.durable, registry, runner, Failpoints.parse(None), ownership, metrics
        )
        return cls(db, service, ownership, registry, long_model)

    async def close(self) -> None:
        """Release connections."""
        await self.ownership.stop()
        await self.registry.aclose()
        await self.db.dispose()

    async def session(
        self, *, durable: bool, steps: int, agent: str = AGENT
    ) -> tuple[float, float]:
        """Run one session of the scenario; its wall time and this process's CPU time, in ms."""
        session_id = f"bench-{uuid.uuid4().hex}" if durable else None
        body = RunCreate(agent=agent, message=USER_MESSAGE, session_id=session_id)
        start, cpu = time.perf_counter(), time.process_time()
        result = await self.service.create(body, tenant_id=None)
        elapsed = (time.perf_counter() - start) * 1000, (time.process_time() - cpu) * 1000
        check_run(result.run, steps)
        self.expected_effects += steps
        return elapsed


async def time_sessions(rig: Rig, options: BenchOptions) -> Sessions:
    """Stateless and durable sessions, interleaved so drift hits both alike."""
    stateless: list[tuple[float, float]] = []
    durable: list[tuple[float, float]] = []
    for index in range(options.warmup + options.sessions):
        a = await rig.session(durable=False, steps=options.steps)
        b = await rig.session(durable=True, steps=options.steps)
        if index >= options.warmup:
            stateless.append(a)
            durable.append(b)
    wall = sessions_of([a for a, _ in stateless], [b for b, _ in durable], options.steps)
    cpu = sessions_of([a for _, a in stateless], [b for _, b in durable], options.steps)
    return replace(
        wall,
        stateless_cpu_ms=cpu.stateless_ms,
        durable_cpu_ms=cpu.durable_ms,
        overhead_cpu_ms_per_step=cpu.overhead_ms_per_step,
    )


def sessions_of(stateless: list[float], durable: list[float], steps: int) -> Sessions:
    """Summaries of both kinds and the durable overhead per step."""
    a, b = Stats.of(stateless), Stats.of(durable)
    return Sessions(a, b, (b.median - a.median) / steps)


@dataclass
class TransactionCounter:
    """Counts COMMITs, writing transactions, statements and pool checkouts on an engine."""

    db: Database
    commits: int = 0
    writing: int = 0
    statements: int = 0
    checkouts: int = 0
    _dirty: set[int] = field(default_factory=set)

    def _on_commit(self, conn: Any) -> None:
        self.commits += 1
        if id(conn) in self._dirty:
            self.writing += 1
            self._dirty.discard(id(conn))

    def _on_rollback(self, conn: Any) -> None:
        self._dirty.discard(id(conn))

    def _on_execute(self, conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        verb = statement.lstrip()[:6].upper()
        if verb.startswith("BEGIN"):
            return
        self.statements += 1
        if verb in WRITES:
            self._dirty.add(id(conn))

    def _on_checkout(self, *args: Any) -> None:
        self.checkouts += 1

    def _listeners(self) -> list[tuple[Any, str, Any]]:
        engine = self.db.engine.sync_engine
        return [
            (engine, "commit", self._on_commit),
            (engine, "rollback", self._on_rollback),
            (engine, "before_cursor_execute", self._on_execute),
            (engine.pool, "checkout", self._on_checkout),
        ]

    def __enter__(self) -> TransactionCounter:
        for target, name, fn in self._listeners():
            event.listen(target, name, fn)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for target, name, fn in self._listeners():
            event.remove(target, name, fn)

    def result(self) -> Transactions:
        return Transactions(
            self.commits, self.writing, self.commits - self.writing, self.statements, self.checkouts
        )


async def count_transactions(rig: Rig, steps: int) -> Transactions:
    """What one durable session asks of the database."""
    with TransactionCounter(rig.db) as counter:
        await rig.session(durable=True, steps=steps)
    return counter.result()


async def throughput(rig: Rig, options: BenchOptions) -> Throughput:
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


async def long_session(rig: Rig, database_url: str, steps: int) -> LongSession:
    """One durable session of `steps` steps: per-step times early and late, bytes stored."""
    before = await stored_bytes(rig.db, database_url)
    model = rig.long_model
    model.calls.clear()
    model.recording = True
    try:
        await rig.session(durable=True, steps=steps, agent=LONG_AGENT)
    finally:
        model.recording = False
    after = await stored_bytes(rig.db, database_url)
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


async def stored_bytes(db: Database, database_url: str) -> int:
    """SQLite: the file's size after a WAL checkpoint; PostgreSQL: the scenario tables' size."""
    if db.dialect == "sqlite":
        path = make_url(database_url).database
        assert path is not None
        return await asyncio.to_thread(_checkpointed_size, path)
    async with db.engine.connect() as conn:
        size = await conn.scalar(
            text(
                "SELECT pg_total_relation_size('\"session\"') + pg_total_relation_size('run')"
                " + pg_total_relation_size('message')"
            )
        )
    return int(size or 0)


def _checkpointed_size(path: str) -> int:
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        for _ in range(50):
            busy, _log, _done = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            if not busy:
                break
            time.sleep(0.01)
        else:
            raise BenchError("could not checkpoint the SQLite WAL to measure the file")
    finally:
        conn.close()
    return os.path.getsize(path)


async def commit_floor(db: Database, options: BenchOptions) -> Stats:
    """2 x steps + 1 bare INSERT+COMMIT transactions through the same engine, in ms."""
    engine = db.engine
    async with engine.begin() as conn:
        await conn.run_sync(FLOOR_TABLE.create, checkfirst=True)
    times: list[float] = []
    try:
        for index in range(options.warmup + max(30, options.sessions)):
            start = time.perf_counter()
            for _ in range(2 * options.steps + 1):
                async with engine.begin() as conn:
                    await conn.execute(insert(FLOOR_TABLE).values(payload=USER_MESSAGE))
            if index >= options.warmup:
                times.append((time.perf_counter() - start) * 1000)
    finally:
        async with engine.begin() as conn:
            await conn.run_sync(FLOOR_TABLE.drop, checkfirst=True)
    return Stats.of(times)


async def database_version(db: Database) -> str:
    """The server's version (SQLite: the library's)."""
    if db.dialect == "sqlite":
        return sqlite3.sqlite_version
    async with db.engine.connect() as conn:
        return str(await conn.scalar(text("SELECT current_setting('server_version')")))


def check_side_effects(expected: int) -> None:
    """Fail loudly unless post_slack ran `expected` times, each call exactly once."""
    repeated = SLACK.repeated
    if SLACK.total != expected or repeated:
        raise BenchError(
            f"post_slack ran {SLACK.total} times for {expected} expected calls;"
            f" calls that ran more than once: {len(repeated)}"
        )


async def measure_service(database_url: str, options: BenchOptions) -> tuple[ServiceFigures, str]:
    """Every service-layer figure, and the database's version."""
    SLACK.reset()
    rig = await Rig.open(database_url, options)
    try:
        sessions = await time_sessions(rig, options)
        transactions = await count_transactions(rig, options.steps)
        rate = await throughput(rig, options)
        long = await long_session(rig, database_url, options.long_steps)
        floor = await commit_floor(rig.db, options)
        version = await database_version(rig.db)
    finally:
        await rig.close()
    check_side_effects(rig.expected_effects)
    overhead = sessions.overhead_ms_per_step * options.steps
    figures = ServiceFigures(
        sessions=sessions,
        transactions=transactions,
        throughput=rate,
        long_session=long,
        commit_floor=CommitFloor(2 * options.steps + 1, floor, overhead / floor.median),
        side_effects=rig.expected_effects,
    )
    return figures, version
