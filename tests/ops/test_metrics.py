"""GET /metrics: each number moves when its event happens (the scenario in scenario.py)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import httpx

from app.failpoints import EXIT_CODE
from tests.ops.helpers import increase, scrape, value
from tests.ops.scenario import Scenario
from tests.support.agents import write_agents_file
from tests.support.fake_anthropic import FakeAnthropic
from tests.support.server import AgentsServer, ServerProcess
from tests.support.tool_server import ToolServer

RUNS = "agent_runner_runs_total"
TOOL_CALLS = "agent_runner_tool_calls_total"
TRIAGE_MODEL = "plan:get_issue,post_slack"


def test_the_scenario_ran_as_planned(ops: Scenario) -> None:
    assert ops.crash_exit == EXIT_CODE, ops.crash_log  # the failpoint, not another death
    for action in ("resume", "ok", "tool_error", "busy_first"):
        status, body = ops.answers[action]
        assert (status, body.get("status")) == (200, "complete"), (action, body)
    assert ops.answers["model_error"][1]["status"] == "error"


def test_runs_count_by_agent_and_final_status(ops: Scenario) -> None:
    before, after = ops.metrics["ok"]
    assert increase(before, after, RUNS, agent="triage", status="complete") == 1
    before, after = ops.metrics["model_error"]
    assert increase(before, after, RUNS, agent="broken-model", status="error") == 1
    assert increase(before, after, RUNS, agent="broken-model", status="complete") == 0
    before, after = ops.metrics["resume"]
    assert increase(before, after, RUNS, agent="triage", status="complete") == 1


def test_run_duration_histogram_observes_each_run(ops: Scenario) -> None:
    before, after = ops.metrics["ok"]
    name = "agent_runner_run_duration_seconds"
    assert increase(before, after, f"{name}_count", agent="triage") == 1
    assert increase(before, after, f"{name}_sum", agent="triage") > 0
    assert increase(before, after, f"{name}_bucket", agent="triage", le="+Inf") == 1


def test_tool_calls_that_succeed_and_fail(ops: Scenario) -> None:
    before, after = ops.metrics["ok"]
    assert increase(before, after, TOOL_CALLS, tool="get_issue", outcome="ok") == 1
    assert increase(before, after, TOOL_CALLS, tool="post_slack", outcome="ok") == 1
    before, after = ops.metrics["tool_error"]
    assert increase(before, after, TOOL_CALLS, tool="lookup_missing", outcome="error") == 1
    assert increase(before, after, TOOL_CALLS, tool="lookup_missing", outcome="ok") == 0


def test_tool_calls_repaired_on_resume(ops: Scenario) -> None:
    before, after = ops.metrics["resume"]
    assert increase(before, after, TOOL_CALLS, tool="get_issue", outcome="reinvoked") == 1
    assert increase(before, after, TOOL_CALLS, tool="post_slack", outcome="durability_error") == 1
    assert increase(before, after, TOOL_CALLS, tool="post_slack", outcome="ok") == 0


def test_durable_write_latency_by_kind(ops: Scenario) -> None:
    name = "agent_runner_durable_write_seconds_count"
    before, after = ops.metrics["ok"]
    for kind in ("write1", "write2", "final"):
        assert increase(before, after, name, kind=kind) == 1, kind
    assert increase(before, after, name, kind="repair") == 0
    before, after = ops.metrics["resume"]
    assert increase(before, after, name, kind="repair") == 1
    assert increase(before, after, name, kind="final") == 1
    assert increase(before, after, name, kind="write1") == 0


def test_model_call_latency_and_tokens(ops: Scenario) -> None:
    before, after = ops.metrics["ok"]
    calls = "agent_runner_model_call_seconds"
    assert increase(before, after, f"{calls}_count", model=TRIAGE_MODEL) == 2
    assert increase(before, after, f"{calls}_sum", model=TRIAGE_MODEL) > 0
    usage = ops.answers["ok"][1]["usage"]
    tokens = "agent_runner_model_tokens_total"
    got_in = increase(before, after, tokens, model=TRIAGE_MODEL, direction="input")
    got_out = increase(before, after, tokens, model=TRIAGE_MODEL, direction="output")
    assert (got_in, got_out) == (usage["input_tokens"], usage["output_tokens"])
    assert got_in > 0 and got_out > 0


def test_session_busy_rejections(ops: Scenario) -> None:
    for refused in ("busy", "busy_delete"):  # a POST and a DELETE
        status, problem = ops.answers[refused]
        assert (status, problem["code"]) == (409, "session_busy"), refused
    before, after = ops.metrics["busy"]
    assert increase(before, after, "agent_runner_session_busy_rejections_total") == 2
    # The refused request is no run: only the first one is counted.
    assert increase(before, after, RUNS, agent="echo", status="complete") == 1
    assert value(after, "agent_runner_session_busy_rejections_total") == 2


def test_a_run_whose_runner_died_counts_as_interrupted_when_found(
    tmp_path: Path, fake_model: FakeAnthropic, tool_server: ToolServer
) -> None:
    common: dict[str, Any] = {
        "database_url": f"sqlite:///{tmp_path / 'died.db'}",
        "agents_file": write_agents_file(tmp_path, tool_server.url),
        "model_url": fake_model.url,
    }
    body = {"agent": "triage", "message": "Triage issue 3", "session_id": "s-died"}
    crashing = ServerProcess(log_path=tmp_path / "crash.log", failpoints="after-handlers", **common)
    with crashing, crashing.client() as client, contextlib.suppress(httpx.TransportError):
        client.post("/v1/runs", json=body)
    with ServerProcess(log_path=tmp_path / "serve.log", **common) as server, server.client() as c:
        before = scrape(c)
        assert c.post("/v1/runs", json=body).json()["status"] == "complete"  # no key: a new turn
        after = scrape(c)
    assert increase(before, after, RUNS, agent="triage", status="interrupted") == 1
    assert increase(before, after, RUNS, agent="triage", status="complete") == 1


def test_the_pools_connections_and_size(database_url: str, agents_server: AgentsServer) -> None:
    server = agents_server(database_url=database_url, env={"DATABASE_POOL_SIZE": "3"})
    with server, server.client() as client:
        body = {"agent": "echo", "message": "hello", "session_id": "pooled"}
        assert client.post("/v1/runs", json=body).status_code == 200
        after = scrape(client)
    assert value(after, "agent_runner_database_pool_size") == 3
    assert value(after, "agent_runner_database_connections", state="in_use") == 0
    assert 1 <= value(after, "agent_runner_database_connections", state="idle") <= 3
