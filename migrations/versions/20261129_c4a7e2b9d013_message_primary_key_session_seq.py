"""message: primary key (session_id, seq), no surrogate id

A message is named by its session and its place in the history; the surrogate `id` and its
index cost every stored message bytes and an index update, and nothing reads them.

Revision ID: c4a7e2b9d013
Revises: 9b3f5d1e7a22
Create Date: 2026-11-29 22:30:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "c4a7e2b9d013"
down_revision: str | None = "9b3f5d1e7a22"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("message") as batch:
        batch.drop_constraint(op.f("uq_message_session_id_seq"), type_="unique")
        batch.drop_constraint(op.f("pk_message"), type_="primary")
        batch.drop_column("id")
        batch.create_primary_key(op.f("pk_message"), ["session_id", "seq"])


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.drop_constraint(op.f("pk_message"), "message", type_="primary")
        op.execute("ALTER TABLE message ADD COLUMN id BIGSERIAL")  # numbers the existing rows
        op.create_primary_key(op.f("pk_message"), "message", ["id"])
        op.create_unique_constraint(
            op.f("uq_message_session_id_seq"), "message", ["session_id", "seq"]
        )
        return
    with op.batch_alter_table("message") as batch:
        batch.drop_constraint(op.f("pk_message"), type_="primary")
        # The rebuilt table makes `id` its rowid, which numbers the existing rows.
        batch.add_column(sa.Column("id", sa.Integer(), autoincrement=True, nullable=False))
        batch.create_primary_key(op.f("pk_message"), ["id"])
        batch.create_unique_constraint(op.f("uq_message_session_id_seq"), ["session_id", "seq"])
