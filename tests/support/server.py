"""`agent-runner serve` as a real subprocess, for tests that kill it."""

from __future__ import annotations

import itertools
import os
import socket
from pathlib import Path

from app.serving import ServeProcess, agent_runner_command, free_port

AGENT_RUNNER = agent_runner_command()[0]

__all__ = ["AGENT_RUNNER", "ServerProcess", "free_port", "server_port"]

# A port is free when drawn but bound only once the server has started, seconds later: two
# test processes (pytest-xdist workers) asking the kernel for any free port could both be
# given it. Each worker draws from its own range instead, below the kernel's ephemeral ports.
_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
_PORTS = itertools.cycle(range(20000 + 500 * (_WORKER % 20), 20500 + 500 * (_WORKER % 20)))


def server_port() -> int:
    """A free port of this test process's own range, for a server it starts."""
    for _ in range(500):
        port = next(_PORTS)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError("every port of this test process's range is in use")


class ServerProcess(ServeProcess):
    """A server on `database_url`, with the test model and agents, and this environment
    less any ANTHROPIC_* or API_KEYS of the developer's."""

    def __init__(
        self,
        *,
        database_url: str,
        log_path: Path,
        agents_file: Path | None = None,
        model_url: str | None = None,
        failpoints: str | None = None,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        inherited = {
            k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "API_KEYS"))
        }
        super().__init__(
            env={
                **inherited,
                "DATABASE_URL": database_url,
                "ANTHROPIC_API_KEY": "test-key",
                "ANTHROPIC_MAX_RETRIES": "0",
                **({"AGENTS_FILE": str(agents_file)} if agents_file else {}),
                **({"ANTHROPIC_BASE_URL": model_url} if model_url else {}),
                **({"FAILPOINTS": failpoints} if failpoints else {}),
                **(env or {}),
            },
            log_path=log_path,
            cwd=cwd,
            port=server_port(),
        )
