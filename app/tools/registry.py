"""The tool registry: the configured tools and agents, and safe tool dispatch.

app/tools/agents_file.py builds it from the agents file.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import Collection, Mapping
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match
from referencing import Registry

from app.domain import ToolCall, ToolResult, truncated_result
from app.errors import AgentNotFound
from app.tools.base import (
    DEFAULT_MAX_RESULT_BYTES,
    AgentConfig,
    ResultTooLarge,
    Tool,
    ToolContext,
    ToolFailed,
)
from app.tools.http import SharedHttpClient

log = logging.getLogger(__name__)

# jsonschema messages quote the offending value, which can be arbitrarily large.
MAX_ERROR_CHARS = 500


class ToolRegistry:
    """Configured tools and agents; `execute` turns any tool outcome into a ToolResult."""

    def __init__(
        self,
        tools: Mapping[str, Tool],
        *,
        agents: Mapping[str, AgentConfig],
        http: SharedHttpClient | None = None,
        max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES,
    ) -> None:
        self.tools: dict[str, Tool] = dict(tools)
        self.agents: dict[str, AgentConfig] = dict(agents)
        self._http = http or SharedHttpClient(max_body_bytes=max_result_bytes)
        self.max_result_bytes = max_result_bytes
        # Compiled once here, not per call: validator construction resolves the schema.
        self._validators = {
            name: _validator(tool.input_schema) for name, tool in self.tools.items()
        }

    def agent(self, name: str) -> AgentConfig:
        """The agent called `name`; raises AgentNotFound."""
        try:
            return self.agents[name]
        except KeyError:
            raise AgentNotFound(name) from None

    def tools_for(self, agent: AgentConfig) -> list[Tool]:
        """The agent's tools, in the order its configuration lists them."""
        return [self.tools[name] for name in agent.tools if name in self.tools]

    def tool(self, name: str) -> Tool | None:
        """The tool called `name`, or None."""
        return self.tools.get(name)

    async def execute(
        self, call: ToolCall, *, ctx: ToolContext, allowed: Collection[str]
    ) -> ToolResult:
        """Validate and run one call; every failure becomes an error result (it raises only
        CancelledError, when the run itself is cancelled). A result past `max_result_bytes`
        is kept truncated."""
        limit = self.max_result_bytes
        try:
            result = await self._execute(call, ctx=ctx, allowed=allowed)
        except ResultTooLarge as exc:
            result = truncated_result(
                ToolResult(call.id, call.name, ""), limit=limit, head=exc.head
            )
        else:
            # A character is at most 4 bytes: most results are measured without encoding.
            if len(result.content) * 4 <= limit or len(result.content.encode()) <= limit:
                return result
            result = truncated_result(result, limit=limit)
        log.warning(
            "tool result over TOOL_RESULT_MAX_BYTES kept truncated",
            extra={"tool_name": call.name, "tool_call_id": call.id, "run_id": ctx.run_id},
        )
        return result

    async def _execute(
        self, call: ToolCall, *, ctx: ToolContext, allowed: Collection[str]
    ) -> ToolResult:
        tool = self.tools.get(call.name) if call.name in allowed else None
        if tool is None:
            return ToolResult.error(call, message=f"unknown tool {call.name!r}")
        problem = self._invalid_arguments(tool, call=call)
        if problem is not None:
            return ToolResult.error(call, message=problem)
        extra = {"tool_name": call.name, "tool_call_id": call.id, "run_id": ctx.run_id}
        try:
            async with asyncio.timeout(tool.timeout_s) as deadline:
                # A copy: the call is stored as it came and sent back to the model with the
                # history, so a handler changing its arguments must not change them there.
                value = await tool.handler(copy.deepcopy(call.arguments), ctx)
        except ResultTooLarge:
            raise
        except ToolFailed as exc:
            # The error text can carry a downstream body, which is never logged.
            log.info("tool failed", extra=extra)
            return ToolResult.error(call, message=str(exc) or "tool failed")
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError) and _cancelled():
                raise  # the run itself is being cancelled, not a handler failing
            if isinstance(exc, TimeoutError) and deadline.expired():
                log.warning("tool timed out", extra=extra)
                return ToolResult.error(
                    call,
                    message=f"tool {call.name!r} did not finish within {tool.timeout_s:g}s and was"
                    " stopped; it may or may not have taken effect",
                )
            # A handler bug (even one raising SystemExit, CancelledError or a BaseException of
            # its own) must not end the run; the model reads it. Raised from anywhere in the
            # handler (an HTTP tool out of memory reading its answer), it says nothing of what
            # the call did before: the model must not take it for "nothing happened".
            log.warning("tool handler raised", exc_info=True, extra=extra)
            message = str(exc)
            name = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
            return ToolResult.error(call, message=f"{name}; it may or may not have taken effect")
        try:
            return ToolResult.ok(call, value=value)
        except (TypeError, ValueError, RecursionError) as exc:
            log.warning("tool returned a non-JSON value", extra=extra)
            return ToolResult.error(
                call,
                message=f"tool {call.name!r} returned a value that is not JSON-serialisable:"
                f" {exc}; it ran to its end, so it may have taken effect",
            )

    def _invalid_arguments(self, tool: Tool, *, call: ToolCall) -> str | None:
        validator = self._validators[tool.name]
        try:
            error = best_match(validator.iter_errors(call.arguments))
        except Exception as exc:  # a broken schema must not make execute() raise
            log.warning("input_schema of tool %r failed", tool.name, exc_info=True)
            return f"cannot validate arguments for tool {tool.name!r}: {exc}"
        if error is None:
            return None
        where = f" (at {error.json_path})" if error.absolute_path else ""
        message = _truncate(error.message, limit=MAX_ERROR_CHARS)
        return f"invalid arguments for tool {tool.name!r}: {message}{where}"

    async def aclose(self) -> None:
        """Close the shared HTTP client."""
        await self._http.aclose()


def _validator(schema: dict[str, Any]) -> Draft202012Validator:
    """A validator resolving `$ref`s inside the schema only: without a registry of its own,
    jsonschema fetches remote references over the network at validation time, blocking the
    event loop."""
    return Draft202012Validator(schema, registry=Registry())


def _cancelled() -> bool:
    """Whether this task has been asked to stop (not merely seen a CancelledError)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _truncate(text: str, *, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
