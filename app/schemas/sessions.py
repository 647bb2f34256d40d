"""Sessions as the API shows them (their messages and runs: schemas/runs.py)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel

from app.domain import SessionStatus


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
