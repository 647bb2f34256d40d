"""Run the whole bench: service layer, then HTTP, on one database; build the report."""

from __future__ import annotations

import asyncio
import os
import platform
import resource
import tempfile
from pathlib import Path

from sqlalchemy.engine import make_url

from app.bench.database import own_schema
from app.bench.http import measure_http
from app.bench.report import Report, targets
from app.bench.scenario import (
    ISSUE_BYTES,
    TEXT_CHARS,
    BenchError,
    BenchOptions,
    messages_per_session,
)
from app.bench.service import measure_service
from app.db.migrate import upgrade
from app.db.urls import MEMORY_URL, shown_url


def run_bench(options: BenchOptions) -> Report:
    """Measure the scenario on `options.database_url` (default: a fresh SQLite file)."""
    if options.database_url == MEMORY_URL:
        raise BenchError("the bench needs a durable store: a SQLite file or PostgreSQL")
    with tempfile.TemporaryDirectory(prefix="agent-runner-bench-") as tmp:
        workdir = Path(tmp)
        given = options.database_url or f"sqlite:///{workdir / 'bench.db'}"
        with own_schema(given) as url:
            upgrade(url)
            service, version = asyncio.run(measure_service(url, options=options))
            http = measure_http(url, options=options, workdir=workdir) if options.http else None
    side_effects = service.side_effects + http.side_effects if http else service.side_effects
    report = Report(
        scenario={
            "steps": options.steps,
            "messages_per_session": messages_per_session(options.steps),
            "sessions": options.sessions,
            "warmup": options.warmup,
            "long_steps": options.long_steps,
            "concurrency": options.concurrency,
            "text_chars": TEXT_CHARS,
            "issue_bytes": ISSUE_BYTES,
        },
        machine={
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(terse=True),
            "database": _kind(given),
            "database_version": version,
            "database_url": shown_url(given),
        },
        service=service,
        http=http,
        peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        side_effects=side_effects.as_dict(),
    )
    report.targets = targets(report)
    return report


def _kind(database_url: str) -> str:
    backend = make_url(database_url).get_backend_name()
    return "postgresql" if backend == "postgres" else backend
