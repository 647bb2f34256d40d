"""The HTTP bench: a real `agent-runner serve`, the real anthropic SDK, HTTP tools.

The bench process serves, from one background thread, a zero-latency fake of the Messages API
that answers the scenario from each request's messages, and the scenario's two tools over
HTTP (`post_slack` counts into SLACK by Idempotency-Key). The server is a subprocess on the
same database, pointed at both with ANTHROPIC_BASE_URL and an agents file of HTTP tools.
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
from pathlib import Path
from types import TracebackType
from typing import Self

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import ASGIApp

from app.bench.report import HttpFigures
from app.bench.scenario import (
    AGENT,
    HTTP_MODEL,
    ISSUE,
    SLACK,
    USER_MESSAGE,
    BenchError,
    BenchOptions,
    agents_yaml,
    api_reply,
)
from app.bench.service import check_run, check_side_effects, sessions_of
from app.schemas.runs import RunRead

START_TIMEOUT_S = 30


class ThreadedApp:
    """An ASGI app served on 127.0.0.1 from a daemon thread of this process."""

    def __init__(self, app: ASGIApp, *, name: str) -> None:
        self._app = app
        self._name = name
        self._sock: socket.socket | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.url = ""

    def __enter__(self) -> Self:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)  # listening before uvicorn starts: early clients queue, not fail
        self._sock = sock
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(
            self._app, log_config=None, log_level="warning", access_log=False, lifespan="off"
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name=self._name, daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.__exit__(None, None, None)
                raise BenchError(f"{self._name} did not start")
            time.sleep(0.005)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._sock is not None:
            self._sock.close()


def scenario_app(steps: int) -> Starlette:
    """The fake Messages API (`/v1/messages`) and the two tools (`/tools/<name>`)."""

    async def create_message(request: Request) -> JSONResponse:
        return JSONResponse(api_reply(await request.json(), steps=steps))

    async def get_issue(request: Request) -> JSONResponse:
        await request.body()
        return JSONResponse(ISSUE)

    async def post_slack(request: Request) -> JSONResponse:
        await request.body()
        total = SLACK.record(request.headers.get("idempotency-key", ""))
        return JSONResponse({"ok": True, "ts": f"1700000000.{total:06d}"})

    return Starlette(
        routes=[
            Route("/v1/messages", create_message, methods=["POST"]),
            Route("/tools/get_issue", get_issue, methods=["POST"]),
            Route("/tools/post_slack", post_slack, methods=["POST"]),
        ]
    )


def _command() -> list[str]:
    script = Path(sys.executable).with_name("agent-runner")
    if script.exists():
        return [str(script)]
    found = shutil.which("agent-runner")
    return [found] if found else [sys.executable, "-c", "from app.cli import main; main()"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class ServeProcess:
    """`agent-runner serve` as a subprocess; its output goes to `log_path`."""

    def __init__(self, *, env: dict[str, str], log_path: Path) -> None:
        self.url = ""
        self._env = env
        self._log_path = log_path
        self._process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Self:
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        with self._log_path.open("ab") as log:
            self._process = subprocess.Popen(
                [*_command(), "serve", "--host", "127.0.0.1", "--port", str(port)],
                env=self._env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise BenchError(f"agent-runner serve exited:\n{self.logs()}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return self
            time.sleep(0.05)
        self.__exit__(None, None, None)
        raise BenchError(f"agent-runner serve did not become healthy:\n{self.logs()}")

    def peak_rss_mb(self) -> float | None:
        """The server's peak resident set size (Linux /proc), or None."""
        if self._process is None:
            return None
        try:
            status = Path(f"/proc/{self._process.pid}/status").read_text()
        except OSError:
            return None
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return None

    def logs(self) -> str:
        """The last lines the server printed."""
        text = self._log_path.read_text(errors="replace") if self._log_path.exists() else ""
        return "\n".join(text.splitlines()[-40:])

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        process = self._process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def server_env(database_url: str, agents_file: Path, model_url: str) -> dict[str, str]:
    """The server's environment: ours, minus anything that would change what it does."""
    dropped = ("ANTHROPIC_", "API_KEYS", "FAILPOINTS", "DATABASE_", "AGENTS_FILE", "LOG_")
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith(dropped)},
        "DATABASE_URL": database_url,
        "AGENTS_FILE": str(agents_file),
        "ANTHROPIC_BASE_URL": model_url,
        "ANTHROPIC_API_KEY": "bench-key",
        "ANTHROPIC_MAX_RETRIES": "0",
        "LOG_LEVEL": "WARNING",
    }


def _session(client: httpx.Client, *, durable: bool, steps: int) -> float:
    body: dict[str, str] = {"agent": AGENT, "message": USER_MESSAGE}
    if durable:
        body["session_id"] = f"bench-http-{os.urandom(12).hex()}"
    start = time.perf_counter()
    response = client.post("/v1/runs", json=body)
    elapsed = (time.perf_counter() - start) * 1000
    if response.status_code != 200:
        raise BenchError(f"POST /v1/runs answered {response.status_code}: {response.text[:500]}")
    check_run(RunRead.model_validate(response.json()), steps)
    return elapsed


def measure_http(database_url: str, options: BenchOptions, workdir: Path) -> HttpFigures:
    """Stateless and durable sessions through HTTP, interleaved, after warm-up."""
    SLACK.reset()
    stateless: list[float] = []
    durable: list[float] = []
    with ThreadedApp(scenario_app(options.steps), name="bench-fake-model") as fake:
        agents_file = workdir / "bench-agents.yaml"
        tools = agents_yaml({AGENT: (HTTP_MODEL, options.steps)}, tools_url=f"{fake.url}/tools")
        agents_file.write_text(tools)
        env = server_env(database_url, agents_file, fake.url)
        with (
            ServeProcess(env=env, log_path=workdir / "server.log") as server,
            httpx.Client(base_url=server.url, timeout=120) as client,
        ):
            for index in range(options.warmup + options.sessions):
                a = _session(client, durable=False, steps=options.steps)
                b = _session(client, durable=True, steps=options.steps)
                if index >= options.warmup:
                    stateless.append(a)
                    durable.append(b)
            rss = server.peak_rss_mb()
    expected = 2 * (options.warmup + options.sessions) * options.steps
    check_side_effects(expected)
    return HttpFigures(sessions_of(stateless, durable, options.steps), rss, expected)
