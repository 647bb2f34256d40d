"""Running agent-runner and small ASGI apps as real servers, for the bench and the tests.

`ServeProcess` is `agent-runner serve` as a subprocess; `ThreadedServer` serves an ASGI app
(a fake model, a tool server) from a thread of this process. Both bind real sockets on
127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Protocol, Self

import httpx
import uvicorn
from starlette.types import ASGIApp


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def agent_runner_command() -> list[str]:
    """How to start the `agent-runner` command of this installation."""
    script = Path(sys.executable).with_name("agent-runner")
    if script.exists():
        return [str(script)]
    found = shutil.which("agent-runner")
    return [found] if found else [sys.executable, "-c", "from app.entry import main; main()"]


def _reap(process: subprocess.Popen[bytes], *, timeout: float) -> int:
    """Wait for the child to end, as `Popen.wait` would but without its lock; its exit code.
    A KeyboardInterrupt (Ctrl-C, or the bench's SIGTERM) that lands in `Popen.poll` after the
    lock is taken and before its `try` leaves the lock held for good (CPython's subprocess,
    3.11): `poll` then answers None and `wait` times out, however dead the child is."""
    deadline = time.monotonic() + timeout
    while process.returncode is None:
        try:
            pid, status = os.waitpid(process.pid, os.WNOHANG)
        except ChildProcessError:  # reaped already, by Popen: it has the exit code
            return process.wait(timeout)
        if pid != 0:
            process.returncode = os.waitstatus_to_exitcode(status)
        elif time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(process.args, timeout)
        else:
            time.sleep(0.01)
    return process.returncode


def _serve_argv(port: int) -> list[str]:
    return [*agent_runner_command(), "serve", "--host", "127.0.0.1", "--port", str(port)]


class Child(Protocol):
    """What `ServeProcess` needs of a started process: `subprocess.Popen`'s interface."""

    pid: int

    @property
    def returncode(self) -> int | None:
        """As `subprocess.Popen`'s."""

    def poll(self) -> int | None:
        """As `subprocess.Popen`'s."""

    def wait(self, timeout: float | None = None) -> int:
        """As `subprocess.Popen`'s."""

    def send_signal(self, sig: int) -> None:
        """As `subprocess.Popen`'s."""

    def terminate(self) -> None:
        """As `subprocess.Popen`'s."""


class ServeProcess:
    """One `agent-runner serve` process with exactly `env`; its output goes to `log_path`."""

    def __init__(
        self,
        *,
        env: dict[str, str],
        log_path: Path,
        argv: Callable[[int], list[str]] | None = None,
        cwd: Path | None = None,
        port: int | None = None,
    ) -> None:
        self.port = port or free_port()
        self._cwd = cwd
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._env = env
        self._argv = argv or _serve_argv
        self.process: Child | None = None

    def _spawn(self) -> Child:
        with self.log_path.open("ab") as log:
            return subprocess.Popen(
                self._argv(self.port),
                env=self._env,
                cwd=self._cwd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    def start(self, *, timeout: float = 60) -> Self:
        """Spawn the server and wait until /healthz answers; killed if it does not (or the
        wait is interrupted). Again once it has ended: a restart."""
        if self.process is not None and self.process.poll() is None:
            # `with server.start():` would start a second one beside it.
            raise RuntimeError(f"the server on port {self.port} is already running")
        self.process = self._spawn()
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(
                        f"server exited with {self.process.returncode}:\n{self.logs()}"
                    )
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                        return self
                time.sleep(0.05)
            raise RuntimeError(f"server did not become healthy:\n{self.logs()}")
        except BaseException:  # Ctrl-C too: never leave the server behind; re-raised
            self.kill()
            raise

    def client(self, *, timeout: float = 60) -> httpx.Client:
        """A client for this server."""
        return httpx.Client(base_url=self.url, timeout=timeout)

    def kill(self) -> None:
        """SIGKILL: the process dies at once, as in a crash."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.wait(timeout=10)

    def wait(self, timeout: float = 30) -> int:
        """Wait for the process to end (by itself, as at a failpoint, or signalled); its exit
        code."""
        assert self.process is not None
        if isinstance(self.process, subprocess.Popen):
            return _reap(self.process, timeout=timeout)
        return self.process.wait(timeout=timeout)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it lingers."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()

    def logs(self) -> str:
        """What the server printed."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def peak_rss_mb(self) -> float | None:
        """The server's peak resident set size (Linux /proc), or None."""
        if self.process is None:
            return None
        try:
            status = Path(f"/proc/{self.process.pid}/status").read_text()
        except OSError:
            return None
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return None

    def __enter__(self) -> Self:
        return self.start()

    # Positional: the context-manager protocol.
    def __exit__(  # noqa: PLR0917
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class ThreadedServer:
    """`with ThreadedServer(app) as server: server.url` — a real HTTP server on 127.0.0.1."""

    def __init__(self, app: ASGIApp, *, name: str = "test-server", port: int = 0) -> None:
        self._app = app
        self._name = name
        self._port = port
        self._sock: socket.socket | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.url = ""

    def start(self) -> Self:
        """Bind, serve, and return once accepting connections."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Accepted sockets inherit it: without, asyncio's loop answers each small request
        # ~40 ms late (Nagle's algorithm meeting the client's delayed ACK).
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind(("127.0.0.1", self._port))
        sock.listen(128)  # listening before uvicorn starts: early clients queue, not fail
        self._sock = sock
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(
            self._app,
            log_config=None,
            log_level="warning",
            access_log=False,
            lifespan="off",
            ws="none",
            http="h11",
            loop="asyncio",
            timeout_graceful_shutdown=1,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name=self._name, daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self._name} did not start")
            time.sleep(0.005)
        return self

    def stop(self) -> None:
        """Stop serving and release the port; safe to call twice."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> Self:
        return self.start()

    # Positional: the context-manager protocol.
    def __exit__(  # noqa: PLR0917
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
