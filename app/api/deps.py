"""Request dependencies: the services built by the lifespan, the caller's tenant, and the
request checks every route shares (parameters sent once)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Query, Request
from fastapi.dependencies.models import Dependant
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from fastapi.security import HTTPBearer

from app.errors import ShuttingDown
from app.lifecycle import Lifecycle
from app.metrics import Metrics
from app.services.health import HealthService
from app.services.runs import RunService
from app.services.sessions import SessionService
from app.tools.registry import ToolRegistry


@dataclass
class Services:
    """What the lifespan builds once and every request shares."""

    registry: ToolRegistry
    runs: RunService
    sessions: SessionService
    health: HealthService
    metrics: Metrics
    lifecycle: Lifecycle


def get_services(request: Request) -> Services:
    """The services of this app instance."""
    services: Services = request.app.state.services
    return services


ServicesDep = Annotated[Services, Depends(get_services)]


def get_run_service(services: ServicesDep) -> RunService:
    """The run service."""
    return services.runs


def get_session_service(services: ServicesDep) -> SessionService:
    """The session service."""
    return services.sessions


def get_registry(services: ServicesDep) -> ToolRegistry:
    """The agents and tools."""
    return services.registry


# Declares the bearer scheme in /openapi.json; the key itself is checked before any parsing,
# by app.api.auth.RequireApiKey.
bearer_scheme = HTTPBearer(
    auto_error=False, description="An API key from API_KEYS; needed only where API_KEYS is set."
)


def get_tenant(request: Request) -> str | None:
    """The caller's tenant, as RequireApiKey found it; None while API_KEYS is unset (a
    single-tenant service)."""
    state = request.scope.get("state", {})
    if "tenant" not in state:  # a /v1 route RequireApiKey did not see: never act as no tenant
        raise RuntimeError(f"RequireApiKey did not run for {request.url.path}")
    tenant: str | None = state["tenant"]
    return tenant


RunServiceDep = Annotated[RunService, Depends(get_run_service)]
SessionServiceDep = Annotated[SessionService, Depends(get_session_service)]
RegistryDep = Annotated[ToolRegistry, Depends(get_registry)]
TenantDep = Annotated[str | None, Depends(get_tenant)]
# On the read and delete routes: the user a request acts for (none: for the tenant).
UserId = Annotated[
    str | None,
    Query(
        min_length=1,
        max_length=128,
        description=(
            "Act as this user: a session, or a run of one, created with another user_id"
            " answers 403."
        ),
    ),
]


def _invalid(where: str, *, name: str, msg: str) -> dict[str, object]:
    """One entry of a 422's `errors`, as FastAPI's own validation writes them."""
    return {"loc": (where, name), "msg": msg, "type": "value_error"}


async def plain_parameters(request: Request) -> None:
    """Path and query values the handlers can trust, on every store alike (422 otherwise):
    none holds NUL (PostgreSQL text cannot hold the character, so it must never reach a
    query), and no query parameter comes twice (each takes one value: the router would
    read the last, a proxy perhaps the first). A query parameter the route does not take
    is ignored, as FastAPI ignores it."""
    route = request.scope.get("route")
    taken = set(_query_names(route.dependant)) if isinstance(route, APIRoute) else set()
    query = [(name, value) for name, value in request.query_params.multi_items() if name in taken]
    errors = [
        _invalid(where, name=name, msg="must not contain NUL characters")
        for where, items in (("path", request.path_params.items()), ("query", query))
        for name, value in items
        if "\x00" in str(value)
    ]
    counts = Counter(name for name, _ in query)
    errors += [
        _invalid("query", name=name, msg="must be sent once")
        for name in sorted(name for name, count in counts.items() if count > 1)
    ]
    if errors:
        raise RequestValidationError(errors)


def _query_names(dependant: Dependant) -> Iterator[str]:
    """The query parameters a route's handler and its dependencies take."""
    yield from (field.alias for field in dependant.query_params)
    for sub in dependant.dependencies:
        yield from _query_names(sub)


def one_idempotency_key(request: Request) -> None:
    """Two Idempotency-Key headers name no one turn: refused, not read as the first."""
    if len(request.headers.getlist("idempotency-key")) > 1:
        raise RequestValidationError(
            [_invalid("header", name="Idempotency-Key", msg="must be sent once")]
        )


def cut_off(lifecycle: Lifecycle) -> ShuttingDown | None:
    """Called on the cancellation of a run: what to answer if shutdown cut it off.

    When SHUTDOWN_GRACE_S is over, uvicorn cancels the requests still running and would
    answer them with its plain-text 500; a cut-off run is a 503 problem instead (the turn
    resumes as after a crash).
    """
    if not lifecycle.cancelled_by_shutdown():
        return None
    return ShuttingDown(
        "This replica shut down before it could answer. Resubmit the same session_id (and"
        " Idempotency-Key, which answers a finished run from its record) to resume it: every"
        " step it finished is stored."
    )
