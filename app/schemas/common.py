"""Shapes shared by every route: problems, pages, cursors."""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Generic, Literal, TypeVar

from pydantic import BaseModel, Field

from app.errors import ValidationFailed

T = TypeVar("T")
R = TypeVar("R")

MAX_PAGE = 200
DEFAULT_PAGE = 50
# A page ends early, `next_after` set, where its next row would take the text of its rows
# past this many bytes (UTF-8, JSON as stored); its first row it always holds. Pages of 200
# rows of a megabyte each took a server hundreds of megabytes per request to answer.
PAGE_MAX_BYTES = 4 * 1024 * 1024


class ProblemError(BaseModel):
    """One reason a request was invalid."""

    loc: list[str | int]
    msg: str
    type: str


class Problem(BaseModel):
    """An RFC 9457 problem document plus our stable `code`, and the members some codes add."""

    type: str = Field(examples=["urn:agent-runner:problem:session_busy"])
    title: str
    status: int
    detail: str
    code: str
    active_run_id: str | None = Field(
        default=None,
        description="session_busy: the run that holds the session (null if it could not be told).",
    )
    bound_agent: str | None = Field(
        default=None, description="session_agent_mismatch: the agent the session is bound to."
    )
    errors: list[ProblemError] | None = Field(
        default=None, description="validation_error: each invalid part of the request."
    )


class Health(BaseModel):
    """This process is alive."""

    status: Literal["ok"]


class Readiness(BaseModel):
    """This replica can serve: the database answers at the newest migration."""

    status: Literal["ready"]
    schema_revision: str | None = Field(
        serialization_alias="schema",
        description="The schema's migration (null for the memory:// store).",
    )


class Page(BaseModel, Generic[T]):
    """A page of a list; pass `next_after` as `after` to get the next one."""

    data: list[T]
    next_after: str | None = Field(
        description=(
            "Null on the last page. A page may hold fewer rows than `limit` and not be the"
            " last: a history, sessions or runs page ends before a row that would take the"
            f" text of its rows past {PAGE_MAX_BYTES:,} bytes (UTF-8, JSON as stored; its"
            " first row it always holds)."
        )
    )


def next_after(rows: Sequence[R], *, more: bool, cursor: Callable[[R], str]) -> str | None:
    """The `next_after` of a page of these rows, after which `more` follow: the cursor of
    its last row, or None when it is the last page."""
    return cursor(rows[-1]) if more and rows else None


def encode_cursor(moment: datetime, *, key: str, listing: str) -> str:
    """An opaque cursor for keyset pagination on (timestamp, id) of the list `listing`."""
    raw = f"{listing}|{moment.isoformat()}|{key}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_seq(cursor: str) -> int:
    """The `seq` of a history cursor; anything else is a validation error."""
    if not re.fullmatch(r"[0-9]{1,9}", cursor):
        raise ValidationFailed(f"'after' is not a cursor this list returned: {cursor!r}")
    return int(cursor)


def decode_cursor(cursor: str, *, listing: str) -> tuple[datetime, str]:
    """The (timestamp, id) of a cursor of the list `listing`; a malformed one, or another
    list's, is a validation error."""
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        kind, _, rest = base64.urlsafe_b64decode(padded).decode().partition("|")
        moment, _, key = rest.partition("|")
        parsed = datetime.fromisoformat(moment)
        if kind != listing or not key or "\x00" in key or parsed.tzinfo is None:
            raise ValueError("not a cursor of this list")
        return parsed.astimezone(UTC), key
    except (ValueError, OverflowError, binascii.Error, UnicodeDecodeError) as exc:
        raise ValidationFailed(f"'after' is not a cursor this list returned: {cursor!r}") from exc
