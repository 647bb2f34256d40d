"""DATABASE_URL=memory://: stateless runs only; a session_id is refused before any work."""

from __future__ import annotations

import os
import subprocess

import httpx

from app.serving import agent_runner_command
from tests.api.helpers import assert_problem, get_ok, run
from tests.support.fake_anthropic import FakeAnthropic
from tests.support.tool_server import ToolServer


async def test_session_id_is_refused_before_any_work(
    memory_client: httpx.AsyncClient, fake_model: FakeAnthropic, tool_server: ToolServer
) -> None:
    response = await memory_client.post(
        "/v1/runs", json={"agent": "triage", "message": "issue 7", "session_id": "s-1"}
    )

    assert_problem(response, 409, "memory_store_not_durable")
    assert fake_model.requests == []
    assert tool_server.invocations == []
    assert await get_ok(memory_client, "/v1/sessions") == {"data": [], "next_after": None}


async def test_stateless_runs_work(
    memory_client: httpx.AsyncClient, tool_server: ToolServer
) -> None:
    echo = await run(memory_client, "echo", "hi")
    triage = await run(memory_client, "triage", "issue 7")

    assert (echo["status"], echo["response"], echo["session_id"]) == ("complete", "echo: hi", None)
    assert echo["usage"]["input_tokens"] > 0 and echo["usage"]["output_tokens"] > 0
    assert triage["status"] == "complete"
    assert tool_server.count("post_slack") == 1
    assert_problem(await memory_client.get(f"/v1/runs/{echo['run_id']}"), 404, "run_not_found")


async def test_memory_store_is_ready(memory_client: httpx.AsyncClient) -> None:
    assert (await memory_client.get("/healthz")).status_code == 200
    assert (await memory_client.get("/readyz")).status_code == 200


def test_migrate_says_there_is_nothing_to_migrate() -> None:
    # It said "schema is at the newest migration" of a store that has none.
    done = subprocess.run(
        [*agent_runner_command(), "migrate"],
        env={**os.environ, "DATABASE_URL": "memory://"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "memory:// keeps nothing: it has no schema to migrate\n"
