"""`.env` in the working directory: its variables reach everything that reads the environment,
the anthropic SDK included; the environment itself wins."""

from __future__ import annotations

from pathlib import Path

from tests.support.agents import write_agents_file
from tests.support.fake_anthropic import FakeAnthropic
from tests.support.server import ServerProcess
from tests.support.tool_server import ToolServer


def test_the_env_file_reaches_the_sdk_and_the_environment_wins(
    tmp_path: Path, fake_model: FakeAnthropic, tool_server: ToolServer
) -> None:
    served = tmp_path / "served.db"
    (tmp_path / ".env").write_text(
        f"ANTHROPIC_BASE_URL={fake_model.url}\n"  # read by the SDK, not by the service
        f"DATABASE_URL=sqlite:///{tmp_path / 'from-env-file.db'}\n"  # the environment's wins
    )
    server = ServerProcess(
        database_url=f"sqlite:///{served}",
        log_path=tmp_path / "server.log",
        agents_file=write_agents_file(tmp_path, tool_server.url),
        cwd=tmp_path,
    )
    with server, server.client() as client:
        run = client.post("/v1/runs", json={"agent": "echo", "message": "hi", "session_id": "e"})

    assert run.status_code == 200, run.text
    assert (run.json()["status"], run.json()["response"]) == ("complete", "echo: hi")
    assert len(fake_model.requests) == 1
    assert served.exists()
    assert not (tmp_path / "from-env-file.db").exists()
