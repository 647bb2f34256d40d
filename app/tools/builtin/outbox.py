"""The `send_email` example tool: a side effect you can watch, recorded in a local outbox."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from app.tools.base import ToolContext, ToolFailed

MAX_DELAY_S = 60.0
DEFAULT_OUTBOX = "demo-outbox.jsonl"


# Positional: the tool handler interface (README).
async def send_email(arguments: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:  # noqa: PLR0917
    """Send an email (demo: append it to the outbox file); not safe to retry."""
    to, subject = arguments.get("to"), arguments.get("subject")
    if not isinstance(to, str) or not isinstance(subject, str):
        raise ToolFailed("to and subject must be strings")
    delay_s = arguments.get("delay_s", 0)
    if not isinstance(delay_s, int | float) or not 0 <= delay_s <= MAX_DELAY_S:
        raise ToolFailed(f"delay_s must be a number from 0 to {MAX_DELAY_S:g}")
    # The delay keeps the call in flight long enough for a demo to kill the server mid-handler.
    await asyncio.sleep(delay_s)
    record = {
        "at": datetime.now(UTC).isoformat(),
        "tool_call_id": ctx.tool_call_id,
        "idempotency_key": ctx.idempotency_key,
        "to": to,
        "subject": subject,
    }
    await asyncio.to_thread(_append_line, _outbox_path(), line=json.dumps(record))
    digest = hashlib.sha256(ctx.idempotency_key.encode()).hexdigest()[:16]
    return {"sent": True, "message_id": f"msg_{digest}"}


def _outbox_path() -> Path:
    # Example-tool behaviour, not service configuration: the demo and the crash tests point
    # DEMO_OUTBOX at a file they inspect, so this tool reads it directly instead of Settings.
    return Path(os.environ.get("DEMO_OUTBOX") or DEFAULT_OUTBOX)  # set but empty: the default


def _append_line(path: Path, *, line: str) -> None:
    # Append mode, one line per call: the outbox is a log of every send, never rewritten.
    with path.open("a", encoding="utf-8") as outbox:
        outbox.write(line + "\n")
