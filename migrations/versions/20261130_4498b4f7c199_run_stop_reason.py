"""run.stop_reason: the stop reason of the turn's last model answer

A text-only answer cut off at max_tokens (or refused, paused, stopped at the context window)
ends its run `complete` with the text it has; the stop reason is what tells it from a
finished answer. Runs stored before this revision have none (null).

Revision ID: 4498b4f7c199
Revises: 3f6a9c2d8e41
Create Date: 2026-11-30 12:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "4498b4f7c199"
down_revision: str | None = "3f6a9c2d8e41"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("run") as batch:
        batch.add_column(sa.Column("stop_reason", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("run") as batch:
        batch.drop_column("stop_reason")
