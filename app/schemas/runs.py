"""Runs and their messages as the API shows them."""

from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from app.domain import Message, Role, RunStatus, nests_deeper_than
from app.schemas.sessions import SESSION_ID_PATTERN

MAX_METADATA_DEPTH = 32
# An Idempotency-Key (§4): printable ASCII without spaces, as an HTTP header carries it.
IDEMPOTENCY_KEY_PATTERN = r"^[\x21-\x7e]+$"
IDEMPOTENCY_KEY_MAX_LENGTH = 255


# The patterns /openapi.json shows for the checks below (`_no_nul`, `_not_blank`), which
# enforce them. NOT_BLANK is a character that is white space neither by Python's count
# (`str.isspace`) nor by ECMA-262's (a client's JSON Schema validator): they differ in
# \x1c-\x1f, \x85 and \ufeff. It is written in the syntax both share.
NO_NUL = "^[^\\x00]*$"
NOT_BLANK = (
    "[^\\t\\n\\v\\f\\r\\x1c-\\x1f \\x85\\xa0\\u1680\\u2000-\\u200a"
    "\\u2028\\u2029\\u202f\\u205f\\u3000\\ufeff]"
)
_NOT_BLANK = re.compile(NOT_BLANK)


class RunCreate(BaseModel):
    """Run one turn of an agent."""

    model_config = ConfigDict(extra="forbid")

    agent: str = Field(min_length=1, max_length=64, json_schema_extra={"pattern": NO_NUL})
    # No length limit of its own: the 1 MiB body limit (app/api/limits.py) is the contract's.
    message: str = Field(
        min_length=1,
        description="At least one character other than white space, and no NUL.",
        json_schema_extra={"pattern": NOT_BLANK},
    )
    session_id: str | None = Field(default=None, pattern=SESSION_ID_PATTERN)
    user_id: str | None = Field(
        default=None, min_length=1, max_length=128, json_schema_extra={"pattern": NO_NUL}
    )
    metadata: dict[str, Any] | None = None

    @field_validator("agent", "message", "user_id")
    @classmethod
    def _no_nul(cls, value: str | None) -> str | None:
        # PostgreSQL text cannot hold NUL; refuse it up front rather than fail at a write.
        if value is not None and "\x00" in value:
            raise ValueError("must not contain NUL characters")
        return value

    @field_validator("message")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        # The Messages API refuses a text block of white space only: the model call would
        # fail with the user's message never stored.
        if _NOT_BLANK.search(value) is None:
            raise ValueError("must contain a character other than white space")
        return value

    @field_validator("metadata")
    @classmethod
    def _storable(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        # What we store and echo back must be strict JSON: no NaN/Infinity, no lone surrogates,
        # and shallow enough to serialise back (pydantic stops at 255 levels).
        if value is not None:
            if nests_deeper_than(value, levels=MAX_METADATA_DEPTH):
                raise ValueError(f"must not nest deeper than {MAX_METADATA_DEPTH} levels")
            try:
                json.dumps(value, allow_nan=False, ensure_ascii=False).encode()
            except (ValueError, UnicodeEncodeError) as exc:
                raise ValueError(f"must be storable JSON ({exc.__class__.__name__})") from exc
        return value


class ToolCallRead(BaseModel):
    id: str
    name: str
    arguments: dict[str, Any]


class MessageRead(BaseModel):
    seq: int | None
    role: Role
    content: str
    tool_calls: list[ToolCallRead]
    tool_call_id: str | None
    tool_name: str | None
    is_error: bool
    run_id: str | None
    created_at: datetime | None

    @classmethod
    def of(cls, message: Message) -> MessageRead:
        """The API shape of a domain message."""
        return cls(
            seq=message.seq,
            role=message.role,
            content=message.content,
            tool_calls=[ToolCallRead(**c.as_json()) for c in message.tool_calls],
            tool_call_id=message.tool_call_id,
            tool_name=message.tool_name,
            is_error=message.is_error,
            run_id=message.run_id,
            created_at=message.created_at,
        )


class UsageRead(BaseModel):
    input_tokens: int
    output_tokens: int


class RunErrorRead(BaseModel):
    type: str
    message: str

    @classmethod
    def of(cls, type: str | None, *, message: str | None) -> RunErrorRead | None:
        """The `error` field: null unless the run ended with an error type."""
        return None if type is None else cls(type=type, message=message or "")


class RunSummary(BaseModel):
    """A run in a list: the record without its messages."""

    run_id: str
    session_id: str | None
    agent: str
    status: RunStatus
    response: str | None
    iterations: int
    usage: UsageRead
    error: RunErrorRead | None
    stop_reason: str | None = Field(
        description=(
            "The stop reason of the model's last answer in this turn, as the Messages API"
            " gave it (`end_turn`, `tool_use`, `max_tokens`, `stop_sequence`, `refusal`,"
            " `pause_turn`, `model_context_window_exceeded`, or a newer one; at most 64"
            " characters kept). A run can be `complete` with an answer cut off: check"
            ' `stop_reason == "max_tokens"`. Null when the turn got no answer from the model'
            " (its first model call failed), and until it ends: so also for a run `running`"
            " or `interrupted` (its runner died; it is stored with the turn's end)."
        ),
        max_length=64,
    )
    metadata: dict[str, Any]
    created_at: datetime
    finished_at: datetime | None


class RunRead(RunSummary):
    """A run with the messages of its turn (`session_id` is null for a stateless run)."""

    messages: list[MessageRead]
