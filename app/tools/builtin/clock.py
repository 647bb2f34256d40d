"""The `clock` example tool."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from app.tools.base import ToolContext


# Positional: the tool handler interface (README).
async def clock(arguments: dict[str, Any], ctx: ToolContext) -> dict[str, str]:  # noqa: PLR0917
    """Return the current UTC time as an ISO 8601 timestamp."""
    return {"utc": datetime.now(UTC).isoformat()}
