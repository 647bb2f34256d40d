"""`agent-runner serve` refuses a configuration it cannot serve, at start, in one clear line."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from app.serving import ServeProcess, agent_runner_command
from tests.support.schema import stored_revision
from tests.support.server import ServerProcess, command_env, server_port


def refusal(
    tmp_path: Path,
    database_url: str,
    env: dict[str, str] | None = None,
    *,
    agents_file: Path | None = None,
) -> str:
    """The log of a `serve` that must refuse to start: one line, no traceback."""
    server = ServerProcess(
        database_url=database_url,
        log_path=tmp_path / "server.log",
        agents_file=agents_file,
        env=env,
    )
    try:
        with pytest.raises(RuntimeError, match="server exited"):
            server.start(timeout=120)  # it exits long before, however loaded the machine
    finally:
        server.kill()  # had it started
    logs = server.logs()
    assert server.process is not None and server.process.returncode == 1, logs
    assert "Traceback" not in logs, logs
    return logs


def test_the_installed_command_refuses_as_the_test_servers_do(tmp_path: Path) -> None:
    # Test servers are forks that call the command's entry point (tests/support/forked.py);
    # this is the installed `agent-runner serve` itself.
    database_url = f"sqlite:///{tmp_path / 'x.db'}"
    server = ServeProcess(
        env={**os.environ, "DATABASE_URL": database_url, "LOG_LEVEL": "verbose"},
        log_path=tmp_path / "command.log",
        port=server_port(),
    )
    try:
        with pytest.raises(RuntimeError, match="server exited with 1"):
            server.start(timeout=120)
    finally:
        server.kill()
    forked = refusal(tmp_path, database_url, {"LOG_LEVEL": "verbose"})
    assert server.logs() == forked
    assert forked.startswith("Error: invalid environment: LOG_LEVEL: Input should be"), forked


def test_agents_on_scripted_models_that_do_not_exist_are_refused_all_at_once(
    tmp_path: Path,
) -> None:
    agents = tmp_path / "agents.yaml"
    agents.write_text(
        'agents:\n  a1:\n    model: "scripted:nosuch"\n  a2:\n    model: "scripted:nor"\n'
    )
    logs = refusal(tmp_path, f"sqlite:///{tmp_path / 'x.db'}", agents_file=agents)
    assert f"{agents}: agent 'a1': unknown scripted model 'scripted:nosuch'" in logs, logs
    assert f"{agents}: agent 'a2': unknown scripted model 'scripted:nor'" in logs, logs
    assert "known: echo, support" in logs


def test_a_failpoints_list_with_an_empty_entry_is_refused(tmp_path: Path) -> None:
    env = {"FAILPOINTS": "after-write-1,,after-write-2"}
    logs = refusal(tmp_path, f"sqlite:///{tmp_path / 'x.db'}", env)
    assert "FAILPOINTS: 'after-write-1,,after-write-2' has an empty entry" in logs, logs


def test_an_empty_agents_file_variable_is_refused_as_empty(tmp_path: Path) -> None:
    # It was read as ".": "cannot read the agents file: Is a directory".
    logs = refusal(tmp_path, f"sqlite:///{tmp_path / 'x.db'}", {"AGENTS_FILE": ""})
    assert (
        "invalid environment: AGENTS_FILE: is set but empty: name a file,"
        " or unset it for the examples"
    ) in logs, logs


def test_an_unknown_log_level_is_refused(tmp_path: Path) -> None:
    logs = refusal(tmp_path, f"sqlite:///{tmp_path / 'level.db'}", {"LOG_LEVEL": "verbose"})
    assert "invalid environment: LOG_LEVEL: Input should be" in logs, logs


def test_values_of_the_wrong_type_are_named_one_line_each(tmp_path: Path) -> None:
    env = {"ANTHROPIC_TIMEOUT_S": "abc", "LOG_FORMAT": "xml", "TOOL_RESULT_MAX_BYTES": "100"}
    logs = refusal(tmp_path, f"sqlite:///{tmp_path / 'types.db'}", env)
    assert "invalid environment: ANTHROPIC_TIMEOUT_S: Input should be a valid number" in logs
    assert "; LOG_FORMAT: Input should be 'json' or 'text'" in logs, logs
    assert "; TOOL_RESULT_MAX_BYTES: Input should be greater than or equal to 1024" in logs


def test_an_address_in_use_is_refused_in_one_line_before_the_schema_is_touched(
    tmp_path: Path,
) -> None:
    # uvicorn binds once the schema is upgraded and the services have started: it logged
    # the error as JSON and exited 3.
    database = tmp_path / "port.db"
    server = ServerProcess(database_url=f"sqlite:///{database}", log_path=tmp_path / "s.log")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", server.port))
        taken.listen()
        with pytest.raises(RuntimeError, match="server exited with 1"):
            server.start(timeout=120)
    assert server.logs().strip() == (
        f"Error: cannot serve on 127.0.0.1:{server.port}: Address already in use"
    )
    assert not database.exists()


def test_a_host_that_is_not_this_machines_is_refused_in_one_line(tmp_path: Path) -> None:
    env = command_env(database_url=f"sqlite:///{tmp_path / 'host.db'}")
    # TEST-NET-1 is nobody's; what a resolver says of a name it cannot find varies.
    for host, why in (("192.0.2.1", "Cannot assign requested address"), ("no.invalid", "")):
        done = subprocess.run(
            [*agent_runner_command(), "serve", "--host", host, "--port", str(server_port())],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert (done.returncode, done.stdout) == (1, ""), done
        assert done.stderr.startswith(f"Error: cannot serve on {host}:"), done.stderr
        assert done.stderr.strip().endswith(why) and "\n" not in done.stderr.strip(), done


def test_a_time_of_nan_is_refused_as_not_a_number(tmp_path: Path) -> None:
    # It was refused as "Input should be greater than 0", which NaN may well look to be.
    env = {"ANTHROPIC_TIMEOUT_S": "nan", "SHUTDOWN_GRACE_S": "NaN"}
    logs = refusal(tmp_path, f"sqlite:///{tmp_path / 'nan.db'}", env)
    assert (
        "invalid environment: ANTHROPIC_TIMEOUT_S: Input should be a number, not NaN;"
        " SHUTDOWN_GRACE_S: Input should be a number, not NaN"
    ) in logs, logs


def test_a_takeover_time_shorter_than_four_heartbeats_is_refused(tmp_path: Path) -> None:
    # Holders stop their own runs once their heartbeat is half the takeover time old: with
    # fewer beats in that half, live runs would be refused between two beats.
    env = {"SESSION_HEARTBEAT_S": "1", "SESSION_TAKEOVER_AFTER_S": "3.5"}
    logs = refusal(tmp_path, f"sqlite:///{tmp_path / 'beat.db'}", env)
    assert (
        "invalid environment: SESSION_TAKEOVER_AFTER_S must be at least 4 times"
        " SESSION_HEARTBEAT_S (it is 3.5, the heartbeat 1)"
    ) in logs, logs


def test_an_empty_api_keys_is_refused_not_taken_for_no_auth(tmp_path: Path) -> None:
    # It served every /v1 route without a key: a deployment whose template lost its keys
    # was open to anyone.
    logs = refusal(tmp_path, f"sqlite:///{tmp_path / 'keys.db'}", {"API_KEYS": ""})
    assert "Error: API_KEYS is set but empty: name key:tenant entries, or unset it" in logs, logs


@pytest.mark.parametrize(
    "backend", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)
def test_a_password_in_the_database_url_is_never_shown(tmp_path: Path, database_url: str) -> None:
    # In the query string (libpq's `password` option) it was printed as given.
    base = database_url.rsplit("/", 1)[0]
    logs = refusal(tmp_path, f"{base}/no_such_database_here?password=s3cret-pw")
    assert "cannot use the database" in logs and "password=***" in logs, logs
    assert "s3cret-pw" not in logs, logs


def test_a_database_that_cannot_be_used_is_named_in_one_line(
    tmp_path: Path, database_url: str
) -> None:
    if database_url.startswith("sqlite"):
        (tmp_path / "folder.db").mkdir()
        unusable = f"sqlite:///{tmp_path / 'folder.db'}"
        reason = "unable to open database file"
    else:
        unusable = f"{database_url.rsplit('/', 1)[0]}/no_such_database_here"
        reason = 'database "no_such_database_here" does not exist'
    logs = refusal(tmp_path, unusable)
    assert f"Error: cannot use the database {unusable}: {reason}" in logs, logs


def test_a_database_a_newer_build_migrated_is_refused_in_one_line(
    tmp_path: Path, database_url: str
) -> None:
    # A rolling upgrade's older build, (re)started after the newer one migrated: it must not
    # serve a schema it does not know, nor try to migrate it.
    newer = "a1b2c3d4e5f6"
    stored_revision(database_url, set_to=newer)
    said = (
        f"Error: the database's schema is at {newer!r}, a migration this build does not have:"
        " a newer build has upgraded the database; run that build here"
    )
    assert said in refusal(tmp_path, database_url)
    migrate = subprocess.run(
        [*agent_runner_command(), "migrate"],
        env=command_env(database_url=database_url),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert (migrate.returncode, migrate.stdout) == (1, ""), migrate.stderr
    assert said in migrate.stderr and "Traceback" not in migrate.stderr, migrate.stderr
    assert stored_revision(database_url) == newer


def test_a_database_in_a_folder_not_made_yet_is_served(tmp_path: Path) -> None:
    # As `migrate` does, `serve` makes the SQLite file's folder (it failed on its lock file).
    database = tmp_path / "not" / "yet" / "x.db"
    server = ServerProcess(database_url=f"sqlite:///{database}", log_path=tmp_path / "s.log")
    with server, server.client() as client:
        assert client.get("/readyz").status_code == 200
    assert database.exists()


def test_an_unusable_sqlite_file_is_refused_in_one_line_every_time(tmp_path: Path) -> None:
    # Migrating through aiosqlite, its worker thread outlived the event loop when the file
    # could not be opened, and printed a traceback after the one line in about one start of
    # four: the refusal is one line on every start, not on most.
    (tmp_path / "folder.db").mkdir()
    unusable = f"sqlite:///{tmp_path / 'folder.db'}"
    for attempt in range(16):
        (folder := tmp_path / f"start-{attempt}").mkdir()
        logs = refusal(folder, unusable)
        assert logs.strip().splitlines() == [
            f"Error: cannot use the database {unusable}: unable to open database file"
        ], logs


def test_a_copy_without_its_migrations_is_refused_in_one_line(tmp_path: Path) -> None:
    # An install that left migrations/ behind, run outside the folder that holds them.
    source = Path(__file__).resolve().parents[2] / "app"
    shutil.copytree(source, tmp_path / "site" / "app")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    env.pop("DATABASE_URL", None)
    for command in ("migrate", "serve"):
        done = subprocess.run(
            [sys.executable, "-c", "from app.cli import main; main()", command],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 1, (command, done.stdout, done.stderr)
        assert "Traceback" not in done.stderr, done.stderr
        assert "run agent-runner from the folder that holds migrations/" in done.stderr, command


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("garbage", "not a database URL"),
        ("postgresql://u:pw@h:abc/db", "not a database URL"),
        ("sqlite:///:memory:", "a SQLite URL names a file"),
        ("sqlite:///~/agent.db", "a SQLite path is not expanded"),
        ("postgresql://u:secret-1@secret-2@h/db", "write an @ in its user name or password"),
    ],
)
def test_a_database_url_that_cannot_be_used_is_refused_in_one_line(
    tmp_path: Path, url: str, reason: str
) -> None:
    # Tracebacks (a URL SQLAlchemy could not parse, a port that is not a number), a server
    # that served in-memory SQLite forever without its tables, a password half shown. Every
    # rule of check_database_url: tests/unit/test_config_values.py.
    logs = refusal(tmp_path, url)
    assert logs.strip().startswith("Error: invalid environment: DATABASE_URL: "), logs
    assert reason in logs, logs
    assert "secret" not in logs, logs


def test_a_sqlite_file_this_process_cannot_write_is_refused_in_one_line(tmp_path: Path) -> None:
    # Its schema was current, so the upgrade passed, and the start failed in a traceback.
    database = tmp_path / "read-only.db"
    url = f"sqlite:///{database}"
    ServerProcess(database_url=url, log_path=tmp_path / "make.log").start().stop()
    database.chmod(0o444)
    # root writes any file: run the command without the capability that lets it.
    command = [*agent_runner_command(), "serve", "--port", str(server_port())]
    if os.geteuid() == 0:
        drop = ["--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-all", "--"]
        command = ["setpriv", *drop, *command]
    done = subprocess.run(
        command,
        env={**os.environ, "DATABASE_URL": url},
        capture_output=True,
        text=True,
        timeout=60,  # had it started, it would serve until killed
        check=False,
    )
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert (
        f"Error: cannot use the database {url}: attempt to write a readonly database" in done.stderr
    ), done.stderr


def test_the_aiosqlite_scheme_is_served(tmp_path: Path) -> None:
    # It migrated, then the start failed in a MissingGreenlet traceback.
    url = f"sqlite+aiosqlite:///{tmp_path / 'x.db'}"
    server = ServerProcess(database_url=url, log_path=tmp_path / "s.log")
    with server, server.client() as client:
        run = client.post(
            "/v1/runs", json={"agent": "support", "message": "hi", "session_id": "s-1"}
        )
        assert run.status_code == 200, run.text
        assert run.json()["status"] == "complete"


def test_a_second_spelling_of_a_served_file_is_refused(tmp_path: Path) -> None:
    # The lock was taken beside the path as written: a symbolic link to the file (or another
    # relative spelling) let a second process serve the same file.
    (tmp_path / "link.db").symlink_to(tmp_path / "x.db")
    server = ServerProcess(
        database_url=f"sqlite:///{tmp_path / 'x.db'}", log_path=tmp_path / "s.log"
    )
    (tmp_path / "second").mkdir()
    with server:
        logs = refusal(tmp_path / "second", f"sqlite:///{tmp_path / 'link.db'}")
    assert "another process is serving this SQLite database" in logs, logs
