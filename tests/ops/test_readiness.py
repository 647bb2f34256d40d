"""Readiness on PostgreSQL: an outage answers 503 fast, and the server recovers by itself."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from sqlalchemy.engine import make_url

from tests.ops.helpers import timed
from tests.ops.proxy import database_via_proxy
from tests.support.schema import stored_revision
from tests.support.server import AgentsServer, ServerProcess
from tests.support.tool_server import ToolServer

FIRST_REVISION = "4e8a668623b5"
PROBLEM_JSON = "application/problem+json"

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.parametrize("backend", ["postgres"], indirect=True),
]


def _run(client: httpx.Client, session_id: str) -> httpx.Response:
    return client.post(
        "/v1/runs", json={"agent": "triage", "message": "issue 7", "session_id": session_id}
    )


def _problem_code(response: httpx.Response) -> str | None:
    if response.headers.get("content-type", "").split(";")[0] != PROBLEM_JSON:
        return None
    code = response.json().get("code")
    return str(code) if code is not None else None


def test_outage_answers_503_fast_and_the_server_recovers_by_itself(
    database_url: str, tmp_path: Path, tool_server: ToolServer, agents_server: AgentsServer
) -> None:
    with database_via_proxy(database_url) as (proxy, via_proxy):
        server = agents_server(database_url=via_proxy)
        with server, server.client(timeout=30) as client:
            assert client.get("/readyz").status_code == 200
            first = _run(client, "before-outage")
            assert first.status_code == 200 and first.json()["status"] == "complete"

            proxy.cut()
            deadline = time.monotonic() + 5
            while True:
                with timed(10, "GET /readyz during the outage"):
                    ready = client.get("/readyz")
                if ready.status_code == 503 or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            assert ready.status_code == 503, ready.text
            assert _problem_code(ready) == "database_unavailable"
            assert ready.headers.get("retry-after"), "a 503 says when to retry"

            for session_id in ("during-outage-1", "during-outage-2"):
                with timed(10, "POST /v1/runs during the outage"):
                    refused = _run(client, session_id)
                assert refused.status_code == 503, refused.text
                assert _problem_code(refused) == "database_unavailable"
            assert refused.headers.get("retry-after")

            proxy.restore()
            deadline = time.monotonic() + 15
            while client.get("/readyz").status_code != 200:
                assert time.monotonic() < deadline, "/readyz did not recover within 15 s"
                time.sleep(0.02)
            # Ready means ready: the first durable run after /readyz turns 200 must complete.
            first_after = _run(client, "after-outage")
            deadline = time.monotonic() + 5
            after = first_after
            while after.status_code != 200 and time.monotonic() < deadline:
                time.sleep(0.1)
                after = _run(client, "after-outage")
            assert after.status_code == 200, (
                f"no durable run completes after the outage: {after.text}"
            )
            assert after.json()["status"] == "complete"
            assert tool_server.count("post_slack") == 2

            # Behind the server's back, the schema falls behind the code: not ready.
            stored_revision(database_url, set_to=FIRST_REVISION)
            stale = client.get("/readyz")
            assert stale.status_code == 503, stale.text
            assert _problem_code(stale) == "schema_out_of_date"
            assert stale.headers.get("retry-after"), "a 503 says when to retry"
            assert "run `agent-runner migrate`" in stale.json()["detail"]

            # A newer build has migrated the database: not ready, and migrating is not the cure.
            stored_revision(database_url, set_to="a1b2c3d4e5f6")
            newer = client.get("/readyz")
            assert newer.status_code == 503, newer.text
            assert _problem_code(newer) == "schema_out_of_date"
            assert newer.json()["detail"] == (
                "The schema is at 'a1b2c3d4e5f6', a migration this build does not have: a newer"
                " build has upgraded the database; run that build here."
            )

    assert first_after.status_code == 200, (
        "/readyz answered 200 but the next durable run was refused: "
        f"{first_after.status_code} {first_after.text}"
    )


def test_a_database_that_is_gone_answers_503_on_every_route(
    database_url: str, tmp_path: Path, pg_admin: Callable[..., None]
) -> None:
    # Every new connection fails (the database no longer exists): not a lost connection
    # but an outage all the same, on reads and deletes as on runs.
    server = ServerProcess(database_url=database_url, log_path=tmp_path / "server.log")
    with server, server.client(timeout=30) as client:
        body = {"agent": "echo", "message": "hi", "session_id": "gone-1"}
        ran = client.post("/v1/runs", json=body)
        assert ran.status_code == 200, ran.text
        run_id = ran.json()["run_id"]

        pg_admin(f'DROP DATABASE "{make_url(database_url).database}" WITH (FORCE)')
        requests = [
            ("GET", "/v1/sessions"),
            ("GET", "/v1/sessions"),  # again: after the pool has been replaced
            ("GET", "/v1/sessions/gone-1"),
            ("GET", "/v1/sessions/gone-1/messages"),
            ("GET", "/v1/sessions/gone-1/runs"),
            ("GET", f"/v1/runs/{run_id}"),
            ("DELETE", "/v1/sessions/gone-1"),
            ("POST", "/v1/runs"),
            ("GET", "/readyz"),
        ]
        for method, path in requests:
            with timed(10, f"{method} {path} without a database"):
                response = client.request(method, path, json=body if method == "POST" else None)
            assert response.status_code == 503, f"{method} {path}: {response.text}"
            assert _problem_code(response) == "database_unavailable", f"{method} {path}"
        assert client.get("/v1/agents").status_code == 200  # needs no database


def test_connections_killed_under_the_server_are_replaced_or_an_outage_never_an_old_schema(
    database_url: str, tmp_path: Path, pg_admin: Callable[..., None]
) -> None:
    # Its pooled connections and its lock connection die (a PostgreSQL restart, a failover).
    database = make_url(database_url).database
    kill_all = (
        "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity"
        f" WHERE datname = '{database}' AND pid <> pg_backend_pid()"
    )
    server = ServerProcess(database_url=database_url, log_path=tmp_path / "server.log")
    with server, server.client(timeout=30) as client:
        assert client.get("/readyz").status_code == 200
        assert client.get("/readyz").status_code == 200  # a pooled connection is now idle
        pg_admin(kill_all)
        # The driver knows both are closed: each is replaced before anything is sent on it.
        assert client.get("/readyz").status_code == 200

        # Killed again while the database takes no new connections: readiness says the
        # database is unavailable, never that the schema is behind.
        pg_admin(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS false')
        try:
            pg_admin(kill_all)
            refused = client.get("/readyz")
            assert (refused.status_code, _problem_code(refused)) == (503, "database_unavailable")
        finally:
            pg_admin(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS true')
        answers: list[tuple[int, str | None]] = []
        deadline = time.monotonic() + 15
        while not answers or answers[-1] != (200, None):
            assert time.monotonic() < deadline, f"/readyz did not recover: {answers}"
            ready = client.get("/readyz")
            answers.append((ready.status_code, _problem_code(ready)))
            time.sleep(0.05)

    assert set(answers) <= {(503, "database_unavailable"), (200, None)}, answers
