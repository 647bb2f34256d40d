"""Sessions, their history and runs."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Response

from app.api.deps import SessionServiceDep, TenantDep, UserId
from app.api.problems import responses
from app.errors import (
    DatabaseUnavailable,
    SessionAccessDenied,
    SessionBusy,
    SessionNotFound,
    Unauthorized,
    ValidationFailed,
)
from app.schemas.common import DEFAULT_PAGE, MAX_PAGE, Page
from app.schemas.runs import MessageRead, RunSummary
from app.schemas.sessions import SESSION_ID_PATTERN, SessionRead

router = APIRouter(prefix="/v1/sessions", tags=["sessions"])

# What a read of one session may answer instead.
SESSION_PROBLEMS = responses(
    Unauthorized, SessionAccessDenied, SessionNotFound, ValidationFailed, DatabaseUnavailable
)

SessionId = Annotated[str, Path(pattern=SESSION_ID_PATTERN)]
Limit = Annotated[int, Query(ge=1, le=MAX_PAGE)]
# A list's own next_after: opaque for sessions and runs, a message's seq for the history.
# Checked by the list (decode_cursor, decode_seq), not by a pattern here: any value that is
# not one is refused in the same words.
After = Annotated[
    str | None,
    Query(
        max_length=512,
        description="Opaque: a next_after this list returned (any other is 422).",
    ),
]
AfterSeq = Annotated[
    str | None,
    Query(
        max_length=512,
        description="A next_after of this list (a message's seq; any other is 422).",
    ),
]


@router.get("", responses=responses(Unauthorized, ValidationFailed, DatabaseUnavailable))
async def list_sessions(
    sessions: SessionServiceDep,
    *,
    tenant: TenantDep,
    agent: Annotated[str | None, Query(min_length=1, max_length=64)] = None,
    user_id: Annotated[str | None, Query(min_length=1, max_length=128)] = None,
    limit: Limit = DEFAULT_PAGE,
    after: After = None,
) -> Page[SessionRead]:
    """Sessions, most recently updated first."""
    return await sessions.list(
        tenant_id=tenant, agent=agent, user_id=user_id, after=after, limit=limit
    )


@router.get("/{session_id}", responses=SESSION_PROBLEMS)
async def get_session(
    session_id: SessionId, *, sessions: SessionServiceDep, tenant: TenantDep, user_id: UserId = None
) -> SessionRead:
    """One session and whether it is idle, running or waiting for a resume."""
    return await sessions.get(session_id, tenant_id=tenant, user_id=user_id)


@router.get("/{session_id}/messages", responses=SESSION_PROBLEMS)
async def list_messages(
    session_id: SessionId,
    *,
    sessions: SessionServiceDep,
    tenant: TenantDep,
    user_id: UserId = None,
    limit: Limit = DEFAULT_PAGE,
    after: AfterSeq = None,
) -> Page[MessageRead]:
    """The session's history in order."""
    return await sessions.messages(
        session_id, tenant_id=tenant, user_id=user_id, after=after, limit=limit
    )


@router.get("/{session_id}/runs", responses=SESSION_PROBLEMS)
async def list_session_runs(
    session_id: SessionId,
    *,
    sessions: SessionServiceDep,
    tenant: TenantDep,
    user_id: UserId = None,
    limit: Limit = DEFAULT_PAGE,
    after: After = None,
) -> Page[RunSummary]:
    """The session's runs, newest first."""
    return await sessions.runs(
        session_id, tenant_id=tenant, user_id=user_id, after=after, limit=limit
    )


@router.delete(
    "/{session_id}",
    status_code=204,
    response_class=Response,
    responses=responses(
        Unauthorized,
        SessionAccessDenied,
        SessionNotFound,
        SessionBusy,
        ValidationFailed,
        DatabaseUnavailable,
    ),
)
async def delete_session(
    session_id: SessionId, *, sessions: SessionServiceDep, tenant: TenantDep, user_id: UserId = None
) -> None:
    """Delete the session, its runs and messages."""
    await sessions.delete(session_id, tenant_id=tenant, user_id=user_id)
