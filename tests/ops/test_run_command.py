"""`agent-runner run` and `agent-runner tools`: a turn without a server, on the same store a
server uses, and the agents file checked and listed. Each command is a real process (forked
from one that imported the service, as the test servers are: tests/support/forked.py)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from app.db.urls import asyncpg_dsn
from tests.crash.support import (
    FAILPOINT_EXIT,
    Json,
    assert_durability_error,
    assert_history_consistent,
    assert_real_issue,
    get_json,
    list_messages,
    result_of,
)
from tests.support.agents import write_agents_file
from tests.support.fake_anthropic import FakeAnthropic
from tests.support.forked import ForkedServer
from tests.support.server import AGENT_RUNNER, AgentsServer, command_env
from tests.support.tool_server import ToolServer

SESSION = "cli-1"
# What does not depend on the store runs on one; the crash test runs on both.
ONLY_SQLITE = pytest.mark.parametrize("backend", ["sqlite"], indirect=True)


@dataclass(frozen=True)
class Finished:
    """What a command printed, and how it exited."""

    code: int
    out: str
    err: str

    def run(self) -> Json:
        """The run `--json` printed."""
        assert self.code == 0, self
        run: Json = json.loads(self.out)
        return run


@dataclass
class Commands:
    """`agent-runner` commands of the test agents on one database, in the test's folder."""

    tmp_path: Path
    env: dict[str, str]

    def start(
        self,
        *argv: str,
        env: dict[str, str] | None = None,
        stdin: str = "",
        stdin_path: Path | None = None,
    ) -> Running:
        """Start `agent-runner <argv>`, reading `stdin` (or the file at `stdin_path`)."""
        label = uuid.uuid4().hex[:8]
        out, err, given = (self.tmp_path / f"{label}.{kind}" for kind in ("out", "err", "in"))
        if stdin_path is None:
            given.write_text(stdin)
        process = ForkedServer(
            list(argv),
            env={**self.env, **(env or {})},
            cwd=self.tmp_path,
            log=out,
            errors=err,
            stdin=stdin_path or given,
        )
        return Running(process, out=out, err=err)

    def __call__(self, *argv: str, env: dict[str, str] | None = None, stdin: str = "") -> Finished:
        """Run `agent-runner <argv>` to its end."""
        return self.start(*argv, env=env, stdin=stdin).finish()


@dataclass
class Running:
    """A command that was started."""

    process: ForkedServer
    out: Path
    err: Path

    def finish(self, timeout: float = 120) -> Finished:
        """Wait for its end."""
        code = self.process.wait(timeout)
        return Finished(code, self.out.read_text(), self.err.read_text())


def installed(
    argv: list[str], *, env: dict[str, str], cwd: Path, **given: Any
) -> subprocess.CompletedProcess[str]:
    """The installed command itself, run to its end (the other tests fork its entry point, as
    the servers do); `given`: what it reads (`input`, `stdin`)."""
    return subprocess.run(
        argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=120, check=False, **given
    )


@pytest.fixture
def commands(
    tmp_path: Path, database_url: str, fake_model: FakeAnthropic, tool_server: ToolServer
) -> Commands:
    """Commands of the test agents on the test's database."""
    env = command_env(
        database_url=database_url,
        agents_file=write_agents_file(tmp_path, tool_server.url),
        model_url=fake_model.url,
        env={"LOG_FORMAT": "text"},
    )
    return Commands(tmp_path, env)


@pytest.mark.crash
def test_run_resumes_a_session_its_crash_cut_off_without_repeating_a_side_effect(
    commands: Commands, database_url: str, tool_server: ToolServer, agents_server: AgentsServer
) -> None:
    turn = ("run", "triage", "triage issue 42", "--session-id", SESSION, "--idempotency-key", "t")
    crashed = commands(*turn, env={"FAILPOINTS": "after-handlers"})
    assert crashed.code == FAILPOINT_EXIT, crashed
    assert crashed.out == ""
    assert (tool_server.count("get_issue"), tool_server.count("post_slack")) == (1, 1)

    run = commands(*turn, "--json").run()  # the same key: the turn goes on under its run_id
    assert run["status"] == "complete", run
    assert f"run_id={run['run_id']}" in crashed.err  # the failpoint's log line names it
    assert tool_server.count("post_slack") == 1  # not run again: the model was told instead
    assert tool_server.count("get_issue") == 2  # safe_to_retry: run again for its real result

    # The same store as a server's: it reads what the command wrote, as the command wrote it.
    with agents_server(database_url=database_url) as server, server.client() as client:
        history = list_messages(client, SESSION)
        assert get_json(client, f"/v1/runs/{run['run_id']}") == run
        runs = get_json(client, f"/v1/sessions/{SESSION}/runs")["data"]
    assert_history_consistent(history)
    assert [m["role"] for m in history] == ["user", "assistant", "tool", "tool", "assistant"]
    calls = {call["name"]: call for call in history[1]["tool_calls"]}
    assert_durability_error(result_of(history, calls["post_slack"]["id"]), calls["post_slack"])
    assert_real_issue(result_of(history, calls["get_issue"]["id"]), calls["get_issue"])
    assert [r["run_id"] for r in runs] == [run["run_id"]]


def test_run_answers_a_stateless_turn_and_stores_nothing(
    tmp_path: Path, fake_model: FakeAnthropic
) -> None:
    database = tmp_path / "never" / "made.db"
    env = command_env(database_url=f"sqlite:///{database}", model_url=fake_model.url)
    given = installed(
        [AGENT_RUNNER, "run", "echo", "-"],
        env=env,
        cwd=tmp_path,
        input="hello from stdin\n",  # as `echo` sends it: the last newline is not the message
    )
    assert (given.returncode, given.stdout, given.stderr) == (0, "echo: hello from stdin\n", "")
    assert not database.parent.exists()  # stateless: no database was opened


@ONLY_SQLITE
def test_run_refuses_what_the_api_refuses_with_its_code(commands: Commands) -> None:
    deep = "[" * 30_000 + "]" * 30_000
    big = "x" * (1024 * 1024)
    cases = [
        # What the API refuses as invalid (422, 413) is an invalid option here: exit 2.
        (("echo", "hi", "--session-id", "no spaces"), {}, 2, "validation_error: session_id: "),
        (("echo", " \n"), {}, 2, "validation_error: message: must contain a character other"),
        (("echo", "hi", "--metadata", "[1]"), {}, 2, "validation_error: metadata: "),
        (("echo", "hi", "--metadata", "{x"), {}, 2, "validation_error: metadata: not valid JSON"),
        (("echo", "hi", "--metadata", deep), {}, 2, "not valid JSON (nests too deeply to read)"),
        (("echo", big), {}, 2, "payload_too_large: as a POST /v1/runs body the turn is 1048"),
        (("echo", "hi", "--idempotency-key", "k"), {}, 2, "names a turn of a session"),
        (
            ("echo", "hi", "--session-id", SESSION, "--idempotency-key", "a b"),
            {},
            2,
            "--idempotency-key: 1 to 255 printable ASCII characters",
        ),
        # What the service refuses: its code, exit 1.
        (("nope", "hi"), {}, 1, "Error: agent_not_found: No agent named 'nope'."),
        (
            ("echo", "hi", "--session-id", SESSION),
            {"DATABASE_URL": "memory://"},
            1,
            "Error: memory_store_not_durable: ",
        ),
        (("echo", "hi"), {"FAILPOINTS": "nowhere"}, 1, "FAILPOINTS"),
        (("echo", "hi"), {"API_KEYS": "garbage"}, 1, "API_KEYS: entry 1 is not key:tenant"),
    ]
    for argv, env, code, says in cases:
        done = commands("run", *argv, env=env)
        assert (done.code, done.out) == (code, ""), (argv[:4], done.err)
        assert says in done.err, (argv[:4], done.err)
        assert "Traceback" not in done.err, (argv[:4], done.err)
    # 1 MiB as the API counts it: the body's UTF-8 bytes (this one is 900,000 and some).
    wide = commands("run", "echo", "-", stdin="漢" * 300_000)
    assert (wide.code, len(wide.out)) == (0, len("echo: ") + 300_000 + 1), wide.err


def test_run_reads_a_message_from_standard_input_no_further_than_a_body_may_carry(
    tmp_path: Path,
) -> None:
    # `yes | run echo -` read stdin to its end (gigabytes in seconds) before refusing a turn
    # over 1 MiB; with stdin closed, `-` ended in an AttributeError's traceback.
    env = command_env(database_url="memory://")
    with subprocess.Popen(["yes"], stdout=subprocess.PIPE) as endless:
        try:
            done = installed(
                [AGENT_RUNNER, "run", "echo", "-"], env=env, cwd=tmp_path, stdin=endless.stdout
            )
        finally:
            endless.kill()
    assert (done.returncode, done.stdout) == (2, ""), done.stderr
    assert "payload_too_large: as a POST /v1/runs body the turn is" in done.stderr
    closed = installed(["sh", "-c", f'exec "{AGENT_RUNNER}" run echo - <&-'], env=env, cwd=tmp_path)
    assert (closed.returncode, closed.stdout) == (2, ""), closed.stderr
    assert "MESSAGE is '-', but standard input is closed" in closed.stderr
    assert "Traceback" not in done.stderr + closed.stderr


@ONLY_SQLITE
def test_run_says_how_a_run_that_did_not_complete_ended(commands: Commands) -> None:
    done = commands("run", "broken-model", "hi")
    assert (done.code, done.out) == (1, ""), done
    (line,) = [line for line in done.err.splitlines() if line.startswith("run ")]
    assert " ended error: api_error: Model API error 500 (api_error)" in line, line
    as_json = commands("run", "broken-model", "hi", "--json")
    assert as_json.code == 1
    run = json.loads(as_json.out)
    assert (run["status"], run["error"]["type"], run["session_id"]) == ("error", "api_error", None)


@ONLY_SQLITE
def test_run_keyed_turn_replays_its_record(commands: Commands, fake_model: FakeAnthropic) -> None:
    argv = ("run", "triage", "triage issue 7", "--session-id", SESSION, "--idempotency-key", "t1")
    first = commands(*argv, "--json")
    calls = len(fake_model.requests)
    again = commands(*argv, "--json")
    assert again.run() == first.run()
    assert "replayed from its record" in again.err
    assert len(fake_model.requests) == calls  # answered from the store, no model call

    changed = commands(*argv[:2], "triage issue 8", *argv[3:])
    assert changed.code == 1
    assert "Error: idempotency_key_reused: " in changed.err


@ONLY_SQLITE
def test_run_acts_for_a_tenant_and_a_user_as_the_api_does(
    commands: Commands, database_url: str, agents_server: AgentsServer
) -> None:
    keys = {"API_KEYS": "k1:acme,k2:other"}
    with agents_server(database_url=database_url, env=keys) as server, server.client() as client:
        body = {"agent": "echo", "message": "one", "session_id": SESSION, "user_id": "ann"}
        created = client.post("/v1/runs", json=body, headers={"Authorization": "Bearer k1"})
        assert created.status_code == 200, created.text
    ann = ("run", "echo", "two", "--session-id", SESSION, "--user-id", "ann")
    refusals = [
        ((), keys, 2, "API_KEYS is set: name the tenant to act for with --tenant"),
        (("--tenant", "nosuch"), keys, 2, "--tenant: no key of API_KEYS is for tenant 'nosuch'"),
        (("--tenant", "acme"), {}, 2, "--tenant: API_KEYS is unset"),
        (("--tenant", "other"), keys, 1, "session_not_found"),  # another tenant's: not there
    ]
    for options, env, code, says in refusals:
        done = commands(*ann, *options, env=env)
        assert (done.code, says in done.err) == (code, True), (options, done)
    other = commands(*ann[:-1], "bob", "--tenant", "acme", env=keys)
    assert (other.code, "session_access_denied" in other.err) == (1, True), other
    done = commands(*ann, "--tenant", "acme", env=keys)
    assert (done.code, done.out) == (0, "echo: two\n"), done


@ONLY_SQLITE
def test_run_refuses_a_sqlite_file_a_server_serves(
    commands: Commands, database_url: str, agents_server: AgentsServer
) -> None:
    with agents_server(database_url=database_url):
        refused = commands("run", "echo", "hi", "--session-id", SESSION)
        assert refused.code == 1
        assert "another process is using this SQLite database" in refused.err
        assert "send the turn to the server that serves it" in refused.err
        assert "Traceback" not in refused.err
        stateless = commands("run", "echo", "hi")  # stores nothing: no file to share
        assert (stateless.code, stateless.out) == (0, "echo: hi\n"), stateless


@ONLY_SQLITE
def test_run_stopped_by_sigterm_finishes_its_step_first_even_as_a_background_job(
    commands: Commands, database_url: str, tool_server: ToolServer, agents_server: AgentsServer
) -> None:
    # The installed command, started as a shell starts `cmd &`: with SIGINT ignored.
    running = subprocess.Popen(
        [AGENT_RUNNER, "run", "slow", "post it", "--session-id", SESSION],
        env=commands.env,
        cwd=commands.tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        assert tool_server.in_flight.wait(timeout=60)
        running.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert running.poll() is None  # the step's call is still in flight: it waits for it
        tool_server.release()
        out, err = running.communicate(timeout=60)
    finally:
        running.kill()
    assert (running.returncode, out) == (128 + signal.SIGTERM, ""), err
    assert "stopped by SIGTERM: every step the turn began is stored" in err
    with agents_server(database_url=database_url) as server, server.client() as client:
        history = list_messages(client, SESSION)
        status = get_json(client, f"/v1/sessions/{SESSION}")["status"]
    assert_history_consistent(history)  # the step's results were stored: nothing to repair
    assert status == "idle"
    (call,) = [c for c in history[1]["tool_calls"] if c["name"] == "slow_post"]
    assert json.loads(result_of(history, call["id"])["content"]) == {"ok": True}  # its own
    assert tool_server.count("slow_post") == 1


@ONLY_SQLITE
def test_run_stopped_before_its_turn_began_exits_as_the_signal_says(commands: Commands) -> None:
    # Standard input that never comes: the command waits in its read, before the turn.
    fifo = commands.tmp_path / "stdin"
    os.mkfifo(fifo)
    writer = os.open(fifo, os.O_RDWR)  # held open, so that the command's read waits
    try:
        running = commands.start("run", "echo", "-", stdin_path=fifo)
        deadline = time.monotonic() + 60
        while not catches(running.process.pid, signal.SIGTERM):  # its handler is set
            assert time.monotonic() < deadline, running
            time.sleep(0.05)
        running.process.send_signal(signal.SIGTERM)
        done = running.finish(timeout=30)
    finally:
        os.close(writer)
    assert (done.code, done.out) == (128 + signal.SIGTERM, ""), done
    assert done.err == "stopped by SIGTERM before the turn began\n"


def test_ctrl_c_while_the_command_loads_ends_it_by_sigint_saying_nothing(tmp_path: Path) -> None:
    # The installed command, interrupted while it imports the CLI (asyncpg's extension is
    # among the first of its modules loaded; hundreds of milliseconds of imports follow).
    env = command_env(database_url="memory://")
    running = subprocess.Popen(
        [AGENT_RUNNER, "run", "echo", "hi"],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while "asyncpg/protocol" not in Path(f"/proc/{running.pid}/maps").read_text():
            assert running.poll() is None and time.monotonic() < deadline, running
            time.sleep(0.001)
        running.send_signal(signal.SIGINT)
        out, err = running.communicate(timeout=60)
    finally:
        running.kill()
    assert (running.returncode, out, err) == (-signal.SIGINT, "", "")  # no traceback


def catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler for `signum` (SigCgt in /proc/<pid>/status)."""
    status = Path(f"/proc/{pid}/status").read_text()
    (mask,) = [line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")]
    return bool(int(mask, 16) >> (signum - 1) & 1)


@ONLY_SQLITE
def test_run_stopped_by_a_second_signal_stops_at_once_and_resumes_safely(
    commands: Commands, tool_server: ToolServer
) -> None:
    turn = ("run", "slow", "post it", "--session-id", SESSION, "--idempotency-key", "t")
    running = commands.start(*turn)
    assert tool_server.in_flight.wait(timeout=60), running
    running.process.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    running.process.send_signal(signal.SIGINT)
    done = running.finish(timeout=30)  # the call is still held: it did not wait for it
    assert done.code == 128 + signal.SIGTERM, done
    assert "stopped at once by a second signal" in done.err
    tool_server.release()
    resumed = commands(*turn, "--json").run()
    assert resumed["status"] == "complete"
    (call,) = [c for m in resumed["messages"] for c in m["tool_calls"] if c["name"] == "slow_post"]
    assert tool_server.count("slow_post") == 1  # its result was lost, and it did not run again
    assert tool_server.per_call("slow_post") == {call["id"]: 1}
    assert_durability_error(result_of(resumed["messages"], call["id"]), call)


@pytest.mark.parametrize("backend", ["postgres"], indirect=True)
def test_run_meets_a_servers_turn_on_postgresql_as_another_replica_would(
    commands: Commands, database_url: str, tool_server: ToolServer, agents_server: AgentsServer
) -> None:
    with (
        agents_server(database_url=database_url) as server,
        server.client() as client,
        ThreadPoolExecutor(max_workers=1) as pool,
    ):
        body = {"agent": "slow", "message": "post it", "session_id": SESSION}
        pending = pool.submit(client.post, "/v1/runs", json=body)
        assert tool_server.in_flight.wait(timeout=60)
        (held,) = get_json(client, f"/v1/sessions/{SESSION}/runs")["data"]
        busy = commands("run", "slow", "post it", "--session-id", SESSION)
        tool_server.release()
        assert pending.result(timeout=60).status_code == 200
    assert (busy.code, busy.out) == (1, ""), busy
    assert f"session_busy: Session {SESSION!r} has a run in progress" in busy.err
    assert f"(active_run_id: {held['run_id']})" in busy.err
    assert tool_server.count("slow_post") == 1  # the refused turn ran nothing


@pytest.mark.parametrize("backend", ["postgres"], indirect=True)
def test_run_meets_a_database_outage_mid_turn_with_its_code_not_a_traceback(
    commands: Commands, database_url: str
) -> None:
    # The turn's connections end while they wait on the session table (a failover): the API
    # answers 503 database_unavailable, and `run` printed the driver's traceback instead.
    async def end_what_waits_on_the_session_table() -> Finished:
        dsn = asyncpg_dsn(database_url)
        admin, locker = await asyncpg.connect(dsn), await asyncpg.connect(dsn)
        try:
            async with locker.transaction():
                await locker.execute('LOCK TABLE "session" IN ACCESS EXCLUSIVE MODE')
                running = commands.start("run", "echo", "hi", "--session-id", SESSION)
                ended, deadline = 0, time.monotonic() + 60
                while running.process.poll() is None and time.monotonic() < deadline:
                    ended += await admin.fetchval(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                        " WHERE datname = current_database() AND wait_event_type = 'Lock'"
                    )
                    await asyncio.sleep(0.05)
            assert ended >= 1
            return running.finish()
        finally:
            await admin.close()
            await locker.close()

    done = asyncio.run(end_what_waits_on_the_session_table())
    assert (done.code, done.out) == (1, ""), done
    assert "Error: database_unavailable: The database cannot be reached" in done.err, done.err
    assert "Traceback" not in done.err, done.err


@ONLY_SQLITE
def test_tools_lists_the_agents_files_tools_and_who_uses_them(commands: Commands) -> None:
    listed = commands("tools", "--json")
    assert listed.code == 0, listed
    tools = {tool["name"]: tool for tool in json.loads(listed.out)}
    assert tools["post_slack"]["safe_to_retry"] is False
    assert tools["get_issue"]["safe_to_retry"] is True
    assert tools["post_slack"]["input_schema"]["required"] == ["channel", "text"]
    assert "triage" in tools["post_slack"]["agents"]
    assert "cut-off" in tools["post_slack"]["agents"]
    table = commands("tools").out.splitlines()
    assert table[0].split() == ["TOOL", "SAFE_TO_RETRY", "AGENTS", "DESCRIPTION"]
    assert len(table) == 1 + len(tools)
    row = next(line.split(maxsplit=3) for line in table if line.startswith("get_issue "))
    assert row[1] == "yes"
    assert row[3] == "Fetch an issue by id"

    lines = commands.tmp_path / "lines.yaml"
    lines.write_text(
        'tools:\n  t: {description: "two\\n lines,\\ta tab", python: "app.tools.builtin:clock"}\n'
        "agents:\n  a: {model: 'scripted:echo', tools: [t]}\n"
    )
    one_line = commands("tools", env={"AGENTS_FILE": str(lines)}).out.splitlines()
    assert one_line[1].split(maxsplit=3) == ["t", "no", "a", "two lines, a tab"]


@ONLY_SQLITE
def test_tools_refuses_a_broken_agents_file_naming_the_problem(
    commands: Commands, tmp_path: Path
) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("tools: {}\nagents:\n  a: {model: 'scripted:echo', tools: [missing]}\n")
    done = commands("tools", env={"AGENTS_FILE": str(broken)})
    assert (done.code, done.out) == (1, "")
    assert f"{broken}: agent 'a': unknown tool 'missing'" in done.err
    assert "Traceback" not in done.err
