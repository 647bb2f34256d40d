"""Agents and their tools as the API shows them."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from app.tools.base import AgentConfig, Tool


class ToolRead(BaseModel):
    name: str
    description: str
    input_schema: dict[str, Any]
    safe_to_retry: bool
    parallel: bool

    @classmethod
    def of(cls, tool: Tool) -> ToolRead:
        """The API shape of a configured tool."""
        return cls(
            name=tool.name,
            description=tool.description,
            input_schema=tool.input_schema,
            safe_to_retry=tool.safe_to_retry,
            parallel=tool.parallel,
        )


class AgentRead(BaseModel):
    name: str
    description: str | None
    model: str
    max_iterations: int
    tools: list[ToolRead]

    @classmethod
    def of(cls, agent: AgentConfig, *, tools: list[Tool]) -> AgentRead:
        """The API shape of an agent."""
        return cls(
            name=agent.name,
            description=agent.description,
            model=agent.model,
            max_iterations=agent.max_iterations,
            tools=[ToolRead.of(t) for t in tools],
        )
