"""The model interface the runner talks to."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from app.domain import Message, ToolCall, Usage, storable


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A tool as the model sees it."""

    name: str
    description: str
    input_schema: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ModelRequest:
    model: str
    system: str | None
    messages: list[Message]
    tools: list[ToolSpec]
    max_tokens: int


@dataclass(slots=True)
class ModelResponse:
    text: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    usage: Usage = field(default_factory=Usage)
    stop_reason: str | None = None


class LLMError(Exception):
    """A model call failed; `type` is a short stable name for the run's `error.type`."""

    def __init__(self, message: str, *, type: str = "model_error", retryable: bool = False) -> None:
        super().__init__(message)
        # Both are stored with the run, and may quote what the model API sent.
        self.message = storable(message)
        self.type = storable(type)
        self.retryable = retryable


def not_a_message(why: str) -> LLMError:
    """The error of a model answer the runner cannot act on: `why` says what is wrong with
    its shape (never the model's words)."""
    return LLMError(
        f"The model API answered something that is not a valid message: {why}", type="api_error"
    )


class LLMClient(Protocol):
    async def complete(self, request: ModelRequest) -> ModelResponse:
        """Ask the model for its next message; raise LLMError on failure."""
        ...

    async def aclose(self) -> None:
        """Release connections."""
        ...
