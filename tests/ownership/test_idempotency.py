"""Idempotency-Key names one turn of one session (CONTRACT §4); a running turn reads `running`."""

from __future__ import annotations

import json

import httpx

from tests.ownership.conftest import Servers
from tests.ownership.helpers import (
    Background,
    assert_busy,
    assert_problem,
    history,
    ok,
    run_body,
    run_status,
    session_runs,
    session_status,
    user_messages,
)
from tests.support.fake_anthropic import FakeAnthropic
from tests.support.tool_server import ToolServer

SESSION = "s-idem"
MESSAGE = "Triage issue 12"
METADATA = {"source": "email", "ticket": {"id": 12, "queue": "ops"}}
KEY = {"Idempotency-Key": "turn-12"}


def test_finished_turn_replays_and_a_changed_body_is_refused(
    servers: Servers, fake_model: FakeAnthropic, tool_server: ToolServer
) -> None:
    """Same key and body: the stored answer, no model or tool call; another body: 422."""
    body = run_body("triage", MESSAGE, SESSION, metadata=METADATA)
    with servers.start("server").client() as client:
        first = client.post("/v1/runs", json=body, headers=KEY)
        run = ok(first)
        assert "idempotent-replayed" not in first.headers
        assert run["status"] == "complete", run
        model_calls, invocations = len(fake_model.requests), tool_server.invocations
        stored = history(client, SESSION)

        again = client.post("/v1/runs", json=body, headers=KEY)
        assert again.headers.get("idempotent-replayed") == "true"
        assert ok(again) == run

        # The same JSON with its keys in another order and other whitespace is the same body;
        # 12.0 is the number 12 (equal as parsed JSON, and in JSON itself).
        reordered = (
            '{ "metadata" : {"ticket": {"queue": "ops", "id": 12.0}, "source": "email"},\n'
            f'  "session_id": "{SESSION}",   "message": "{MESSAGE}", "agent": "triage" }}'
        )
        assert json.loads(reordered) == body
        same = client.post(
            "/v1/runs", content=reordered, headers={**KEY, "Content-Type": "application/json"}
        )
        assert same.headers.get("idempotent-replayed") == "true"
        assert ok(same)["run_id"] == run["run_id"]
        assert len(fake_model.requests) == model_calls
        assert tool_server.invocations == invocations

        for changed in (
            {**body, "message": "Triage issue 13"},
            {**body, "metadata": {**METADATA, "priority": "high"}},
            {key: value for key, value in body.items() if key != "metadata"},
        ):
            reused = client.post("/v1/runs", json=changed, headers=KEY)
            assert_problem(reused, 422, "idempotency_key_reused")
        assert history(client, SESSION) == stored
        assert len(user_messages(stored, MESSAGE)) == 1
        assert [r["run_id"] for r in session_runs(client, SESSION)] == [run["run_id"]]
        assert len(fake_model.requests) == model_calls
        assert tool_server.invocations == invocations

        # Keys are scoped to the session: the same key elsewhere is a new turn, also on a
        # session that exists (a new one never looks its key up).
        elsewhere = {**body, "session_id": "s-idem-other"}
        ok(client.post("/v1/runs", json={**elsewhere, "message": "Hello"}))
        other = client.post("/v1/runs", json=elsewhere, headers=KEY)
        assert "idempotent-replayed" not in other.headers
        assert ok(other)["run_id"] != run["run_id"]
        assert ok(other)["status"] == "complete"
        assert len(fake_model.requests) > model_calls

        stateless = client.post("/v1/runs", json=run_body("echo", "hi", None), headers=KEY)
        assert_problem(stateless, 422, "validation_error")


def test_running_turn_is_busy_for_its_key_and_reads_running(
    servers: Servers, fake_model: FakeAnthropic, tool_server: ToolServer
) -> None:
    """While a keyed turn runs: its key is 409 session_busy; session and run read `running`."""
    server = servers.start("server")
    body = run_body("slow", "Post the slow report", "s-running")
    in_flight = Background(server.url, body, headers=KEY)
    assert tool_server.in_flight.wait(15), server.logs()  # the turn waits on its handler
    with server.client() as client:
        (running,) = session_runs(client, "s-running")
        run_id = running["run_id"]
        assert running["status"] == "running", running
        assert run_status(client, run_id) == "running"
        assert session_status(client, "s-running") == "running"
        model_calls, invocations = len(fake_model.requests), tool_server.invocations
        again = client.post("/v1/runs", json=body, headers=KEY)
        assert assert_busy(again)["active_run_id"] == run_id
        assert len(fake_model.requests) == model_calls  # the 409 called nothing
        assert tool_server.invocations == invocations
        tool_server.release()
        answer = in_flight.join(15)
        assert isinstance(answer, httpx.Response)
        run = ok(answer)
        assert (run["run_id"], run["status"]) == (run_id, "complete")
        assert run_status(client, run_id) == "complete"
        assert session_status(client, "s-running") == "idle"
        assert tool_server.count("slow_post") == 1
        replay = client.post("/v1/runs", json=body, headers=KEY)
        assert replay.headers.get("idempotent-replayed") == "true"
        assert ok(replay)["run_id"] == run_id
