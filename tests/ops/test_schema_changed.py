"""A schema changed under a running server (a migration undone behind its back): the routes
answer what /readyz says, 503 `schema_out_of_date`, not a 500, and recover once migrated."""

from __future__ import annotations

import httpx

from app.db.migrate import downgrade, upgrade
from tests.support.server import AgentsServer
from tests.support.tool_server import ToolServer


def _run(client: httpx.Client, session_id: str) -> httpx.Response:
    return client.post(
        "/v1/runs", json={"agent": "triage", "message": "issue 7", "session_id": session_id}
    )


def _assert_schema_out_of_date(answer: httpx.Response) -> None:
    assert answer.status_code == 503, answer.text
    assert answer.headers["content-type"].startswith("application/problem+json")
    assert answer.json()["code"] == "schema_out_of_date"
    assert "run `agent-runner migrate`" in answer.json()["detail"]
    assert answer.headers.get("retry-after")


def test_a_schema_changed_under_the_server_is_503_schema_out_of_date_until_migrated(
    database_url: str, tool_server: ToolServer, agents_server: AgentsServer
) -> None:
    server = agents_server(database_url=database_url)
    with server, server.client(timeout=30) as client:
        first = _run(client, "before")
        assert first.status_code == 200 and first.json()["status"] == "complete", first.text
        run_id = first.json()["run_id"]

        downgrade(
            database_url, revision="-1"
        )  # the newest migration undone behind the server's back
        _assert_schema_out_of_date(client.get("/readyz"))
        _assert_schema_out_of_date(client.get(f"/v1/runs/{run_id}"))
        _assert_schema_out_of_date(client.get("/v1/sessions/before/runs"))
        _assert_schema_out_of_date(_run(client, "during"))  # its end could not be stored

        upgrade(database_url)
        assert client.get("/readyz").status_code == 200
        assert client.get(f"/v1/runs/{run_id}").status_code == 200
        again = _run(client, "after")
        assert again.status_code == 200 and again.json()["status"] == "complete", again.text
    assert " 500 " not in server.logs()
