"""One observed history for the metrics and log tests: a crash, a resume, and a few runs.

Server A (FAILPOINTS=after-handlers) dies in a `triage` turn after both handlers ran; server B
resumes it on the same SQLite file, then serves a run whose tools succeed, one whose tool
fails, one whose model call fails, and two colliding requests on one session. /metrics is
read before and after each action; both servers log JSON with API_KEYS set.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.ops.helpers import RequestLog, Snapshot, model_saw, scrape, write_ops_agents
from tests.support.fake_anthropic import FakeAnthropic
from tests.support.polling import wait_for
from tests.support.server import ServerProcess
from tests.support.tool_server import ToolServer

SESSIONS = {
    "resume": "ops-crash",
    "ok": "ops-ok",
    "tool_error": "ops-tool-error",
    "model_error": "ops-model-error",
    "busy": "ops-busy",
}


@dataclass
class Scenario:
    api_key: str
    wrong_key: str
    marker: str
    crash_exit: int = 0
    crash_log: str = ""
    serve_log: str = ""
    # Action name -> /metrics before and after it.
    metrics: dict[str, tuple[Snapshot, Snapshot]] = field(default_factory=dict)
    # Action name -> the POST /v1/runs answer (status code, JSON body).
    answers: dict[str, tuple[int, dict[str, Any]]] = field(default_factory=dict)
    # Session id -> its stored messages, read at the end.
    messages: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    # (method, path, status) of every answer server B gave the scenario's clients.
    requests: list[tuple[str, str, int]] = field(default_factory=list)
    rejected: tuple[int, dict[str, Any]] = (0, {})


def _turn(action: str, agent: str, marker: str) -> dict[str, str]:
    return {"agent": agent, "message": f"{marker} {action}", "session_id": SESSIONS[action]}


def run_scenario(tmp: Path, fake: FakeAnthropic, tools: ToolServer) -> Scenario:
    """Play the scenario against real servers and record what they exported and logged."""
    fake.reset()
    tools.reset()
    scenario = Scenario(
        api_key=f"ops-key-{secrets.token_hex(12)}",
        wrong_key=f"ops-wrong-key-{secrets.token_hex(12)}",
        marker=f"ops-marker-{secrets.token_hex(8)}",
    )
    agents = write_ops_agents(tmp, tools.url)
    common: dict[str, Any] = {
        "database_url": f"sqlite:///{tmp / 'ops.db'}",
        "agents_file": agents,
        "model_url": fake.url,
    }
    env = {"LOG_FORMAT": "json", "LOG_LEVEL": "INFO", "API_KEYS": f"{scenario.api_key}:acme"}
    auth = {"Authorization": f"Bearer {scenario.api_key}"}
    resume_turn = _turn("resume", "triage", scenario.marker)
    turn_key = {"Idempotency-Key": "ops-crash-turn"}

    crash = ServerProcess(
        log_path=tmp / "crash.log", failpoints="after-handlers", env=env, **common
    ).start()
    try:
        # The process dies mid-request: no answer.
        with crash.client(timeout=30) as client, contextlib.suppress(httpx.TransportError):
            client.post("/v1/runs", json=resume_turn, headers={**auth, **turn_key})
        scenario.crash_exit = crash.wait(timeout=15)
    finally:
        crash.kill()
    scenario.crash_log = crash.logs()

    recorder = RequestLog()
    serve = ServerProcess(log_path=tmp / "serve.log", env=env, **common)
    with (
        serve,
        recorder.client(serve.url) as plain,
        recorder.client(serve.url, headers=auth) as client,
    ):

        def observe(action: str, post: Callable[[], httpx.Response]) -> None:
            before = scrape(plain)
            answer = post()
            scenario.metrics[action] = (before, scrape(plain))
            scenario.answers[action] = (answer.status_code, answer.json())

        def run(action: str, agent: str, headers: dict[str, str] | None = None) -> None:
            body = _turn(action, agent, scenario.marker)
            observe(action, lambda: client.post("/v1/runs", json=body, headers=headers or {}))

        observe("resume", lambda: client.post("/v1/runs", json=resume_turn, headers=turn_key))
        observe("replay", lambda: client.post("/v1/runs", json=resume_turn, headers=turn_key))
        run("ok", "triage")
        run("tool_error", "fails")
        run("model_error", "broken-model")
        observe("busy", lambda: _collide(serve, recorder, auth, fake, scenario))

        wrong = plain.get("/v1/sessions", headers={"Authorization": f"Bearer {scenario.wrong_key}"})
        scenario.rejected = (wrong.status_code, wrong.json())
        for session_id in SESSIONS.values():
            page = client.get(f"/v1/sessions/{session_id}/messages", params={"limit": 100})
            assert page.status_code == 200, page.text
            scenario.messages[session_id] = page.json()["data"]
    scenario.serve_log = serve.logs()
    scenario.requests = list(recorder.seen)
    return scenario


def _collide(
    serve: ServerProcess,
    recorder: RequestLog,
    auth: dict[str, str],
    fake: FakeAnthropic,
    scenario: Scenario,
) -> httpx.Response:
    """Two POSTs and a DELETE on one session while the first POST waits on a slow model: the
    second POST and the DELETE are refused."""
    first_body = _turn("busy", "echo", scenario.marker)
    second_body = {**first_body, "message": f"{scenario.marker} busy again"}
    fake.set_delay(1.5)
    try:
        with (
            ThreadPoolExecutor(max_workers=1) as pool,
            recorder.client(serve.url, headers=auth) as one,
            recorder.client(serve.url, headers=auth) as two,
        ):
            first = pool.submit(one.post, "/v1/runs", json=first_body)
            wait_for(
                lambda: model_saw(fake.requests, first_body["message"]),
                timeout=15,
                what="the first request to reach the model",
            )
            second = two.post("/v1/runs", json=second_body)
            deleted = two.delete(f"/v1/sessions/{first_body['session_id']}")
            done = first.result(timeout=30)
    finally:
        fake.set_delay(0)
    scenario.answers["busy_first"] = (done.status_code, done.json())
    scenario.answers["busy_delete"] = (deleted.status_code, deleted.json())
    return second
