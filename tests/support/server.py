"""`agent-runner serve` as a real process, for tests that kill it."""

from __future__ import annotations

import fcntl
import itertools
import os
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

from app.serving import Child, ServeProcess, agent_runner_command, free_port
from tests.support.forked import ForkedServer

AGENT_RUNNER = agent_runner_command()[0]

__all__ = [
    "AGENT_RUNNER",
    "AgentsServer",
    "ServerProcess",
    "command_env",
    "free_port",
    "server_port",
]

# A port is free when drawn but bound only once the server has started, seconds later: two
# test processes (pytest-xdist workers, or two checkouts' suites) asking the kernel for any free
# port could both be given it. Each test process takes a block of ports of its own instead,
# below the kernel's ephemeral ports, and holds a lock on it (flock) until it exits.
_BLOCK = 250
_FIRST_PORT, _LAST_PORT = 20000, 30000


def _take_port_block() -> range:
    for start in range(_FIRST_PORT, _LAST_PORT, _BLOCK):
        lock = os.open(
            f"{tempfile.gettempdir()}/agent-runner-test-ports-{start}.lock",
            os.O_RDWR | os.O_CREAT,
            0o666,
        )
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(lock)
            continue
        return range(start, start + _BLOCK)  # the lock's descriptor stays open: held till exit
    raise RuntimeError("every block of test ports is taken by other test processes")


_PORTS: Iterator[int] | None = None


def server_port() -> int:
    """A free port of this test process's own block, for a server it starts."""
    global _PORTS
    if _PORTS is None:
        _PORTS = itertools.cycle(_take_port_block())
    for _ in range(_BLOCK):
        port = next(_PORTS)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError("every port of this test process's block is in use")


def command_env(
    *,
    database_url: str,
    agents_file: Path | None = None,
    model_url: str | None = None,
    failpoints: str | None = None,
    env: dict[str, str] | None = None,
) -> dict[str, str]:
    """The environment of an `agent-runner` command under test: the test's database, agents,
    model and failpoints, and this environment less any ANTHROPIC_* or API_KEYS of the
    developer's."""
    inherited = {
        k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "API_KEYS"))
    }
    return {
        **inherited,
        "DATABASE_URL": database_url,
        "ANTHROPIC_API_KEY": "test-key",
        "ANTHROPIC_MAX_RETRIES": "0",
        **({"AGENTS_FILE": str(agents_file)} if agents_file else {}),
        **({"ANTHROPIC_BASE_URL": model_url} if model_url else {}),
        **({"FAILPOINTS": failpoints} if failpoints else {}),
        **(env or {}),
    }


class ServerProcess(ServeProcess):
    """A server on `database_url`, with the test model and agents (`command_env`):
    `agent-runner serve` forked from a process that has imported it (tests/support/forked.py)."""

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
        super().__init__(
            env=command_env(
                database_url=database_url,
                agents_file=agents_file,
                model_url=model_url,
                failpoints=failpoints,
                env=env,
            ),
            log_path=log_path,
            cwd=cwd,
            port=server_port(),
        )

    def _spawn(self) -> Child:
        argv = ["serve", "--host", "127.0.0.1", "--port", str(self.port)]
        return ForkedServer(argv, env=self._env, cwd=self._cwd, log=self.log_path)


class AgentsServer(Protocol):
    """The `agents_server` fixture (tests/conftest.py): a server of the test agents
    (tests/support/agents.py) on `database_url`, their models on the test's fake model, their
    tools on its tool server, its log in the test's tmp_path/server.log."""

    def __call__(
        self, *, database_url: str, env: dict[str, str] | None = None
    ) -> ServerProcess: ...
