"""Shared helpers of the ops tests: metrics snapshots, log lines, recorded requests, agents."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from app.serving import ServeProcess
from tests.support.agents import write_agents_file
from tests.support.server import server_port

REPO = Path(__file__).resolve().parents[2]

# One sample: its name (with _total/_count/_sum) and its labels, sorted.
SampleKey = tuple[str, tuple[tuple[str, str], ...]]
Snapshot = dict[SampleKey, float]


def parse_metrics(text: str) -> Snapshot:
    """Every sample of a Prometheus text exposition."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def scrape(client: httpx.Client) -> Snapshot:
    """GET /metrics and parse it."""
    response = client.get("/metrics")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return parse_metrics(response.text)


def value(snapshot: Snapshot, name: str, **labels: str) -> float:
    """One sample's value; 0 for a labelled child that does not exist yet."""
    return snapshot.get((name, tuple(sorted(labels.items()))), 0.0)


def increase(before: Snapshot, after: Snapshot, name: str, **labels: str) -> float:
    """How much one sample grew between two scrapes."""
    return value(after, name, **labels) - value(before, name, **labels)


def json_lines(text: str) -> list[dict[str, Any]]:
    """Each line of a log as a JSON object; raises on the first line that is not one."""
    records: list[dict[str, Any]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise AssertionError(f"log line {number} is not JSON: {line!r}") from exc
        if not isinstance(record, dict):
            raise AssertionError(f"log line {number} is not a JSON object: {line!r}")
        records.append(record)
    return records


class RequestLog:
    """The (method, path, status) of every answer a client got, for the access-log check."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.seen: list[tuple[str, str, int]] = []

    def hook(self, response: httpx.Response) -> None:
        """httpx response event hook."""
        request = response.request
        with self._lock:
            self.seen.append((request.method, request.url.path, response.status_code))

    def client(self, base_url: str, *, headers: dict[str, str] | None = None) -> httpx.Client:
        """A client whose answers are recorded here."""
        return httpx.Client(
            base_url=base_url,
            timeout=60,
            headers=headers,
            event_hooks={"response": [self.hook]},
        )


def write_ops_agents(directory: Path, tools_url: str) -> Path:
    """The test agents file plus `fails`, whose only tool POSTs to a route that does not exist."""
    path = write_agents_file(directory, tools_url)
    config = yaml.safe_load(path.read_text())
    config["tools"]["lookup_missing"] = {
        "description": "Look something up at an endpoint that does not exist",
        "input_schema": {
            "type": "object",
            "properties": {"id": {"type": "string"}},
            "required": ["id"],
        },
        "http": {"url": f"{tools_url}/missing", "timeout_s": 10},
    }
    config["agents"]["fails"] = {"model": "plan:lookup_missing", "tools": ["lookup_missing"]}
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def model_saw(requests: list[Any], text: str) -> bool:
    """Whether any request the fake model received contains `text`."""
    return any(text in json.dumps(body) for body in requests)


@contextmanager
def timed(limit: float, what: str) -> Iterator[None]:
    """Fail if the block takes longer than `limit` seconds ("not a hang")."""
    start = time.monotonic()
    yield
    took = time.monotonic() - start
    assert took < limit, f"{what} took {took:.1f}s (limit {limit}s)"


def command_server(
    *,
    argv: Callable[[int], list[str]],
    env: dict[str, str],
    database_url: str,
    log_path: Path,
) -> ServeProcess:
    """A server that runs `argv(port)` with exactly `env` (plus its DATABASE_URL)."""
    return ServeProcess(
        env={**env, "DATABASE_URL": database_url},
        log_path=log_path,
        argv=argv,
        port=server_port(),
    )
