"""SQLite writes run on the event loop's thread; another process holding the file's write lock
must make a run wait for it (in a worker thread), never stall the server or fail the run; held
past the wait, the run is a 503, never a 500."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
from sqlalchemy.engine import make_url

from tests.ops.helpers import timed
from tests.support.server import AgentsServer, ServerProcess

pytestmark = pytest.mark.parametrize("backend", ["sqlite"], indirect=True)


@dataclass(frozen=True)
class Locked:
    """A server on a SQLite file, and another connection to the file holding its write lock."""

    server: ServerProcess
    other: sqlite3.Connection


@pytest.fixture
def locked(database_url: str, agents_server: AgentsServer) -> Iterator[Locked]:
    """A started server, and its file's write lock taken as another process's would be."""
    server = agents_server(database_url=database_url).start()
    path = make_url(database_url).database
    assert path is not None
    other = sqlite3.connect(path, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")  # another process's write transaction
        yield Locked(server, other)
    finally:
        other.close()
        server.kill()


def test_a_run_waits_for_a_foreign_write_lock_while_the_server_keeps_answering(
    locked: Locked,
) -> None:
    with ThreadPoolExecutor(max_workers=1) as pool, locked.server.client(timeout=30) as client:
        body = {"agent": "echo", "message": "wait for the lock", "session_id": "locked"}
        run = pool.submit(client.post, "/v1/runs", json=body)
        for _ in range(5):
            with timed(1.0, "GET /healthz while a run waits for the write lock"):
                assert client.get("/healthz").status_code == 200
            time.sleep(0.1)
        assert not run.done(), "the run did not wait for the write lock"
        locked.other.execute("COMMIT")
        answer = run.result(timeout=20)
        assert answer.status_code == 200, answer.text
        assert answer.json()["status"] == "complete"
        stored = client.get("/v1/sessions/locked/messages").json()["data"]
    assert [m["role"] for m in stored] == ["user", "assistant"]


def test_a_foreign_write_lock_held_past_the_busy_timeout_is_a_503_then_the_run_goes(
    locked: Locked,
) -> None:
    body = {"agent": "echo", "message": "wait for the lock", "session_id": "held"}
    with locked.server.client(timeout=60) as client:
        refused = client.post("/v1/runs", json=body)  # held past the server's 10 s wait
        locked.other.execute("COMMIT")
        assert refused.status_code == 503, refused.text
        assert refused.json()["code"] == "database_unavailable"
        assert refused.headers.get("retry-after")
        answer = client.post("/v1/runs", json=body)
        assert answer.status_code == 200, answer.text
        stored = client.get("/v1/sessions/held/messages").json()["data"]
    assert [m["role"] for m in stored] == ["user", "assistant"]
    assert " 500 " not in locked.server.logs()
