"""Core value types shared by the runner, the model adapters, the tools and the store."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any, TypeVar, cast

_T = TypeVar("_T")
# What neither store can hold as text: NUL (PostgreSQL) and lone surrogates (not UTF-8).
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def storable(value: _T) -> _T:
    """`value` (a string, or JSON of them) with what no store can hold as text replaced by
    U+FFFD: used on what the model says, which is stored as it came."""
    if isinstance(value, str):
        return cast(_T, _UNSTORABLE.sub("\ufffd", value))
    if isinstance(value, dict):
        return cast(_T, {storable(k): storable(v) for k, v in value.items()})
    if isinstance(value, list):
        return cast(_T, [storable(item) for item in value])
    return value


def nests_deeper_than(value: Any, *, levels: int) -> bool:
    """Whether objects and arrays nest in `value` more than `levels` deep (JSON that deep
    cannot be answered back: pydantic stops serialising at 255 levels)."""
    if isinstance(value, dict):
        children: Any = value.values()
    elif isinstance(value, list):
        children = value
    else:
        return False
    return levels == 0 or any(nests_deeper_than(child, levels=levels - 1) for child in children)


def is_plain_json(value: Any) -> bool:
    """Whether `value` is what strict JSON can say: objects with string keys, arrays,
    strings, booleans, null and finite numbers (not 1e400, which Python reads as inf, nor
    a YAML date or bytes). Assumed not deeper than Python's recursion limit."""
    if value is None or isinstance(value, str | bool | int):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and is_plain_json(v) for k, v in value.items())
    if isinstance(value, list):
        return all(is_plain_json(item) for item in value)
    return False


def json_text(value: Any, *, separators: tuple[str, str] | None = None) -> str:
    """A tool result's JSON text: other than ASCII kept as it is, not escaped (the model
    reads it in fewer tokens), and what no store can hold (a lone surrogate) as U+FFFD."""
    text = json.dumps(value, separators=separators, ensure_ascii=False, allow_nan=False)
    return storable(text)


class Role(StrEnum):
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"


class RunStatus(StrEnum):
    RUNNING = "running"
    COMPLETE = "complete"
    MAX_ITERATIONS = "max_iterations"
    STUCK = "stuck"
    TOKEN_BUDGET_EXHAUSTED = "token_budget_exhausted"
    ERROR = "error"
    INTERRUPTED = "interrupted"
    CANCELLED = "cancelled"  # CONTRACT §3 (later): no run is cancelled yet


class SessionStatus(StrEnum):
    IDLE = "idle"
    RUNNING = "running"
    NEEDS_RESUME = "needs_resume"


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One `tool_use` the model asked for."""

    id: str
    name: str
    arguments: dict[str, Any]

    def as_json(self) -> dict[str, Any]:
        """The stored / API shape: {id, name, arguments}."""
        return {"id": self.id, "name": self.name, "arguments": self.arguments}


@dataclass(frozen=True, slots=True)
class ToolResult:
    """What one tool call produced; `content` is JSON text, `is_error` marks failures."""

    tool_call_id: str
    tool_name: str
    content: str
    is_error: bool = False

    @classmethod
    def ok(cls, call: ToolCall, *, value: Any) -> ToolResult:
        """A successful result; `value` must be JSON-serialisable (TypeError, ValueError or
        RecursionError if not; NaN and Infinity are not JSON)."""
        return cls(call.id, call.name, json_text(value, separators=(",", ":")), False)

    @classmethod
    def error(cls, call: ToolCall, *, message: str) -> ToolResult:
        """An error result the model can read: {"error": message}."""
        return cls(call.id, call.name, json_text({"error": message}), True)


def truncated_result(result: ToolResult, *, limit: int, head: str | None = None) -> ToolResult:
    """`result` cut to `limit` bytes of JSON text: {"kind": "tool-result-truncated", "note",
    "head"}, where `head` is the start of its text (or, given, the start of a result too
    large to be read whole). `is_error` is kept: the call ran as it did, only what it said
    is cut."""
    text = result.content if head is None else head
    size = f"{len(text.encode()):,}" if head is None else f"more than {limit:,}"
    note = (
        f"The tool's result was {size} bytes, over this runner's limit of {limit:,}"
        " (TOOL_RESULT_MAX_BYTES): `head` is its start, cut off mid-value."
    )

    def wrapped(head: str) -> str:
        return json_text({"kind": "tool-result-truncated", "note": note, "head": head})

    # The longest start that fits once escaped (a character takes 1 to 6 bytes there).
    low, high = 0, min(len(text), limit)
    while low < high:
        middle = (low + high + 1) // 2
        if len(wrapped(text[:middle]).encode()) <= limit:
            low = middle
        else:
            high = middle - 1
    content = wrapped(text[:low])
    return ToolResult(result.tool_call_id, result.tool_name, content, result.is_error)


def durability_error(tool_name: str, *, tool_call_id: str) -> ToolResult:
    """The result stored for an orphaned call that is not safe to retry (CONTRACT §2)."""
    body = {
        "error": (
            f"The runner stopped before the result of tool {tool_name!r} (call {tool_call_id})"
            " was saved: the call may or may not have run, so it may or may not have taken"
            " effect; check before repeating it."
        ),
        "kind": "tool-durability-error",
        "toolName": tool_name,
        "toolCallId": tool_call_id,
    }
    return ToolResult(tool_call_id, tool_name, json_text(body), True)


def is_durability_error(content: str) -> bool:
    """Whether a tool result's JSON text is the durability error."""
    try:
        body = json.loads(content)
    except ValueError:
        return False
    return isinstance(body, dict) and body.get("kind") == "tool-durability-error"


@dataclass(slots=True)
class Message:
    """One history entry, in the order it was stored (`seq`)."""

    role: Role
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None
    tool_name: str | None = None
    is_error: bool = False
    seq: int | None = None
    run_id: str | None = None
    created_at: datetime | None = None

    @classmethod
    def user(cls, text: str) -> Message:
        """A user message."""
        return cls(Role.USER, text)

    @classmethod
    def assistant(cls, text: str, *, tool_calls: list[ToolCall] | None = None) -> Message:
        """An assistant message, optionally asking for tool calls."""
        return cls(Role.ASSISTANT, text, list(tool_calls or []))

    @classmethod
    def tool(cls, result: ToolResult) -> Message:
        """A tool-result message."""
        return cls(
            Role.TOOL,
            result.content,
            tool_call_id=result.tool_call_id,
            tool_name=result.tool_name,
            is_error=result.is_error,
        )


@dataclass(slots=True)
class Usage:
    input_tokens: int = 0
    output_tokens: int = 0

    def add(self, other: Usage) -> None:
        """Accumulate `other` into this."""
        self.input_tokens += other.input_tokens
        self.output_tokens += other.output_tokens

    @property
    def total(self) -> int:
        """Input and output tokens together."""
        return self.input_tokens + self.output_tokens


def orphaned_calls(history: list[Message]) -> tuple[int, list[ToolCall]]:
    """Index of the last assistant message with tool calls and its calls lacking a result.

    Every turn repairs before its first step, and a step's results are stored before the
    next model call, so orphans can only sit in the last assistant message that asked for
    tools; (-1, []) when nothing waits.
    """
    for index in range(len(history) - 1, -1, -1):
        message = history[index]
        if message.role is Role.ASSISTANT and message.tool_calls:
            answered = {m.tool_call_id for m in history[index + 1 :] if m.role is Role.TOOL}
            missing = [c for c in message.tool_calls if c.id not in answered]
            return (index, missing) if missing else (-1, [])
    return -1, []
