"""`agent-runner serve` as a fork of a process that imported the service once.

Starting the command imports the service: 2 to 4 s of CPU, most of it the anthropic SDK, and the
suite starts over a hundred servers on two CPUs. A forkserver (multiprocessing's) imports it
once per test process; each server is a fork of it that calls the command's own entry point
with the test's arguments, environment, working folder and log file. It is a real process, with
its own pid, sockets and exit code: tests kill -9 it, stop it and signal it as before.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path

from app.cli import main

_CONTEXT = multiprocessing.get_context("forkserver")
# What a server imports before it reads its environment: the command and the drivers. Nothing
# here starts a thread or reads the environment at import (STYLE: nothing built at import).
_CONTEXT.set_forkserver_preload(
    [
        "app.cli",
        "app.main",
        # The service imports the SDK on a thread as it starts (app/llm/router.py): a fork
        # would import it again, 2-3 s of CPU per server.
        "app.llm.anthropic",
        "asyncpg",
        "aiosqlite",
        "sqlalchemy.dialects.postgresql.asyncpg",
        "sqlalchemy.dialects.sqlite.aiosqlite",
        "tests.support.forked",
    ]
)


def _serve(
    argv: list[str],
    env: dict[str, str],
    cwd: str | None,
    log_path: str,
    errors_path: str,
    stdin_path: str,
) -> None:
    """In the fork: become `agent-runner <argv>` run with exactly `env` in `cwd`, its
    standard output to `log_path`, its errors to `errors_path`, its input from `stdin_path`."""
    # SIGHUP's default action, as a command started from a terminal has: a suite run under
    # nohup would pass its ignoring on through the forkserver to every server. (Reset here,
    # not in pytest, which nohup means to keep alive; SIGINT is reset in tests/conftest.py.)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(env)
    sys.path[:0] = [path for path in env.get("PYTHONPATH", "").split(os.pathsep) if path]
    if cwd is not None:
        os.chdir(cwd)
    for fd, path in ((1, log_path), (2, errors_path)):
        log = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(log, fd)
        os.close(log)
    stdin = os.open(stdin_path, os.O_RDONLY)
    os.dup2(stdin, 0)
    os.close(stdin)
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115 (the process's own)
    main(args=argv, prog_name="agent-runner")  # exits: SystemExit is the process's exit code


class ForkedServer:
    """`subprocess.Popen`'s interface (what `ServeProcess` uses) over a forked command: a
    server, or another command of agent-runner. Its output goes to `log`, its errors there
    too unless `errors` names another file; it reads `stdin` (default: nothing)."""

    def __init__(
        self,
        argv: list[str],
        *,
        env: dict[str, str],
        cwd: Path | None,
        log: Path,
        errors: Path | None = None,
        stdin: Path | None = None,
    ):
        self._process = _CONTEXT.Process(
            target=_serve,
            args=(
                argv,
                env,
                None if cwd is None else str(cwd),
                str(log),
                str(errors or log),
                str(stdin or os.devnull),
            ),
            name="agent-runner",
            daemon=True,  # a server a test leaves behind dies with its test process
        )
        self._process.start()
        assert self._process.pid is not None
        self.pid: int = self._process.pid

    @property
    def returncode(self) -> int | None:
        """The exit code, or minus the signal that ended it; None while it runs."""
        return self._process.exitcode

    def poll(self) -> int | None:
        """The exit code if it has ended, else None."""
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the end; its exit code. `subprocess.TimeoutExpired` if it runs on."""
        self._process.join(timeout)
        code = self._process.exitcode
        if code is None:
            raise subprocess.TimeoutExpired("agent-runner", timeout or 0)
        return code

    def send_signal(self, sig: int) -> None:
        """Send `sig` to the server (if it still runs)."""
        if self._process.exitcode is None:
            # It may have ended since: the forkserver, its parent, reaps it before this
            # process hears of its exit (as subprocess.Popen.send_signal, ignored).
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        """SIGTERM."""
        self.send_signal(signal.SIGTERM)
