"""Who may use a session, and which run is using it."""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timedelta

from app.db import models
from app.db.outages import read_again_if_disconnected
from app.db.repositories import RunRepository
from app.db.session import Database
from app.errors import SessionAccessDenied, SessionBusy, SessionNotFound
from app.services.ownership import ActiveRuns, Ownership

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
    db: Database, ownership: Ownership, busy: SessionBusy, session_id: str, *, since: datetime
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
                active = await runs.finished_since(session_id, since - CLOCK_SLACK)
        if active is not None or not held or time.monotonic() > deadline:
            return active
        await asyncio.sleep(0.02)
