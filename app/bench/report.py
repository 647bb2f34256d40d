"""The bench's figures, its targets, and how they are printed (a table, or JSON)."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from app.bench.scenario import durable_writes

# Targets of the standard scenario (the issue that defines `agent-runner bench`).
OVERHEAD_TARGET_MS = {"sqlite": 1.0, "postgresql": 1.5}
LATE_EARLY_TARGET = 1.2
BYTES_TARGET_PER_200_STEPS = 300_000
SESSIONS_PER_S_TARGET = 100.0  # at 16 concurrent sessions, on PostgreSQL
FLOOR_RATIO_TARGET = 1.3


@dataclass(frozen=True)
class Stats:
    """Summary of repeated timings, in milliseconds."""

    median: float
    p90: float
    minimum: float
    n: int

    @classmethod
    def of(cls, values: list[float]) -> Stats:
        """Median, 90th percentile and minimum of `values` (at least one)."""
        p90 = statistics.quantiles(values, n=10)[8] if len(values) > 1 else values[0]
        return cls(statistics.median(values), p90, min(values), len(values))


@dataclass(frozen=True)
class Sessions:
    """Whole sessions, stateless and durable; overhead = (durable - stateless) / steps.

    The `cpu` figures are this process's CPU time (all its threads), steadier than wall time
    on a busy machine; the HTTP bench has none (the work is in the server process).
    """

    stateless_ms: Stats
    durable_ms: Stats
    overhead_ms_per_step: float
    stateless_cpu_ms: Stats | None = None
    durable_cpu_ms: Stats | None = None
    overhead_cpu_ms_per_step: float | None = None


@dataclass(frozen=True)
class Transactions:
    """What one durable session asks of the database."""

    total: int  # COMMITs
    writing: int  # of which wrote something
    read_only: int
    statements: int  # excluding BEGIN / COMMIT
    checkouts: int  # connections taken from the pool
    lock_statements: int  # PostgreSQL: taking and releasing the session's advisory lock

    @property
    def including_locks(self) -> int:
        """Every transaction: the lock statements run in autocommit, each one of its own."""
        return self.total + self.lock_statements

    @property
    def described(self) -> str:
        """The count with its parts, as the targets table shows it."""
        text = f"{self.including_locks} ({self.writing} writing, {self.read_only} read"
        return text + (f", {self.lock_statements} lock)" if self.lock_statements else ")")


@dataclass(frozen=True)
class Throughput:
    concurrency: int
    sessions: int
    seconds: float
    sessions_per_s: float


@dataclass(frozen=True)
class LongSession:
    """One durable session of many steps: per-step service time between model calls."""

    steps: int
    early_ms_per_step: float  # median of steps 1-10
    late_ms_per_step: float  # median of the last 10 steps
    late_early_ratio: float
    bytes_stored: int
    bytes_per_step: float
    messages: int


@dataclass(frozen=True)
class Crowded:
    """Durable sessions with and without `others` sessions' locks held on the database (as
    other replicas' running turns hold them), interleaved; a step's cost should not grow
    with them."""

    others: int
    alone_ms: Stats
    crowded_ms: Stats
    ms_per_step: float  # (crowded - alone) / steps


@dataclass(frozen=True)
class CommitFloor:
    """`transactions` bare INSERT+COMMIT transactions; ratio = durable overhead / floor."""

    transactions: int
    ms: Stats
    ratio: float


@dataclass(frozen=True)
class SideEffectCount:
    """post_slack calls the sessions asked for, and how many ran as counted by the tool."""

    expected: int
    counted: int
    repeated: int  # calls that ran more than once

    @property
    def exactly_once(self) -> bool:
        """Every expected call ran, and none more than once."""
        return self.counted == self.expected and self.repeated == 0

    def __add__(self, other: SideEffectCount) -> SideEffectCount:
        return SideEffectCount(
            self.expected + other.expected,
            self.counted + other.counted,
            self.repeated + other.repeated,
        )

    def as_dict(self) -> dict[str, Any]:
        """The counts and the verdict, for --json."""
        return {**asdict(self), "exactly_once": self.exactly_once}


@dataclass(frozen=True)
class ServiceFigures:
    sessions: Sessions
    transactions: Transactions
    throughput: Throughput
    long_session: LongSession
    commit_floor: CommitFloor
    side_effects: SideEffectCount
    crowded: Crowded | None = None  # PostgreSQL only


@dataclass(frozen=True)
class HttpFigures:
    """Through a real `agent-runner serve`, the anthropic SDK and HTTP tools."""

    sessions: Sessions
    server_peak_rss_mb: float | None
    side_effects: SideEffectCount
    # The server's mean model call in each kind of timed session (see http.ModelCalls).
    model_call_ms_stateless: float
    model_call_ms_durable: float


@dataclass(frozen=True)
class Target:
    name: str
    target: str
    measured: str
    met: bool | None  # None: no target for this database


@dataclass
class Report:
    scenario: dict[str, Any]
    machine: dict[str, Any]
    service: ServiceFigures
    http: HttpFigures | None
    peak_rss_mb: float
    side_effects: dict[str, Any]
    targets: list[Target] = field(default_factory=list)

    def to_json(self) -> str:
        """The report as indented JSON."""
        return json.dumps(asdict(self), indent=2)


def _overhead_targets(report: Report) -> list[Target]:
    """The durable overhead per step against its store's target, through the service layer
    and (the same target) through a real server."""
    limit = OVERHEAD_TARGET_MS.get(report.machine["database"])
    overheads = [("durable overhead", report.service.sessions.overhead_ms_per_step)]
    if report.http is not None:
        overheads.append(("durable overhead, HTTP", report.http.sessions.overhead_ms_per_step))
    return [
        Target(
            name,
            f"<= {limit} ms/step" if limit else "-",
            f"{value:.3f} ms/step",
            value <= limit if limit else None,
        )
        for name, value in overheads
    ]


def targets(report: Report) -> list[Target]:
    """Each target of the issue against what was measured."""
    kind = report.machine["database"]
    steps = report.scenario["steps"]
    service = report.service
    txns = service.transactions
    long = service.long_session
    byte_limit = BYTES_TARGET_PER_200_STEPS * long.steps / 200
    rate = service.throughput.sessions_per_s
    floor = service.commit_floor
    return [
        *_overhead_targets(report),
        Target(
            f"transactions per {steps}-step session",
            str(durable_writes(steps)),
            txns.described,
            txns.including_locks <= durable_writes(steps),
        ),
        Target(
            f"late/early ms per step ({long.steps} steps)",
            f"<= {LATE_EARLY_TARGET}",
            f"{long.late_early_ratio:.2f}",
            long.late_early_ratio <= LATE_EARLY_TARGET,
        ),
        Target(
            f"bytes stored, {long.steps}-step session",
            f"<= {byte_limit:,.0f}",
            f"{long.bytes_stored:,}",
            long.bytes_stored <= byte_limit,
        ),
        Target(
            f"sessions/s at {service.throughput.concurrency} concurrent",
            f">= {SESSIONS_PER_S_TARGET:.0f} (PostgreSQL)",
            f"{rate:.1f}",
            rate >= SESSIONS_PER_S_TARGET if kind == "postgresql" else None,
        ),
        Target(
            "durable overhead / commit floor",
            f"<= {FLOOR_RATIO_TARGET}",
            f"{floor.ratio:.2f}",
            floor.ratio <= FLOOR_RATIO_TARGET,
        ),
        Target(
            "every side effect ran exactly once",
            "yes",
            "yes" if report.side_effects["exactly_once"] else "NO",
            bool(report.side_effects["exactly_once"]),
        ),
    ]


LABEL = 44


def _row(label: str, *, value: str, note: str = "") -> str:
    return f"  {label:<{LABEL}}{value:>10}{'   ' + note if note else ''}"


def _stats_rows(label: str, *, stats: Stats) -> str:
    note = f"(p90 {stats.p90:.2f}, min {stats.minimum:.2f}, n={stats.n})"
    return _row(label, value=f"{stats.median:.2f}", note=note)


def _session_rows(sessions: Sessions) -> list[str]:
    rows = [
        _stats_rows("stateless session, ms", stats=sessions.stateless_ms),
        _stats_rows("durable session, ms", stats=sessions.durable_ms),
        _row("durable overhead per step, ms", value=f"{sessions.overhead_ms_per_step:.3f}"),
    ]
    if sessions.stateless_cpu_ms is not None and sessions.durable_cpu_ms is not None:
        rows += [
            _stats_rows("CPU of a stateless session, ms", stats=sessions.stateless_cpu_ms),
            _stats_rows("CPU of a durable session, ms", stats=sessions.durable_cpu_ms),
            _row("CPU overhead per step, ms", value=f"{sessions.overhead_cpu_ms_per_step:.3f}"),
        ]
    return rows


def render(report: Report) -> str:
    """The report as a plain-text table."""
    lines = [
        *_header_rows(report),
        "",
        "service layer (RunService.create, no HTTP)",
        *_session_rows(report.service.sessions),
    ]
    if report.http is not None:
        lines += ["", *_http_rows(report.http)]
    lines += [
        "",
        *_database_rows(report.service),
        "",
        *_throughput_rows(report.service.throughput),
        "",
        *_crowded_rows(report.service.crowded),
        *_long_session_rows(report.service.long_session),
        "",
        _row("peak RSS of the bench process, MB", value=f"{report.peak_rss_mb:.1f}"),
        _row(
            "post_slack calls, each exactly once",
            value="yes" if report.side_effects["exactly_once"] else "NO",
            note=f"({report.side_effects['counted']} counted, {report.side_effects['expected']}"
            " expected)",
        ),
        "",
        "targets",
        *_target_rows(report.targets),
    ]
    return "\n".join(lines)


def _header_rows(report: Report) -> list[str]:
    s, m = report.scenario, report.machine
    return [
        "agent-runner bench: the standard scenario",
        f"  {s['steps']} steps x (200-char text + get_issue + post_slack), 200-char user message"
        f" and final answer: {s['messages_per_session']} messages per session",
        f"  {s['sessions']} sessions timed after {s['warmup']} warm-up; medians unless said",
        f"  machine: {m['cpus']} CPUs, Python {m['python']}, {m['platform']}",
        f"  database: {m['database']} {m['database_version']} ({m['database_url']})"
        + (", in a schema of its own, dropped at the end" if m["database"] == "postgresql" else ""),
    ]


def _http_rows(http: HttpFigures) -> list[str]:
    rss = f"{http.server_peak_rss_mb:.1f}" if http.server_peak_rss_mb else "n/a"
    return [
        "HTTP (agent-runner serve, anthropic SDK, local fake model, HTTP tools)",
        *_session_rows(http.sessions),
        _row(
            "model call as the server times it, ms",
            value=f"{http.model_call_ms_stateless:.2f} / {http.model_call_ms_durable:.2f}",
            note="(stateless / durable sessions; it touches no database)",
        ),
        _row("server peak RSS, MB", value=rss),
    ]


def _database_rows(service: ServiceFigures) -> list[str]:
    txns, floor = service.transactions, service.commit_floor
    return [
        "database",
        _row(
            "transactions per durable session",
            value=str(txns.total),
            note=f"({txns.writing} writing, {txns.read_only} read-only;"
            f" {txns.statements} statements, {txns.checkouts} pool checkouts)",
        ),
        _row(
            "  + advisory-lock statements, own connection",
            value=str(txns.lock_statements),
            note="(take and release the session: PostgreSQL only)",
        ),
        _stats_rows(f"commit floor: {floor.transactions} INSERT+COMMIT, ms", stats=floor.ms),
        _row("durable overhead per session / floor", value=f"{floor.ratio:.2f}"),
    ]


def _throughput_rows(rate: Throughput) -> list[str]:
    return [
        f"throughput: {rate.concurrency} concurrent durable sessions",
        _row(
            "sessions per second",
            value=f"{rate.sessions_per_s:.1f}",
            note=f"({rate.sessions} sessions in {rate.seconds:.2f} s)",
        ),
    ]


def _crowded_rows(crowded: Crowded | None) -> list[str]:
    if crowded is None:
        return []
    return [
        f"other sessions held: {crowded.others:,} sessions' locks held meanwhile, on another"
        " connection",
        _stats_rows("durable session, ms, none held", stats=crowded.alone_ms),
        _stats_rows(f"durable session, ms, {crowded.others:,} held", stats=crowded.crowded_ms),
        _row("difference per step, ms", value=f"{crowded.ms_per_step:.3f}"),
        "",
    ]


def _long_session_rows(long: LongSession) -> list[str]:
    window = min(10, long.steps)
    return [
        f"long session: {long.steps} steps (service time between model calls)",
        _row(f"ms per step, first {window} steps", value=f"{long.early_ms_per_step:.3f}"),
        _row(f"ms per step, last {window} steps", value=f"{long.late_ms_per_step:.3f}"),
        _row("late / early", value=f"{long.late_early_ratio:.2f}"),
        _row(
            "bytes stored",
            value=f"{long.bytes_stored:,}",
            note=f"({long.bytes_per_step:.0f} per step, {long.messages} messages)",
        ),
    ]


def _target_rows(targets: list[Target]) -> list[str]:
    verdicts = {True: "met", False: "MISSED", None: "n/a"}
    return [
        f"  {t.name:<40} {t.measured:>32}   target {t.target:<22} {verdicts[t.met]}"
        for t in targets
    ]
