"""POST /v1/runs, GET /v1/runs/{run_id}."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Response
from pydantic import WithJsonSchema

from app.api.deps import (
    RunServiceDep,
    ServicesDep,
    TenantDep,
    UserId,
    cut_off,
    one_idempotency_key,
)
from app.api.problems import responses
from app.errors import (
    AgentNotFound,
    DatabaseUnavailable,
    IdempotencyKeyReused,
    MemoryStoreNotDurable,
    PayloadTooLarge,
    RunNotFound,
    SessionAccessDenied,
    SessionAgentMismatch,
    SessionBusy,
    SessionNotFound,
    ShuttingDown,
    Unauthorized,
    ValidationFailed,
)
from app.schemas.runs import (
    IDEMPOTENCY_KEY_MAX_LENGTH,
    IDEMPOTENCY_KEY_PATTERN,
    RunCreate,
    RunRead,
)

router = APIRouter(prefix="/v1/runs", tags=["runs"])

IdempotencyKey = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        min_length=1,
        max_length=IDEMPOTENCY_KEY_MAX_LENGTH,
        pattern=IDEMPOTENCY_KEY_PATTERN,
        description="Names one turn of the session: a retry replays or continues it. Only with"
        " a session_id: without one the request is 422 validation_error.",
    ),
    # An optional header is absent, never null: a generated client must not offer to send None.
    WithJsonSchema(
        {
            "type": "string",
            "minLength": 1,
            "maxLength": IDEMPOTENCY_KEY_MAX_LENGTH,
            "pattern": IDEMPOTENCY_KEY_PATTERN,
        }
    ),
]

# OpenAPI links: where a run's ids lead (tools that walk the API, schemathesis among them,
# follow these). A stateless run is not stored and has no session: they lead nowhere from it.
_DURABLE_ONLY = "For a durable run only: a stateless one is not stored (session_id null)."
RUN_LINKS = {
    "GetRun": {
        "operationId": "get_run",
        "parameters": {"run_id": "$response.body#/run_id"},
        "description": _DURABLE_ONLY,
    },
    **{
        name: {
            "operationId": operation,
            "parameters": {"session_id": "$response.body#/session_id"},
            "description": _DURABLE_ONLY,
        }
        for name, operation in (
            ("GetSession", "get_session"),
            ("ListMessages", "list_messages"),
            ("ListSessionRuns", "list_session_runs"),
            ("DeleteSession", "delete_session"),
        )
    },
}


@router.post(
    "",
    dependencies=[Depends(one_idempotency_key)],
    responses=responses(
        Unauthorized,
        SessionAccessDenied,
        AgentNotFound,
        SessionNotFound,
        SessionBusy,
        SessionAgentMismatch,
        MemoryStoreNotDurable,
        PayloadTooLarge,
        ValidationFailed,
        IdempotencyKeyReused,
        DatabaseUnavailable,
        ShuttingDown,
    )
    | {
        200: {
            "headers": {"Idempotent-Replayed": {"schema": {"type": "string"}}},
            "links": RUN_LINKS,
        }
    },
)
async def create_run(
    body: RunCreate,
    *,
    response: Response,
    services: ServicesDep,
    tenant: TenantDep,
    idempotency_key: IdempotencyKey = None,
) -> RunRead:
    """Run one turn of an agent and answer when it ends."""
    if services.lifecycle.draining:  # shutting down: no new run, but a recorded one's answer
        replay = await services.runs.replay_recorded(
            body, tenant_id=tenant, idempotency_key=idempotency_key
        )
        if replay is None:
            raise ShuttingDown()
        response.headers["Idempotent-Replayed"] = "true"
        return replay.run
    try:
        result = await services.runs.create(body, tenant_id=tenant, idempotency_key=idempotency_key)
    except asyncio.CancelledError:
        if (shutdown := cut_off(services.lifecycle)) is None:
            raise
        raise shutdown from None
    if result.replayed:
        response.headers["Idempotent-Replayed"] = "true"
    return result.run


@router.get(
    "/{run_id}",
    responses=responses(
        Unauthorized, SessionAccessDenied, RunNotFound, ValidationFailed, DatabaseUnavailable
    )
    | {200: {"links": RUN_LINKS}},
)
async def get_run(
    run_id: str, *, runs: RunServiceDep, tenant: TenantDep, user_id: UserId = None
) -> RunRead:
    """A stored run with the messages of its turn."""
    return await runs.get(run_id, tenant_id=tenant, user_id=user_id)
