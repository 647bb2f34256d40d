"""Liveness and readiness."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST

from app.api.deps import ServicesDep
from app.api.problems import responses
from app.errors import DatabaseUnavailable, SchemaOutOfDate, ShuttingDown
from app.schemas.common import Health, Readiness

router = APIRouter(tags=["health"])


@router.get("/healthz", responses=responses())
async def healthz() -> Health:
    """The process is alive."""
    return Health(status="ok")


@router.get("/readyz", responses=responses(DatabaseUnavailable, SchemaOutOfDate, ShuttingDown))
async def readyz(services: ServicesDep) -> Readiness:
    """The database answers and its schema is at the newest migration."""
    if services.lifecycle.draining:
        raise ShuttingDown("This replica is shutting down.")
    return Readiness(status="ready", schema_revision=await services.health.readiness())


@router.get("/metrics", response_class=PlainTextResponse, responses=responses())
async def get_metrics(services: ServicesDep) -> PlainTextResponse:
    """Prometheus text format."""
    return PlainTextResponse(services.metrics.render(), media_type=CONTENT_TYPE_LATEST)
