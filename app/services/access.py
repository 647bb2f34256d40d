"""Who may use a session, which run is using it, and whether a run stored `running` still
has a runner."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime, timedelta
from typing import TypeVar

from app.db import models
from app.db.outages import read_again_if_disconnected
from app.db.repositories import RunRepository
from app.db.session import Database
from app.domain import RunStatus
from app.errors import SessionAccessDenied, SessionBusy, SessionNotFound
from app.schemas.runs import RunErrorRead, RunSummary, UsageRead
from app.services.ownership import ActiveRuns, Ownership

R = TypeVar("R")

CLOCK_SLACK = timedelta(seconds=1)  # how far replicas' clocks may disagree


def check_session_access(
    row: models.Session, *, tenant_id: str | None, user_id: str | None, for_turn: bool
) -> None:
    """Another tenant's session does not exist for the caller; another user's is forbidden.

    A session created with a user_id runs turns only for that user_id; other requests (GET,
    DELETE) that name no user_id act for the tenant, and those that name another are refused.
    """
    if row.tenant_id != tenant_id:
        raise SessionNotFound(row.id)
    if not for_turn and user_id is None:
        return
    if row.user_id is not None and row.user_id != user_id:
        raise SessionAccessDenied(row.id)


@read_again_if_disconnected
async def active_run(
    db: Database, *, ownership: Ownership, busy: SessionBusy, session_id: str, since: datetime
) -> str | None:
    """The run that holds the session (or held it at `since`): what the 409 for `busy` names.

    This process knows its own runs (`busy` names them); another runner's is read from the
    store.
    That runner stores its run just after taking the session, so while the session is held
    and no run shows `running`, wait for it (up to ActiveRuns.SETTLE_WAIT_S); once nobody
    holds it, the holder has finished: the run that finished last, if after `since` (less a
    second for clocks of other replicas), is the one that was active."""
    known: str | None = busy.extra.get("active_run_id")
    if known is not None:
        return known
    deadline = time.monotonic() + ActiveRuns.SETTLE_WAIT_S
    while True:
        held = await ownership.is_held(session_id)
        async with db.reads.begin() as session:
            runs = RunRepository(session)
            active = await runs.latest_running(session_id)
            if active is None and not held:
                active = await runs.finished_since(session_id, moment=since - CLOCK_SLACK)
        if active is not None or not held or time.monotonic() > deadline:
            return active
        await asyncio.sleep(0.02)


async def read_runs_owned(
    ownership: Ownership,
    *,
    read: Callable[[], Awaitable[R]],
    runs_of: Callable[[R], Sequence[models.Run]],
) -> tuple[R, set[str]]:
    """`read()`, which reads some runs of one session (`runs_of`), and the ids of those of
    them stored `running` whose runner is gone (`run_summary` shows them `interrupted`).

    Whether a runner holds the session is asked only when a run read `running` (on
    PostgreSQL a statement on ownership's own connection), and after the read: a turn that
    ended between the two would look dead. So when nobody holds the session, it is read
    again, and only a run `running` both times is one whose runner died; one `running` only
    in the second read started after the question."""
    result = await read()
    runs = runs_of(result)
    running = {r.id for r in runs if r.status == RunStatus.RUNNING.value}
    if not running or await ownership.is_held(runs[0].session_id):
        return result, set()
    result = await read()
    return result, {
        r.id for r in runs_of(result) if r.status == RunStatus.RUNNING.value and r.id in running
    }


def run_summary(run: models.Run, *, ownerless: bool) -> RunSummary:
    """A stored run without messages; `running` with no runner (`ownerless`) is `interrupted`."""
    status = RunStatus(run.status)
    if status is RunStatus.RUNNING and ownerless:
        status = RunStatus.INTERRUPTED
    return RunSummary(
        run_id=run.id,
        session_id=run.session_id,
        agent=run.agent,
        status=status,
        response=run.response,
        iterations=run.iterations,
        usage=UsageRead(input_tokens=run.input_tokens, output_tokens=run.output_tokens),
        error=RunErrorRead.of(run.error_type, message=run.error_message),
        stop_reason=run.stop_reason,
        metadata=run.metadata_ or {},
        created_at=run.created_at,
        finished_at=run.finished_at,
    )
