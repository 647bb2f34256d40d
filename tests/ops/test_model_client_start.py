"""The anthropic SDK's client is built aside (app/llm/router.py): a server whose agents are
all `scripted:` never imports the SDK, and one whose agents name an API model answers them
from its first request. Each server is the installed command itself, not a fork of the
test process, which has imported the SDK already."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx

from app.serving import ServeProcess
from tests.support.fake_anthropic import FakeAnthropic
from tests.support.server import AGENT_RUNNER, command_env, server_port

SCRIPTED_ONLY = """
agents:
  echo:
    model: "scripted:echo"
"""


def _traced_server(tmp_path: Path, *, env: dict[str, str]) -> ServeProcess:
    """`agent-runner serve` under `python -X importtime`: each module it imports is a line
    of its log."""
    return ServeProcess(
        env=env,
        log_path=tmp_path / "server.log",
        port=server_port(),
        argv=lambda port: [
            sys.executable,
            "-X",
            "importtime",
            AGENT_RUNNER,
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
    )


def _imported(log: str) -> set[str]:
    return {
        line.rsplit("|", 1)[-1].strip()
        for line in log.splitlines()
        if line.startswith("import time:")
    }


def _turn(server: ServeProcess, *, agent: str) -> dict[str, object]:
    answer = httpx.post(
        f"{server.url}/v1/runs",
        json={"agent": agent, "session_id": f"start-{agent}", "message": "hello"},
        timeout=30,
    )
    assert answer.status_code == 200, answer.text
    run: dict[str, object] = answer.json()
    return run


def test_a_server_of_scripted_agents_never_imports_the_sdk(tmp_path: Path) -> None:
    agents = tmp_path / "agents.yaml"
    agents.write_text(SCRIPTED_ONLY)
    env = command_env(database_url=f"sqlite:///{tmp_path / 'a.db'}", agents_file=agents)
    with _traced_server(tmp_path, env=env) as server:
        run = _turn(server, agent="echo")
        assert (run["status"], run["response"]) == ("complete", "echo: hello")
    imported = _imported(server.logs())
    assert "app.main" in imported  # the trace is there
    assert not {m for m in imported if m.split(".")[0] == "anthropic"}


def test_an_api_agent_is_answered_from_the_first_request(
    tmp_path: Path, fake_model: FakeAnthropic
) -> None:
    # The built-in examples: `claude-support` names an API model, here the fake's.
    env = command_env(database_url=f"sqlite:///{tmp_path / 'a.db'}", model_url=fake_model.url)
    with _traced_server(tmp_path, env=env) as server:
        run = _turn(server, agent="claude-support")
        assert (run["status"], run["response"]) == ("complete", "echo: hello")
    assert [r["model"] for r in fake_model.requests] == ["claude-sonnet-4-6"]
    assert "anthropic" in _imported(server.logs())
