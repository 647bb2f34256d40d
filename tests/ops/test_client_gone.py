"""A client that goes away mid-turn: the turn goes on to its end, and is stored; the access
log says the client closed the request (499), not what was answered into the closed
connection."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.ops.helpers import json_lines
from tests.support.server import AgentsServer
from tests.support.tool_server import ToolServer


def test_a_client_that_goes_away_mid_turn_does_not_stop_it(
    agents_server: AgentsServer, database_url: str, tool_server: ToolServer
) -> None:
    body = {"agent": "slow", "message": "Triage issue 7", "session_id": "gone"}
    server = agents_server(database_url=database_url)
    with server, server.client() as client:
        with pytest.raises(httpx.ReadTimeout):  # slow_post is held: the client gives up
            client.post("/v1/runs", json=body, timeout=3)
        assert tool_server.in_flight.wait(30)
        tool_server.release()
        deadline = time.monotonic() + 30
        while client.get("/v1/sessions/gone").json()["status"] == "running":
            assert time.monotonic() < deadline, "the turn never ended"
            time.sleep(0.1)
        (run,) = client.get("/v1/sessions/gone/runs").json()["data"]
        assert run["status"] == "complete", run
        history = client.get("/v1/sessions/gone/messages").json()["data"]
        assert [m["role"] for m in history] == ["user", "assistant", "tool", "tool", "assistant"]
        assert not any(m.get("is_error") for m in history), history
        assert tool_server.count("slow_post") == 1
        deadline = time.monotonic() + 10
        while not (posts := [r for r in json_lines(server.logs()) if r.get("method") == "POST"]):
            assert time.monotonic() < deadline, server.logs()
            time.sleep(0.05)
    assert [(r["path"], r["status"]) for r in posts] == [("/v1/runs", 499)]
