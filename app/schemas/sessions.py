"""Sessions as the API shows them (their messages and runs: schemas/runs.py)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel

from app.domain import SessionStatus

# §3: 1 to 128 characters of A-Z a-z 0-9 . _ : - (a run's `session_id`, the session routes' path).
SESSION_ID_PATTERN = r"^[A-Za-z0-9._:-]{1,128}$"


class SessionRead(BaseModel):
    id: str
    agent: str
    user_id: str | None
    tenant_id: str | None
    metadata: dict[str, Any]
    created_at: datetime
    updated_at: datetime
    message_count: int
    status: SessionStatus
