"""The tool interface the runner dispatches through."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from app.llm.base import ToolSpec


@dataclass(frozen=True, slots=True)
class ToolContext:
    """What a handler knows about the call it serves.

    `idempotency_key` is `<session_id or run_id>:<tool_call_id>`; HTTP tools send it as the
    `Idempotency-Key` header so a downstream service can deduplicate on its side too.
    """

    session_id: str | None
    run_id: str
    tool_call_id: str

    @property
    def idempotency_key(self) -> str:
        """The key a downstream service can deduplicate this call on."""
        return f"{self.session_id or self.run_id}:{self.tool_call_id}"


class ToolHandler(Protocol):
    # Positional: the tool handler interface (README).
    async def __call__(self, arguments: dict[str, Any], ctx: ToolContext) -> Any:  # noqa: PLR0917
        """Run the tool; return a JSON-serialisable value or raise ToolFailed / any Exception."""
        ...


# The largest result kept whole, in bytes of its JSON text (TOOL_RESULT_MAX_BYTES): every
# result is sent back to the model with the history on each later call, so one past the
# context window (or the API's request size) would fail every later turn of its session.
DEFAULT_MAX_RESULT_BYTES = 256 * 1024


class ToolFailed(Exception):
    """A handler's expected failure; its message becomes the `{"error": ...}` result."""


class ResultTooLarge(Exception):
    """A handler's result too large to be read whole (an HTTP tool's body past the limit):
    `head` is its start as text, kept as a truncated result."""

    def __init__(self, head: str) -> None:
        super().__init__("result too large")
        self.head = head


@dataclass(frozen=True, slots=True)
class Tool:
    """A configured tool: what the model sees plus how and whether it may be re-run."""

    name: str
    description: str
    input_schema: dict[str, Any]
    handler: ToolHandler
    safe_to_retry: bool = False
    parallel: bool = False
    timeout_s: float | None = None  # how long a call may take (None: the handler's own bound)

    @property
    def spec(self) -> ToolSpec:
        """What the model is told of the tool."""
        return ToolSpec(self.name, self.description, self.input_schema)


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """One agent from the agents file."""

    name: str
    model: str
    system: str | None = None
    tools: tuple[str, ...] = ()
    max_iterations: int = 20
    stuck_threshold: int = 3
    max_tool_concurrency: int = 5
    token_budget: int | None = None
    max_tokens: int = 4096
    description: str | None = None
