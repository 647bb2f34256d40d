"""drop the message.run_id index

A run's messages are read through the (session_id, seq) index of their session; an index
of its own on run_id cost every stored message more than that read saves.

Revision ID: 9b3f5d1e7a22
Revises: 7c1d2e9f3a10
Create Date: 2026-11-29 20:55:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "9b3f5d1e7a22"
down_revision: str | None = "7c1d2e9f3a10"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.drop_index(op.f("ix_message_run_id"), table_name="message")


def downgrade() -> None:
    op.create_index(op.f("ix_message_run_id"), "message", ["run_id"])
