"""`agent-runner serve` as a real subprocess, for tests that kill it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

import httpx

AGENT_RUNNER = str(Path(sys.executable).with_name("agent-runner"))


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class ServerProcess:
    """One `agent-runner serve` process with the given environment; logs go to `log_path`."""

    def __init__(
        self,
        *,
        database_url: str,
        log_path: Path,
        agents_file: Path | None = None,
        model_url: str | None = None,
        failpoints: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "API_KEYS"))},
            "DATABASE_URL": database_url,
            "ANTHROPIC_API_KEY": "test-key",
            "ANTHROPIC_MAX_RETRIES": "0",
            **({"AGENTS_FILE": str(agents_file)} if agents_file else {}),
            **({"ANTHROPIC_BASE_URL": model_url} if model_url else {}),
            **({"FAILPOINTS": failpoints} if failpoints else {}),
            **(env or {}),
        }
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, *, timeout: float = 30) -> ServerProcess:
        """Spawn the server and wait until /healthz answers."""
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [AGENT_RUNNER, "serve", "--host", "127.0.0.1", "--port", str(self.port)],
                env=self._env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.logs()}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"server did not become healthy:\n{self.logs()}")

    def client(self, *, timeout: float = 60) -> httpx.Client:
        """A client for this server."""
        return httpx.Client(base_url=self.url, timeout=timeout)

    def kill(self) -> None:
        """SIGKILL: the process dies at once, as in a crash."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)

    def wait(self, timeout: float = 30) -> int:
        """Wait for the process to end by itself (a failpoint); its exit code."""
        assert self.process is not None
        return self.process.wait(timeout=timeout)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it lingers."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    def logs(self) -> str:
        """What the server printed."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
