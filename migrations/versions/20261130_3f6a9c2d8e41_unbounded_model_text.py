"""message.tool_call_id, message.tool_name, run.error_type: text; run token counts: bigint

These hold what the model API sends (a tool_use id and name, an error's type) and what it
counts. PostgreSQL refused a tool_use id over 128 characters, a name over 64 or a count over
2^31 - 1 after the tools had run, which SQLite stored; no limit of ours applies to them.

Revision ID: 3f6a9c2d8e41
Revises: e5b8f3a1c720
Create Date: 2026-11-30 08:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "3f6a9c2d8e41"
down_revision: str | None = "e5b8f3a1c720"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# (table, column, the type before, the type now, the downgrade's cast on PostgreSQL)
COLUMNS = [
    ("message", "tool_call_id", sa.String(128), sa.Text(), "left(tool_call_id, 128)"),
    ("message", "tool_name", sa.String(64), sa.Text(), "left(tool_name, 64)"),
    ("run", "error_type", sa.String(64), sa.Text(), "left(error_type, 64)"),
    ("run", "input_tokens", sa.Integer(), sa.BigInteger(), "least(input_tokens, 2147483647)"),
    ("run", "output_tokens", sa.Integer(), sa.BigInteger(), "least(output_tokens, 2147483647)"),
]


def upgrade() -> None:
    for table in ("message", "run"):
        with op.batch_alter_table(table) as batch:
            for _, column, before, now, _ in (c for c in COLUMNS if c[0] == table):
                batch.alter_column(column, existing_type=before, type_=now)


def downgrade() -> None:
    for table in ("message", "run"):
        with op.batch_alter_table(table) as batch:
            for _, column, before, now, cast in (c for c in COLUMNS if c[0] == table):
                batch.alter_column(
                    column, existing_type=now, type_=before, postgresql_using=cast
                )
