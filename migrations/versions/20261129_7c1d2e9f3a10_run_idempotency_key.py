"""run idempotency key and request fingerprint

Revision ID: 7c1d2e9f3a10
Revises: 4e8a668623b5
Create Date: 2026-11-29 20:10:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "7c1d2e9f3a10"
down_revision: str | None = "4e8a668623b5"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("run") as batch:
        batch.add_column(sa.Column("idempotency_key", sa.String(length=255), nullable=True))
        batch.add_column(sa.Column("request_fingerprint", sa.String(length=64), nullable=True))
        batch.create_unique_constraint(
            op.f("uq_run_session_id_idempotency_key"), ["session_id", "idempotency_key"]
        )


def downgrade() -> None:
    with op.batch_alter_table("run") as batch:
        batch.drop_constraint(op.f("uq_run_session_id_idempotency_key"), type_="unique")
        batch.drop_column("request_fingerprint")
        batch.drop_column("idempotency_key")
