"""A postgresql:// DATABASE_URL is read as libpq reads it, by every connection the service makes:
libpq's options (sslmode), asyncpg's name for sslmode (`ssl`), and any other query option
sent to the server as a setting (application_name)."""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from app.serving import agent_runner_command
from tests.ops.test_startup_refusals import refusal
from tests.support.pg import on_postgres
from tests.support.polling import wait_for
from tests.support.server import AgentsServer

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.parametrize("backend", ["postgres"], indirect=True),
]


def _application_names(database_url: str) -> list[str]:
    """application_name of every other connection to this database."""

    sql = (
        "SELECT application_name FROM pg_stat_activity"
        " WHERE datname = current_database() AND pid <> pg_backend_pid()"
    )
    return [row["application_name"] for row in on_postgres(database_url, lambda c: c.fetch(sql))]


@pytest.mark.parametrize("ssl_option", ["sslmode", "ssl"])
def test_libpq_options_reach_every_connection(
    database_url: str, tmp_path: Path, agents_server: AgentsServer, ssl_option: str
) -> None:
    # Such an option stopped `migrate` and `serve` with a TypeError traceback (SQLAlchemy
    # handed it to asyncpg.connect as a keyword), and `ssl=` reached the engine but not the
    # ownership connection, so every durable run was 503.
    name = f"agent-runner-{uuid.uuid4().hex[:8]}"
    url = f"{database_url}?application_name={name}&{ssl_option}=disable"
    migrate = subprocess.run(
        [*agent_runner_command(), "migrate"],
        env={**os.environ, "DATABASE_URL": url},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert migrate.returncode == 0, migrate.stderr
    server = agents_server(database_url=url)
    with server, server.client(timeout=30) as client:
        run = client.post(
            "/v1/runs", json={"agent": "triage", "message": "issue 7", "session_id": "url-1"}
        )
        assert run.status_code == 200, run.text
        assert run.json()["status"] == "complete"
        names = _application_names(database_url)
    # The pool's connections and the ownership's lock connection, all with the URL's name.
    assert len(names) >= 2 and set(names) == {name}, names


def test_an_option_the_server_does_not_know_is_refused_in_one_line(
    tmp_path: Path, database_url: str
) -> None:
    logs = refusal(tmp_path, f"{database_url}?no_such_option=1")
    assert 'unrecognized configuration parameter "no_such_option"' in logs, logs


def test_a_read_only_database_is_not_ready_and_answers_503(
    database_url: str, tmp_path: Path, agents_server: AgentsServer
) -> None:
    # A standby, or default_transaction_read_only: /readyz said ready and every durable run
    # was 500 internal_error.
    url = f"{database_url}?options=-c%20default_transaction_read_only%3Don"
    server = agents_server(database_url=url)
    with server, server.client(timeout=30) as client:
        ready = client.get("/readyz")
        run = client.post(
            "/v1/runs", json={"agent": "triage", "message": "issue 7", "session_id": "ro-1"}
        )
        for response in (ready, run):
            assert response.status_code == 503, response.text
            assert response.json()["code"] == "database_unavailable"
            assert "read-only" in response.json()["detail"]
    assert "Traceback" not in server.logs()


def test_a_database_read_only_for_a_while_is_served_again_once_it_takes_writes(
    database_url: str, tmp_path: Path, agents_server: AgentsServer
) -> None:
    # A connection made while the database was read-only keeps that default for its life:
    # the replica stayed 503 "read-only" until it was restarted.
    name = make_url(database_url).database
    admin = f"{database_url.rsplit('/', 1)[0]}/postgres"  # the test database takes no writes

    def read_only(setting: str) -> None:
        sql = f'ALTER DATABASE "{name}" {setting}'
        on_postgres(admin, lambda conn: conn.execute(sql))

    body = {"agent": "triage", "message": "issue 7", "session_id": "ro-2"}
    server = agents_server(database_url=database_url)
    with server, server.client(timeout=30) as client:
        assert client.post("/v1/runs", json=body).status_code == 200
        read_only("SET default_transaction_read_only = on")
        on_postgres(database_url, lambda conn: conn.execute(END_THE_OTHERS))  # made anew
        wait_for(lambda: client.get("/readyz").status_code == 503, timeout=15, what="read-only")
        refused = client.post("/v1/runs", json=body)
        assert refused.status_code == 503 and "read-only" in refused.json()["detail"], refused
        read_only("RESET default_transaction_read_only")
        wait_for(lambda: client.get("/readyz").status_code == 200, timeout=15, what="ready")
        again = client.post("/v1/runs", json=body)
        assert again.status_code == 200 and again.json()["status"] == "complete", again.text
    assert "Traceback" not in server.logs()


# Every other backend of the test database: the server's pooled and lock connections.
END_THE_OTHERS = (
    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
    " WHERE datname = current_database() AND pid <> pg_backend_pid()"
)


def test_a_host_list_with_one_port_is_served(
    database_url: str, tmp_path: Path, agents_server: AgentsServer
) -> None:
    # Valid for libpq and asyncpg; SQLAlchemy's own reading of the query refused it in a
    # traceback (it wants a port per host).
    url = make_url(database_url)
    listed = f"postgresql://{url.username}@/{url.database}?host=127.0.0.1,localhost&port={url.port}"
    server = agents_server(database_url=listed)
    with server, server.client(timeout=30) as client:
        run = client.post(
            "/v1/runs", json={"agent": "triage", "message": "issue 7", "session_id": "hosts-1"}
        )
        assert run.status_code == 200, run.text
