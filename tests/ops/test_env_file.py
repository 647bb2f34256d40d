"""`.env` in the working directory: its variables reach everything that reads the environment,
the anthropic SDK included; the environment itself wins."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.support.agents import write_agents_file
from tests.support.fake_anthropic import FakeAnthropic
from tests.support.server import AGENT_RUNNER, ServerProcess
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


@pytest.mark.parametrize(
    ("content", "says"),
    [
        pytest.param(b"API_KEYS k1:secret-one\n", ".env line 1 is not NAME=value", id="no-equals"),
        pytest.param(b'LOG_LEVEL=INFO\nAPI_KEYS="k1:secret-one\n', ".env line 2", id="open-quote"),
        pytest.param(b"API_KEYS:k1:secret-one\n", ".env line 1 is not NAME=value", id="name-only"),
        pytest.param(b"LOG_LEVEL=IN\x00FO\n", ".env holds a NUL character", id="nul"),
        pytest.param(b"\xff\xfe\n", ".env cannot be read", id="not-utf-8"),
    ],
)
def test_an_env_file_that_cannot_be_read_whole_stops_the_start(
    tmp_path: Path, content: bytes, says: str
) -> None:
    # Its bad line was skipped with a warning, and the service served without it: an
    # API_KEYS line typed wrong served every tenant's sessions with no key at all.
    (tmp_path / ".env").write_bytes(content)
    env = {k: v for k, v in os.environ.items() if k != "API_KEYS"}
    env["DATABASE_URL"] = f"sqlite:///{tmp_path / 'never.db'}"
    done = subprocess.run(
        [AGENT_RUNNER, "migrate"], cwd=tmp_path, env=env, capture_output=True, timeout=60
    )
    err = done.stderr.decode(errors="replace")
    assert (done.returncode, done.stdout) == (1, b""), err
    assert says in err, err
    assert "secret-one" not in err  # the line may hold a secret: it is named, not shown
    assert "Traceback" not in err, err
    assert not (tmp_path / "never.db").exists()
