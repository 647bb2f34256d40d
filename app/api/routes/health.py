"""Liveness and readiness."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST
from sqlalchemy import text

from app.api.deps import ServicesDep
from app.api.problems import problem_response, responses
from app.db.migrate import current_revision

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is alive."""
    return {"status": "ok"}


@router.get("/readyz", responses=responses(503))
async def readyz(services: ServicesDep) -> Any:
    """The database answers and its schema is at the newest migration."""
    if services.lifecycle.draining:
        return problem_response(
            status=503,
            code="shutting_down",
            title="Shutting down",
            detail="This replica is shutting down.",
        )
    try:
        async with services.db.engine.connect() as conn:
            await conn.execute(text("SELECT 1"))
            revision = await current_revision(conn) if services.db.durable else None
        await services.runs.ownership.ping()
    except Exception as exc:
        return problem_response(
            status=503,
            code="database_unavailable",
            title="Database unavailable",
            detail=f"The database cannot be reached ({type(exc).__name__}).",
        )
    if services.db.durable and revision != services.head_revision:
        return problem_response(
            status=503,
            code="schema_out_of_date",
            title="Schema out of date",
            detail=f"The schema is at {revision!r}, not {services.head_revision!r}; "
            "run `agent-runner migrate`.",
        )
    return JSONResponse({"status": "ready", "schema": revision})


@router.get("/metrics", response_class=PlainTextResponse)
async def get_metrics(services: ServicesDep) -> PlainTextResponse:
    """Prometheus text format."""
    return PlainTextResponse(services.metrics.render(), media_type=CONTENT_TYPE_LATEST)
