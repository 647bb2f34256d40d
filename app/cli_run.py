"""`agent-runner run`: one turn from the shell, with no server.

The turn is checked as POST /v1/runs checks it (body, 1 MiB, Idempotency-Key), acts for a
tenant as a key of API_KEYS would, and runs through the services `serve` builds on the same
environment. A signal stops it as it stops a server: the tool-call step in flight is finished
and stored first; a second signal stops at once.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import sys
from dataclasses import dataclass, field
from typing import Any, NoReturn

import click
from pydantic import ValidationError

from app.api.auth import ApiKeys
from app.api.limits import MAX_BODY_BYTES
from app.cli import STOP_SIGNALS, validation_problem
from app.failpoints import Failpoints
from app.lifecycle import Lifecycle
from app.main import load_agents, open_services
from app.metrics import Metrics
from app.schemas.runs import IDEMPOTENCY_KEY_MAX_LENGTH, IDEMPOTENCY_KEY_PATTERN, RunCreate
from app.services.runs import RunResult
from app.settings import Settings


@dataclass(frozen=True)
class Turn:
    """What `run` was asked to do, checked."""

    body: RunCreate
    idempotency_key: str | None
    tenant_id: str | None


def invalid(why: str) -> click.UsageError:
    """A turn the API would refuse as invalid (422 there): a usage error here, exit 2."""
    return click.UsageError(f"validation_error: {why}")


def checked_turn(
    settings: Settings,
    *,
    fields: dict[str, Any],
    metadata: str | None,
    idempotency_key: str | None,
    tenant: str | None,
) -> Turn:
    """The turn `run` was asked for, refused (exit 2) where POST /v1/runs would refuse it."""
    given = {name: value for name, value in fields.items() if value is not None}
    if metadata is not None:
        try:
            given["metadata"] = json.loads(metadata)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested past reading
            why = exc if isinstance(exc, ValueError) else "nests too deeply to read"
            raise invalid(f"metadata: not valid JSON ({why})") from None
    try:
        body = RunCreate.model_validate(given)
    except ValidationError as exc:
        problems = (
            validation_problem(e["loc"], msg=e["msg"], variable=False) for e in exc.errors()
        )
        raise invalid("; ".join(problems)) from None
    # The smallest body a client could send for it: compact, UTF-8 as it is.
    compact = json.dumps(
        body.model_dump(mode="json", exclude_unset=True), ensure_ascii=False, separators=(",", ":")
    )
    size = len(compact.encode())
    if size > MAX_BODY_BYTES:
        raise click.UsageError(
            f"payload_too_large: as a POST /v1/runs body the turn is {size} bytes, over the"
            f" {MAX_BODY_BYTES} bytes (1 MiB) a request may carry"
        )
    if idempotency_key is not None:
        if body.session_id is None:
            raise invalid("--idempotency-key names a turn of a session: give --session-id")
        if len(idempotency_key) > IDEMPOTENCY_KEY_MAX_LENGTH or not re.fullmatch(
            IDEMPOTENCY_KEY_PATTERN, idempotency_key
        ):
            raise invalid(
                f"--idempotency-key: 1 to {IDEMPOTENCY_KEY_MAX_LENGTH} printable ASCII"
                " characters, no spaces"
            )
    return Turn(body, idempotency_key, _tenant(settings, tenant=tenant))


def _tenant(settings: Settings, *, tenant: str | None) -> str | None:
    """The tenant to act for: one that a key of API_KEYS is for, as the API would take it;
    none while API_KEYS is unset (the service then has no tenants)."""
    if settings.api_keys is None:
        if tenant is not None:
            raise click.UsageError("--tenant: API_KEYS is unset, so the service has no tenants")
        return None
    # Refused as serve refuses it (app.main.create_app), ConfigError.
    keys = ApiKeys.parse(settings.api_keys.get_secret_value())
    if tenant is None:
        raise click.UsageError("API_KEYS is set: name the tenant to act for with --tenant")
    if tenant not in keys.tenants:
        raise click.UsageError(f"--tenant: no key of API_KEYS is for tenant {tenant!r}")
    return tenant


def read_message() -> str:
    """MESSAGE '-': standard input, less the newline `echo` ends it with (LF or CRLF). Read
    no further than a body may carry (a character more says it is over): `yes |` would fill
    the memory with a turn the limit then refuses."""
    if sys.stdin is None:
        raise click.UsageError("MESSAGE is '-', but standard input is closed")
    text = sys.stdin.read(MAX_BODY_BYTES + 1)
    return text.removesuffix("\n").removesuffix("\r") if text.endswith("\n") else text


@dataclass
class Stops:
    """The stop signals received while the turn ran."""

    received: list[int] = field(default_factory=list)

    @property
    def forced(self) -> bool:
        """A second signal: the step in flight was not waited for."""
        return len(self.received) > 1


async def run_turn(settings: Settings, *, turn: Turn, stops: Stops) -> RunResult:
    """One turn through the services a server of these settings would build; raises what the
    service raises, and CancelledError once a stop signal has ended it."""
    lifecycle = Lifecycle()
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()

    def stop(signum: int) -> None:
        stops.received.append(signum)
        if stops.forced:
            lifecycle.force()  # as a server's second signal: no more waiting for the step
        task.cancel()

    for signum in STOP_SIGNALS:
        if signal.getsignal(signum) is not signal.SIG_IGN:  # nohup, a background job's SIGINT
            loop.add_signal_handler(signum, stop, signum)
    async with open_services(
        settings,
        registry=load_agents(settings),
        failpoints=Failpoints.parse(settings.failpoints),
        metrics=Metrics(),
        lifecycle=lifecycle,
    ) as services:
        return await services.runs.create(
            turn.body, tenant_id=turn.tenant_id, idempotency_key=turn.idempotency_key
        )


def stopped(stops: Stops, *, turn: Turn) -> NoReturn:
    """Say how a signal stopped the turn, and exit as a shell reports that signal."""
    first = signal.Signals(stops.received[0])
    if turn.body.session_id is None:
        said = f"stopped by {first.name}: a stateless turn stores nothing"
    elif stops.forced:
        said = (
            "stopped at once by a second signal: the results of the step in flight, if any,"
            " are lost (on resume its calls get the durability error, or run again if safe"
            " to retry)"
        )
    else:
        said = (
            f"stopped by {first.name}: every step the turn began is stored; run the turn again"
            " (its --session-id, and --idempotency-key) to resume it"
        )
    click.echo(said, err=True)
    sys.exit(128 + first)


def print_run(result: RunResult, *, as_json: bool) -> None:
    """The answer on standard output; on standard error, a replay and a run not complete
    (exit 1)."""
    run = result.run
    if as_json:
        click.echo(run.model_dump_json(indent=2))
    elif run.response:
        click.echo(run.response)
    if result.replayed:
        click.echo(f"run {run.run_id}: replayed from its record", err=True)
    if run.status.value != "complete":
        why = f": {run.error.type}: {run.error.message}" if run.error is not None else ""
        click.echo(f"run {run.run_id} ended {run.status.value}{why}", err=True)
        sys.exit(1)
