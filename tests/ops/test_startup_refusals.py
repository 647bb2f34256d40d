"""`agent-runner serve` refuses a configuration it cannot serve, at start, in one clear line."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.server import ServerProcess


def test_an_agent_on_a_scripted_model_that_does_not_exist_is_refused(tmp_path: Path) -> None:
    agents = tmp_path / "agents.yaml"
    agents.write_text('agents:\n  a1:\n    model: "scripted:nosuch"\n')
    server = ServerProcess(
        database_url=f"sqlite:///{tmp_path / 'x.db'}",
        log_path=tmp_path / "server.log",
        agents_file=agents,
    )
    try:
        with pytest.raises(RuntimeError, match="server exited"):
            server.start(timeout=20)
    finally:
        server.kill()  # had it started
    logs = server.logs()
    assert f"{agents}: agent 'a1': unknown scripted model 'scripted:nosuch'" in logs, logs
    assert "known: echo, support" in logs
    assert "Traceback" not in logs


def test_an_unknown_log_level_is_refused(tmp_path: Path) -> None:
    server = ServerProcess(
        database_url=f"sqlite:///{tmp_path / 'level.db'}",
        log_path=tmp_path / "server.log",
        env={"LOG_LEVEL": "verbose"},
    )
    try:
        with pytest.raises(RuntimeError, match="server exited"):
            server.start(timeout=20)
    finally:
        server.kill()  # had it started
    assert "log_level" in server.logs().lower()
    assert "Traceback" not in server.logs()
