"""POST /v1/runs, GET /v1/runs/{run_id}."""

from __future__ import annotations

from fastapi import APIRouter

from app.api.deps import RunServiceDep, TenantDep
from app.api.problems import responses
from app.schemas.runs import RunCreate, RunRead

router = APIRouter(prefix="/v1/runs", tags=["runs"])


@router.post("", responses=responses(401, 403, 404, 409, 413, 422, 503))
async def create_run(body: RunCreate, runs: RunServiceDep, tenant: TenantDep) -> RunRead:
    """Run one turn of an agent and answer when it ends."""
    return await runs.create(body, tenant_id=tenant)


@router.get("/{run_id}", responses=responses(401, 404, 503))
async def get_run(run_id: str, runs: RunServiceDep, tenant: TenantDep) -> RunRead:
    """A stored run with the messages of its turn."""
    return await runs.get(run_id, tenant_id=tenant)
