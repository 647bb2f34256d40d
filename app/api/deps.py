"""Request dependencies: the services built by the lifespan, the caller's tenant, the
request checks every route shares (parameters sent once), and the shutdown `Lifecycle`."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, Query, Request
from fastapi.dependencies.models import Dependant
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from fastapi.security import HTTPBearer

from app.errors import ShuttingDown
from app.metrics import Metrics
from app.services.health import HealthService
from app.services.runs import RunService
from app.services.sessions import SessionService
from app.tools.registry import ToolRegistry


@dataclass
class Lifecycle:
    """Process state the routes consult: `draining` once shutdown has begun (`drain`)."""

    draining: bool = False
    # Requests waiting for more of their body (BodySizeLimit): shutdown cancels the wait.
    _uploads: set[asyncio.Task[Any]] = field(default_factory=set, init=False, repr=False)
    # Set by a second signal: stop at once, steps in flight and all (`force`).
    _forced: asyncio.Event = field(default_factory=asyncio.Event, init=False, repr=False)

    def drain(self) -> None:
        """Shutdown begins. Called from a signal handler, on the event loop's thread: the
        waits are cancelled by the loop itself, as a signal handler must not touch tasks."""
        self.draining = True
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop runs: nothing waits
            return
        loop.call_soon_threadsafe(self._cut_uploads)

    def _cut_uploads(self) -> None:
        for task in self._uploads:
            task.cancel()

    def force(self) -> None:
        """A second signal: shutdown no longer waits for the steps in flight (their calls'
        results are then lost, as at a crash). From a signal handler, as `drain`."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        loop.call_soon_threadsafe(self._forced.set)

    async def unless_forced(self, wait: Callable[[], Awaitable[None]]) -> None:
        """Wait for `wait()`, or until a second signal."""
        waiting = asyncio.ensure_future(wait())
        forced = asyncio.ensure_future(self._forced.wait())
        try:
            await asyncio.wait({waiting, forced}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiting.cancel()
            forced.cancel()

    def cancelled_by_shutdown(self) -> bool:
        """Called on a CancelledError: whether shutdown caused it (uvicorn's cancel at the end
        of the grace, or `drain` cutting a wait for a body). If so the cancellation is taken
        back, so that the request can still be answered a 503 problem."""
        task = asyncio.current_task()
        if not self.draining or task is None:
            return False
        task.uncancel()
        return True

    @contextmanager
    def awaiting_body(self) -> Iterator[None]:
        """Around a wait for more of the request's body: shutdown cancels it."""
        task = asyncio.current_task()
        if task is None:
            yield
            return
        self._uploads.add(task)
        try:
            yield
        finally:
            self._uploads.discard(task)


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
