"""The configured agents and their tools."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from app.api.deps import RegistryDep
from app.api.problems import responses
from app.errors import AgentNotFound, Unauthorized, ValidationFailed
from app.schemas.agents import AgentRead
from app.schemas.common import DEFAULT_PAGE, MAX_PAGE, Page, next_after

router = APIRouter(prefix="/v1/agents", tags=["agents"])


@router.get("", responses=responses(Unauthorized, ValidationFailed))
async def list_agents(
    registry: RegistryDep,
    *,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = DEFAULT_PAGE,
    after: Annotated[str | None, Query(max_length=64)] = None,
) -> Page[AgentRead]:
    """Agents in name order."""
    names = sorted(n for n in registry.agents if after is None or n > after)
    page = names[:limit]
    data = [
        AgentRead.of(registry.agents[n], tools=registry.tools_for(registry.agents[n])) for n in page
    ]
    return Page(data=data, next_after=next_after(page, more=len(names) > limit, cursor=str))


@router.get("/{name}", responses=responses(Unauthorized, AgentNotFound, ValidationFailed))
async def get_agent(name: str, *, registry: RegistryDep) -> AgentRead:
    """One agent and its tools."""
    agent = registry.agent(name)
    return AgentRead.of(agent, tools=registry.tools_for(agent))
