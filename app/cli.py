"""The `agent-runner` command: serve, migrate, run, tools, bench (serving: app/cli_serve.py;
`run`: app/cli_run.py)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import sys
import threading
from types import FrameType
from typing import TYPE_CHECKING

import asyncpg
import click
import uvicorn
from pydantic import ValidationError
from sqlalchemy.exc import DBAPIError

from app.cli_serve import DrainingServer, refuse_an_address_in_use
from app.db.migrate import upgrade
from app.db.outages import DATABASE_ERRORS, is_outage, unavailable
from app.db.sqlite_engines import check_sqlite_writable
from app.db.urls import MEMORY_URL, check_database_url, shown_url
from app.errors import AppError, ConfigError, SqliteFileBusy
from app.lifecycle import Lifecycle
from app.logs import configure_logging
from app.services.ownership import serving_lock_file, take_serving_lock
from app.settings import Settings, load_env_file

if TYPE_CHECKING:
    from fastapi import FastAPI


# What stops `run` when not ignored already (SIGHUP: the terminal went away).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _settings(*, quiet: bool = False) -> Settings:
    """The environment's settings, logging configured by them; `quiet`: warnings and errors
    only, unless LOG_LEVEL is set."""
    try:
        load_env_file()
        settings = Settings()
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    except ValidationError as exc:
        raise _invalid_environment(exc) from None
    quiet = quiet and "log_level" not in settings.model_fields_set
    configure_logging("WARNING" if quiet else settings.log_level, fmt=settings.log_format)
    return settings


def _invalid_environment(exc: ValidationError) -> click.ClickException:
    """Settings the environment (or `.env`) gives that do not validate, one line each."""
    problems = "; ".join(validation_problem(e["loc"], msg=e["msg"]) for e in exc.errors())
    return click.ClickException(f"invalid environment: {problems}")


def validation_problem(loc: tuple[int | str, ...], *, msg: str, variable: bool = True) -> str:
    """One of pydantic's errors in a line: an invalid variable as `NAME: why` (a check across
    variables has no name); not a `variable`, an invalid field as `name: why`."""
    why = msg.removeprefix("Value error, ")  # pydantic's prefix for a validator's ValueError
    name = ".".join(map(str, loc))
    return f"{name.upper() if variable else name}: {why}" if loc else why


def _usable(database_url: str, *, serving: bool = False) -> None:
    """Upgrade the schema and, to serve a SQLite file, check this process can write it; or
    stop with one line saying why the database cannot be used."""
    try:
        upgrade(database_url)
        if serving:
            check_sqlite_writable(database_url)
    except (DBAPIError, OSError, sqlite3.Error) as exc:
        raise unusable_database(database_url, exc=exc) from None


def _prepare_database(database_url: str) -> None:
    """Refuse a SQLite file another process serves (now, not in a traceback from the start of
    the services), then upgrade the schema; raises ConfigError or ClickException."""
    lock_file = serving_lock_file(database_url)
    if lock_file is not None:
        os.close(take_serving_lock(lock_file))
    _usable(database_url, serving=True)


def unusable_database(database_url: str, *, exc: BaseException) -> click.ClickException:
    """One line: the database (its password hidden) and the driver's first line of why."""
    cause = exc.orig if isinstance(exc, DBAPIError) else exc
    text = str(cause).strip()
    if text:
        reason = text.splitlines()[0]
    elif isinstance(cause, TimeoutError):
        reason = "no answer in time (TimeoutError)"
    else:
        reason = type(cause).__name__
    return click.ClickException(f"cannot use the database {shown_url(database_url)}: {reason}")


@click.group()
def main() -> None:
    """agent-runner: durable LLM agents over REST."""


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
def serve(host: str, *, port: int) -> None:
    """Upgrade the schema to the newest migration, then serve."""
    # Imported here: the app takes about a second to import, which `--help` and `migrate`
    # have no use for.
    from app.main import create_app
    from app.request_head import BoundedHeadProtocol

    settings = _settings()
    try:
        app = create_app(settings)
        refuse_an_address_in_use(host, port=port)
        _prepare_database(settings.database_url)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_config=None,
        access_log=False,  # app.logs.AccessLog writes one line per request instead
        http=BoundedHeadProtocol.with_head_timeout(settings.request_head_timeout_s),
        ws="none",  # no route is a WebSocket
        # uvicorn waits with asyncio.wait_for, which takes a fraction of a second too.
        timeout_graceful_shutdown=settings.shutdown_grace_s,  # type: ignore[arg-type]
    )
    DrainingServer(config, lifecycle=_lifecycle(app)).run()


def _lifecycle(app: FastAPI) -> Lifecycle:
    lifecycle: Lifecycle = app.state.lifecycle
    return lifecycle


@main.command()
def migrate() -> None:
    """Upgrade the schema to the newest migration and exit."""
    settings = _settings()
    try:
        _usable(settings.database_url)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc
    if settings.database_url == MEMORY_URL:
        click.echo(f"{MEMORY_URL} keeps nothing: it has no schema to migrate")
    else:
        click.echo("schema is at the newest migration")


def _stop_as_ctrl_c() -> None:
    """SIGTERM and SIGHUP stop the bench as Ctrl-C does, which cleans up (its server, its
    PostgreSQL schema, its temp folder): whatever handles SIGINT then handles them (asyncio.run
    cancels its task), or KeyboardInterrupt where SIGINT is ignored (a background job). A
    signal ignored already (SIGHUP under nohup) stays ignored.

    A KeyboardInterrupt raised while Python runs a finaliser or a weakref callback (garbage
    collection) is printed and dropped ("Exception ignored in …"), and the bench went on to
    its end: the signal is then sent again, to land once the callback has returned."""

    def stop(_signum: int, frame: FrameType | None) -> None:
        handler = signal.getsignal(signal.SIGINT)
        if not callable(handler):
            raise KeyboardInterrupt
        handler(signal.SIGINT, frame)

    def unraisable(error: sys.UnraisableHookArgs) -> None:
        if isinstance(error.exc_value, KeyboardInterrupt):
            # Later, from another thread: raised in here, it would be dropped again.
            threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGTERM)).start()
        else:
            default(error)

    for name in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(name) is not signal.SIG_IGN:
            signal.signal(name, stop)
    default = sys.unraisablehook
    sys.unraisablehook = unraisable


@main.command()
@click.option("--database-url", default=None, help="Default: a fresh SQLite file in a temp folder.")
@click.option("--sessions", default=30, show_default=True, type=click.IntRange(1))
@click.option("--warmup", default=5, show_default=True, type=click.IntRange(0))
@click.option("--steps", default=10, show_default=True, type=click.IntRange(1))
@click.option("--long-steps", default=200, show_default=True, type=click.IntRange(1))
@click.option("--concurrency", default=16, show_default=True, type=click.IntRange(1))
@click.option("--no-http", is_flag=True, help="Skip the figures through a real server.")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
def bench(
    database_url: str | None,
    *,
    sessions: int,
    warmup: int,
    steps: int,
    long_steps: int,
    concurrency: int,
    no_http: bool,
    as_json: bool,
) -> None:
    """Time the standard scenario (service layer and HTTP) and print the figures."""
    # Imported here so that serve and migrate never load the bench.
    from app.bench.report import render
    from app.bench.scenario import BenchError, BenchOptions
    from app.bench.suite import run_bench

    configure_logging("WARNING", fmt="text")
    if database_url is not None:
        try:
            database_url = check_database_url(database_url)
        except ConfigError as exc:
            raise click.BadParameter(str(exc), param_hint="--database-url") from None
    _stop_as_ctrl_c()
    options = BenchOptions(
        database_url=database_url,
        sessions=sessions,
        warmup=warmup,
        steps=steps,
        long_steps=long_steps,
        concurrency=concurrency,
        http=not no_http,
    )
    try:
        report = run_bench(options)
    except (BenchError, ConfigError) as exc:
        raise click.ClickException(str(exc)) from exc
    except ValidationError as exc:  # the service layer's settings: DATABASE_POOL_SIZE, …
        raise _invalid_environment(exc) from None
    except (
        DBAPIError,
        asyncpg.PostgresError,
        asyncpg.InterfaceError,
        OSError,
        sqlite3.Error,
    ) as exc:
        # database_url is None: the bench's own file, which is only ever made and used here.
        raise unusable_database(
            database_url or "sqlite:///<temp folder>/bench.db", exc=exc
        ) from None
    click.echo(report.to_json() if as_json else render(report))


def _stop_before_the_turn() -> None:
    """Until the turn's own handlers take over (app.cli_run.run_turn), a stop signal ends
    `run` at once, as a shell reports that signal: nothing of the turn has begun. Set first,
    before the service's modules load (seconds)."""

    def stop(signum: int, _frame: object) -> None:
        # Written straight to the file: the handler may have interrupted a write to stderr.
        os.write(2, f"stopped by {signal.Signals(signum).name} before the turn began\n".encode())
        # At once, not by SystemExit: raised in the middle of an import (pydantic-core, a
        # class body being made) it came out as a traceback, or was dropped and the turn ran.
        os._exit(128 + signum)

    for signum in STOP_SIGNALS:
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, stop)


@main.command()
@click.argument("agent")
@click.argument("message")
@click.option(
    "--session-id",
    help="Store the turn in DATABASE_URL under this session, new or known (a known one is"
    " resumed). Without it the turn is stateless and uses no database.",
)
@click.option("--user-id", help="The user a new session is bound to, or a known one serves.")
@click.option("--tenant", help="Act for this tenant, as a key of API_KEYS would.")
@click.option("--metadata", help="A JSON object, kept on the run (and on a new session).")
@click.option("--idempotency-key", help="Names this turn of the session: a retry replays it.")
@click.option("--json", "as_json", is_flag=True, help="Print the run as POST /v1/runs does.")
def run(
    agent: str,
    *,
    message: str,
    session_id: str | None,
    user_id: str | None,
    tenant: str | None,
    metadata: str | None,
    idempotency_key: str | None,
    as_json: bool,
) -> None:
    """Run one turn here, with no server, and print its answer.

    AGENT answers MESSAGE ('-': standard input, less its last newline) through the services
    `serve` would build on the same environment. Exits 0 if the run is complete; 1 if it
    ended otherwise or was refused; 2 for invalid options (what the API refuses as invalid
    too); 128 + N when signal N stopped it."""
    _stop_before_the_turn()
    # Imported here, as in serve: the services load the anthropic SDK.
    from app.cli_run import (
        Stops,
        checked_turn,
        print_run,
        read_message,
        run_turn,
        stopped,
    )

    settings = _settings(quiet=True)
    stops = Stops()
    if message == "-":
        message = read_message()
    try:
        turn = checked_turn(
            settings,
            fields={
                "agent": agent,
                "message": message,
                "session_id": session_id,
                "user_id": user_id,
            },
            metadata=metadata,
            idempotency_key=idempotency_key,
            tenant=tenant,
        )
        if session_id is None:  # stores nothing: no database to open, nor to share with a server
            settings = settings.model_copy(update={"database_url": MEMORY_URL})
        _prepare_database(settings.database_url)
        result = asyncio.run(run_turn(settings, turn=turn, stops=stops))
    except asyncio.CancelledError:
        stopped(stops, turn=turn)
    except SqliteFileBusy as exc:
        raise click.ClickException(
            f"another process is using this SQLite database (it holds {exc.lock_file}): send"
            " the turn to the server that serves it, or run it once the other `run` has ended"
        ) from None
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc
    except AppError as exc:  # refused, as the API would refuse it
        raise _refused(exc) from None
    except DATABASE_ERRORS as exc:  # the API's 503 for an outage; a bug's traceback otherwise
        if not is_outage(exc):
            raise
        raise _refused(unavailable(exc)) from None
    print_run(result, as_json=as_json)


def _refused(exc: AppError) -> click.ClickException:
    """A turn refused: its code and detail (and what the API's problem adds), exit 1."""
    extra = "".join(f" ({name}: {value})" for name, value in exc.extra.items() if value)
    return click.ClickException(f"{exc.code}: {exc.detail}{extra}")


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print them as JSON.")
def tools(*, as_json: bool) -> None:
    """Check the agents file and list its tools.

    The file is AGENTS_FILE, or the built-in examples; each tool is listed with the agents
    that use it. Exits 1, saying why, if the file would not serve."""
    from app.main import load_agents  # as in serve: the app's modules load the anthropic SDK
    from app.schemas.agents import ToolRead

    settings = _settings(quiet=True)
    try:
        registry = load_agents(settings)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc
    users = {
        name: [agent.name for agent in registry.agents.values() if name in agent.tools]
        for name in registry.tools
    }
    if as_json:
        listed = [
            {**ToolRead.of(tool).model_dump(mode="json"), "agents": users[tool.name]}
            for tool in registry.tools.values()
        ]
        click.echo(json.dumps(listed, indent=2))
        return
    rows = [("TOOL", "SAFE_TO_RETRY", "AGENTS", "DESCRIPTION")] + [
        (
            t.name,
            "yes" if t.safe_to_retry else "no",
            ",".join(users[t.name]) or "-",
            " ".join(t.description.split()),  # one line per tool
        )
        for t in registry.tools.values()
    ]
    widths = [max(len(row[column]) for row in rows) for column in range(3)]
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
        click.echo("  ".join([*cells, row[3]]))
