"""The FastAPI application and its lifespan."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

from fastapi import Depends, FastAPI
from starlette.types import Lifespan

from app.api import problems
from app.api.auth import ApiKeys, RequireApiKey
from app.api.deps import Services, bearer_scheme, get_tenant, plain_parameters
from app.api.document import finish_document, operation_id
from app.api.head import HeadAsGet
from app.api.limits import BodySizeLimit
from app.api.routes import agents, health, runs, sessions
from app.db.migrate import head_revision
from app.db.session import Database
from app.errors import ConfigError
from app.failpoints import Failpoints
from app.lifecycle import Lifecycle
from app.llm.base import LLMClient
from app.llm.router import ModelRouter
from app.llm.scripted import is_scripted, unknown_script
from app.logs import AccessLog
from app.metrics import Metrics
from app.services.health import HealthService
from app.services.ownership import LocalOwnership, Ownership, serving_lock_file
from app.services.pg_ownership import PostgresOwnership
from app.services.runner import AgentRunner
from app.services.runs import RunService
from app.services.sessions import SessionService
from app.settings import Settings
from app.tools.agents_file import load_registry
from app.tools.registry import ToolRegistry


def build_ownership(db: Database, *, settings: Settings) -> Ownership:
    """Advisory locks where replicas can share the store (PostgreSQL); in-process otherwise."""
    if db.dialect == "postgresql":
        return PostgresOwnership(
            settings.database_url,
            heartbeat_s=settings.session_heartbeat_s,
            takeover_after_s=settings.session_takeover_after_s,
        )
    # A SQLite file: this process must be the only one serving it.
    return LocalOwnership(lock_file=serving_lock_file(settings.database_url))


def create_app(settings: Settings | None = None, *, llm: LLMClient | None = None) -> FastAPI:
    """Build the app. The configuration (agents file, failpoints, API keys) is read here, so
    that `serve` refuses a bad one before it binds; the engine, the model client and
    ownership are created by the lifespan."""
    settings = settings or Settings()
    failpoints = Failpoints.parse(settings.failpoints)
    registry = load_agents(settings, own_model=llm is not None)
    # Set but empty is refused (ApiKeys.parse), not taken for unset: a deployment template
    # that lost its keys must not serve every tenant's data without one.
    api_keys = (
        ApiKeys.parse(settings.api_keys.get_secret_value())
        if settings.api_keys is not None
        else None
    )
    metrics = Metrics()
    lifecycle = Lifecycle()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with open_services(
            settings,
            registry=registry,
            failpoints=failpoints,
            llm=llm,
            metrics=metrics,
            lifecycle=lifecycle,
        ) as services:
            app.state.services = services
            yield

    app = _api(lifespan, api_keys=api_keys, lifecycle=lifecycle)
    app.state.lifecycle = lifecycle
    return app


@asynccontextmanager
async def open_services(
    settings: Settings,
    *,
    registry: ToolRegistry,
    failpoints: Failpoints,
    llm: LLMClient | None = None,
    metrics: Metrics,
    lifecycle: Lifecycle,
) -> AsyncIterator[Services]:
    """The engine, the model client, ownership and the services over them, for the app's
    lifespan and for the commands that run turns without a server (`run`, `bench`). On
    exit, the turns cut off finish their step, then each resource closes."""
    # Each resource is closed, in reverse order, once it exists: at the end, and when a
    # later step of the start fails.
    async with AsyncExitStack() as resources:
        db = await Database.connect(settings.database_url, pool_size=settings.database_pool_size)
        resources.push_async_callback(db.dispose)
        metrics.pool.watch(lambda: db.read_engine.pool)
        resources.push_async_callback(registry.aclose)
        model = llm or ModelRouter.from_settings(
            max_retries=settings.anthropic_max_retries,
            timeout_s=settings.anthropic_timeout_s,
            api_models=not all(is_scripted(a.model) for a in registry.agents.values()),
        )
        resources.push_async_callback(model.aclose)
        ownership = build_ownership(db, settings=settings)
        resources.push_async_callback(ownership.stop)  # copes with a start cut short
        await ownership.start()
        runner = AgentRunner(llm=model, registry=registry, metrics=metrics)
        run_service = RunService(db, registry, runner, failpoints, ownership, metrics)
        # Then: what a second signal left in flight ends before the rest closes under it.
        resources.push_async_callback(runner.cancel_steps)
        # First: the turns cut off use all the rest. A second signal stops the wait.
        resources.push_async_callback(lifecycle.unless_forced, run_service.settle)
        yield Services(
            registry=registry,
            runs=run_service,
            sessions=SessionService(db, ownership, metrics),
            health=HealthService(db, ownership, head_revision() if db.durable else None),
            metrics=metrics,
            lifecycle=lifecycle,
        )


def load_agents(settings: Settings, *, own_model: bool = False) -> ToolRegistry:
    """The agents file (AGENTS_FILE, or the built-in examples); raises ConfigError. Unless
    the caller brings its own model client, a `scripted:` model must name a built-in script."""
    registry = load_registry(settings.agents_file, max_result_bytes=settings.tool_result_max_bytes)
    if not own_model:
        _refuse_unknown_scripts(registry, agents_file=settings.agents_file)
    return registry


def _refuse_unknown_scripts(registry: ToolRegistry, *, agents_file: Path | None) -> None:
    source = agents_file or "the built-in example agents"
    problems = [
        f"{source}: agent {agent.name!r}: {problem}"
        for agent in registry.agents.values()
        if (problem := unknown_script(agent.model)) is not None
    ]
    if problems:
        raise ConfigError("\n".join(problems))


def _api(lifespan: Lifespan[FastAPI], *, api_keys: ApiKeys | None, lifecycle: Lifecycle) -> FastAPI:
    """The routes, error handlers and middleware."""
    app = FastAPI(
        title="agent-runner",
        version="1",
        summary="Runs LLM agents over REST with durable, at-most-once tool execution.",
        lifespan=lifespan,
        generate_unique_id_function=operation_id,
        # A path the API does not have is 404, also with a trailing slash (not a redirect).
        redirect_slashes=False,
        dependencies=[Depends(plain_parameters)],
    )
    problems.install(app)
    for module in (runs, sessions, agents):
        # get_tenant on every /v1 route, also those that do not use it: a route RequireApiKey
        # did not see fails instead of serving without a key.
        app.include_router(
            module.router, dependencies=[Depends(bearer_scheme), Depends(get_tenant)]
        )
    app.include_router(health.router)
    # The last added runs first: the key is checked before BodySizeLimit reads the body.
    app.add_middleware(BodySizeLimit, lifecycle=lifecycle)
    app.add_middleware(RequireApiKey, keys=api_keys, router=app.router)
    app.add_middleware(HeadAsGet)
    app.add_middleware(AccessLog)
    finish_document(app)
    return app
