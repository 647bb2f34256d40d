"""SQLite: the write a handler that is not safe to retry waits for is on the disk before the
handler runs, so a power loss cannot take it back and let the call run again on resume.

Other commits survive a process's death (WAL, synchronous NORMAL) but a power loss may take
the last of them back; that re-runs at most safe_to_retry tools and the model. Checked on the
system calls of a real `agent-runner serve`: every WAL page written before the example
`send_email` appends to its outbox was synced first.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
from pathlib import Path

import pytest

from app.serving import ServeProcess, agent_runner_command
from tests.support.server import command_env, server_port

pytestmark = [
    pytest.mark.crash,
    pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace"),
]

_CALL = re.compile(r"^\d+\s+(\w+)\((\d+)<([^>]*)>")


def _calls(trace: Path) -> list[tuple[str, str]]:
    """(system call, file) for each traced call on a file, in order."""
    calls = []
    for line in trace.read_text(errors="replace").splitlines():
        match = _CALL.match(line)
        if match:
            calls.append((match.group(1), match.group(3)))
    return calls


def _stop_traced(server: ServeProcess) -> None:
    """SIGTERM to the server strace started (strace would only detach from it), and wait for
    strace to end with it."""
    assert server.process is not None
    strace = server.process.pid
    children = Path(f"/proc/{strace}/task/{strace}/children").read_text().split()
    for child in children:
        os.kill(int(child), signal.SIGTERM)
    server.process.wait(timeout=30)


def test_write_1_is_synced_before_a_handler_that_is_not_safe_to_retry(tmp_path: Path) -> None:
    database, outbox, trace = tmp_path / "runs.db", tmp_path / "outbox.jsonl", tmp_path / "trace"
    env = command_env(database_url=f"sqlite:///{database}", env={"DEMO_OUTBOX": str(outbox)})
    # --seccomp-bpf: only the traced calls stop the server.
    strace = ["strace", "-f", "--seccomp-bpf", "-y", "-qq", "-o", str(trace)]
    strace += ["-e", "trace=write,pwrite64,fsync,fdatasync"]

    def argv(port: int) -> list[str]:
        return [*strace, *agent_runner_command(), "serve", "--port", str(port)]

    server = ServeProcess(env=env, log_path=tmp_path / "server.log", argv=argv, port=server_port())
    with server, server.client() as client:
        body = {"agent": "support", "message": "Where is order A-1001?", "session_id": "s"}
        run = client.post("/v1/runs", json=body).json()
        assert run["status"] == "complete", run
        _stop_traced(server)
    assert outbox.read_text().count("\n") == 1  # send_email ran, once

    calls = _calls(trace)
    wal = f"{database}-wal"
    sent = calls.index(("write", str(outbox)))
    written = max(i for i, c in enumerate(calls[:sent]) if c == ("pwrite64", wal))
    synced = [c for c in calls[written:sent] if c in (("fdatasync", wal), ("fsync", wal))]
    assert synced, f"WAL pages written at call {written} were not synced before the email"
