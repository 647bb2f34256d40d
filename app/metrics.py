"""Prometheus metrics, one registry per app (GET /metrics)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy.pool import Pool, QueuePool
from typing_extensions import override

# Durable writes are milliseconds; model calls and runs are seconds to minutes.
WRITE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
CALL_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    """Every number the service exports."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.runs = Counter(
            "agent_runner_runs", "Runs by final status.", ["agent", "status"], registry=r
        )
        self.run_duration = Histogram(
            "agent_runner_run_duration_seconds",
            "Wall time of a run, from request to final write.",
            ["agent"],
            buckets=CALL_BUCKETS,
            registry=r,
        )
        self.tool_calls = Counter(
            "agent_runner_tool_calls",
            "Tool calls by tool and outcome (ok, error, durability_error, reinvoked); "
            "names the agent does not have count as `unknown`.",
            ["tool", "outcome"],
            registry=r,
        )
        self.durable_write = Histogram(
            "agent_runner_durable_write_seconds",
            "Latency of durable writes by kind (start, repair, write1, write2, final).",
            ["kind"],
            buckets=WRITE_BUCKETS,
            registry=r,
        )
        self.model_call = Histogram(
            "agent_runner_model_call_seconds",
            "Latency of model calls.",
            ["model"],
            buckets=CALL_BUCKETS,
            registry=r,
        )
        self.model_tokens = Counter(
            "agent_runner_model_tokens",
            "Tokens used by model calls, by direction (input, output).",
            ["model", "direction"],
            registry=r,
        )
        self.session_busy = Counter(
            "agent_runner_session_busy_rejections",
            "Requests refused with 409 session_busy.",
            registry=r,
        )

        self.pool = _PoolCollector()
        r.register(self.pool)

    @contextmanager
    def write(self, kind: str) -> Iterator[None]:
        """Time one durable write."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.durable_write.labels(kind).observe(time.perf_counter() - start)

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)


class _PoolCollector(Collector):
    """The connection pool's connections, read at each scrape: how close the replica runs
    to DATABASE_POOL_SIZE (past it, requests wait for a connection)."""

    def __init__(self) -> None:
        self._pool_of: Callable[[], Pool] | None = None

    def watch(self, pool_of: Callable[[], Pool]) -> None:
        """Report this pool (asked for at each scrape: an engine may replace its pool)."""
        self._pool_of = pool_of

    @override
    def collect(self) -> Iterator[Metric]:
        pool = self._pool_of() if self._pool_of is not None else None
        if not isinstance(pool, QueuePool):
            return
        connections = GaugeMetricFamily(
            "agent_runner_database_connections",
            "Pooled database connections by state (in_use, idle); not PostgreSQL's lock"
            " connection nor SQLite's writer.",
            labels=["state"],
        )
        connections.add_metric(["in_use"], pool.checkedout())
        connections.add_metric(["idle"], pool.checkedin())
        yield connections
        yield GaugeMetricFamily(
            "agent_runner_database_pool_size",
            "The most pooled connections this replica keeps (DATABASE_POOL_SIZE).",
            value=pool.size(),
        )
