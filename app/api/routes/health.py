"""Liveness and readiness."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST
from sqlalchemy import text

from app.api.deps import ServicesDep
from app.api.problems import responses
from app.db.migrate import current_revision
from app.errors import DatabaseUnavailable, SchemaOutOfDate, ShuttingDown
from app.schemas.common import Readiness

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is alive."""
    return {"status": "ok"}


@router.get("/readyz", responses=responses(503))
async def readyz(services: ServicesDep) -> Readiness:
    """The database answers and its schema is at the newest migration."""
    if services.lifecycle.draining:
        raise ShuttingDown("This replica is shutting down.")
    try:
        async with services.db.engine.connect() as conn:
            await conn.execute(text("SELECT 1"))
            revision = await current_revision(conn) if services.db.durable else None
        await services.runs.ownership.ping()
    except Exception as exc:
        raise DatabaseUnavailable(
            f"The database cannot be reached ({type(exc).__name__})."
        ) from exc
    if services.db.durable and revision != services.head_revision:
        raise SchemaOutOfDate(
            f"The schema is at {revision!r}, not {services.head_revision!r}; "
            "run `agent-runner migrate`."
        )
    return Readiness(status="ready", schema_revision=revision)


@router.get("/metrics", response_class=PlainTextResponse)
async def get_metrics(services: ServicesDep) -> PlainTextResponse:
    """Prometheus text format."""
    return PlainTextResponse(services.metrics.render(), media_type=CONTENT_TYPE_LATEST)
