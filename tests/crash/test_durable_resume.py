"""Durable resume through the front door: a real `agent-runner serve`, HTTP only, both stores."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.crash.support import (
    ISSUE,
    MESSAGE,
    SESSION,
    assert_history_consistent,
    crash_run,
    final_text,
    list_messages,
    post_run,
    run_body,
    server_maker,
    server_process,
)
from tests.support.fake_anthropic import FakeAnthropic
from tests.support.server import ServerProcess
from tests.support.tool_server import ToolServer

# The crash windows themselves, keyed and not, are test_crash_matrix.py's.


def test_memory_store_refuses_session_before_any_work(
    tmp_path: Path, fake_model: FakeAnthropic, tool_server: ToolServer
) -> None:
    """memory:// with a session_id is 409 at entry; without one the run works, stateless."""
    memory = server_process(
        tmp_path,
        database_url="memory://",
        fake_model=fake_model,
        tool_server=tool_server,
        label="memory",
    )
    with memory, memory.client() as client:
        refused = client.post("/v1/runs", json=run_body("triage"))
        assert refused.status_code == 409, refused.text
        assert refused.headers["content-type"].startswith("application/problem+json")
        problem = refused.json()
        assert problem["code"] == "memory_store_not_durable"
        assert problem["status"] == 409
        assert {"type", "title", "detail"} <= set(problem)
        assert fake_model.requests == []
        assert tool_server.invocations == []

        run = post_run(client, run_body("triage", session_id=None))
        # Stateless: nothing at all is written, not even the run.
        stored = client.get(f"/v1/runs/{run['run_id']}")
        assert stored.status_code == 404, stored.text
        assert stored.json()["code"] == "run_not_found"
    assert run["session_id"] is None
    assert run["status"] == "complete"
    assert run["response"] == final_text(1, [])
    assert [i.tool for i in tool_server.invocations] == ["get_issue", "post_slack"]
    assert len(fake_model.requests) == 2


def test_ten_step_durable_run(
    tmp_path: Path, database_url: str, fake_model: FakeAnthropic, tool_server: ToolServer
) -> None:
    """Ten tool steps on a session: every step stored, every tool_use answered once."""
    server = server_process(
        tmp_path,
        database_url=database_url,
        fake_model=fake_model,
        tool_server=tool_server,
        label="ten",
    )
    with server, server.client() as client:
        run = post_run(client, run_body("ten-steps"))
        history = list_messages(client)
    assert run["status"] == "complete", run
    assert run["iterations"] == 11
    assert run["session_id"] == SESSION
    assert len(history) == 1 + 10 * (1 + 1) + 1
    assert_history_consistent(history)
    roles = ["user", *["assistant", "tool"] * 10, "assistant"]
    assert [m["role"] for m in history] == roles
    assert history[0]["content"] == MESSAGE
    assert [m["seq"] for m in run["messages"]] == list(range(1, 23))
    assert {m["run_id"] for m in history} == {run["run_id"]}
    assert history[-1]["content"] == run["response"] == final_text(10, [])
    results = [m for m in history if m["role"] == "tool"]
    for step, message in enumerate(results, start=1):
        assert message["is_error"] is False
        assert json.loads(message["content"]) == {**ISSUE, "id": f"id-{step}"}
    per_call = tool_server.per_call("get_issue")
    assert len(per_call) == 10
    assert set(per_call.values()) == {1}


@pytest.mark.crash
@pytest.mark.parametrize("failpoint", ["after-write-2@2", "before-final-write"])
def test_example_support_agent_emails_once_across_a_crash_after_the_email(
    failpoint: str, tmp_path: Path, database_url: str
) -> None:
    """The built-in `support` agent (offline, no AGENTS_FILE): its email went out and its result
    was stored, then the process died; a resubmission without a key is a new turn, and the
    agent (never the same email twice) reports the email instead of sending it again."""
    outbox = Path(os.environ["DEMO_OUTBOX"])  # set per test (tests/conftest.py)
    body = {"agent": "support", "message": "Where is order A-1001?", "session_id": "s-email"}

    def server(label: str, failpoints: str | None = None) -> ServerProcess:
        return ServerProcess(
            database_url=database_url, log_path=tmp_path / f"{label}.log", failpoints=failpoints
        )

    with server("crashed", failpoint) as crashing:
        crash_run(crashing, body)
    assert len(outbox.read_text().splitlines()) == 1
    with server("resumed") as resumed, resumed.client() as client:
        run = post_run(client, body)
        history = list_messages(client, "s-email")
    assert run["status"] == "complete", run
    assert "already emailed" in run["response"], run["response"]
    assert len(outbox.read_text().splitlines()) == 1
    assert [m["tool_name"] for m in history if m["role"] == "tool"] == [
        "lookup_order",
        "send_email",
    ]
    assert_history_consistent(history)


@pytest.mark.crash
def test_while_a_repair_reruns_a_tool_the_new_run_holds_the_session(
    tmp_path: Path, database_url: str, fake_model: FakeAnthropic, tool_server: ToolServer
) -> None:
    """A 409 during a slow repair names the resubmission's run, and the dead run stays
    `interrupted` (it was named in the 409 and shown `running` until the repair ended)."""
    body = run_body("slow-read")
    server = server_maker(
        tmp_path, database_url=database_url, fake_model=fake_model, tool_server=tool_server
    )
    crashing = server(label="crashed", failpoints="after-write-1")
    with crashing:
        crash_run(crashing, body)
    tool_server.reset()  # /slow_post holds its answer until released
    with server(label="resumed") as resumed, resumed.client(timeout=60) as client:
        (dead,) = [r["run_id"] for r in client.get(f"/v1/sessions/{SESSION}/runs").json()["data"]]
        with ThreadPoolExecutor(max_workers=1) as pool:
            pending = pool.submit(post_run, client, body)
            assert tool_server.in_flight.wait(timeout=30), resumed.logs()  # the repair's re-run
            busy = client.post("/v1/runs", json=body)
            dead_then = client.get(f"/v1/runs/{dead}").json()["status"]
            tool_server.release()
            run = pending.result(timeout=30)
        history = list_messages(client)

    assert busy.status_code == 409, busy.text
    assert busy.json()["active_run_id"] == run["run_id"] != dead
    assert dead_then == "interrupted"
    assert run["status"] == "complete"
    assert_history_consistent(history)
