"""session: an integer key; message: named by (session_key, seq)

Messages are most of what is stored, and each carried its session's id (up to 128
characters) in its row and its primary-key index. They carry the session's integer `key`
now: smaller rows, and a primary-key index that PostgreSQL keeps packed (see
app/db/models.py). The session's primary key becomes `key`; `id` stays unique, and runs keep
referring to it.

Revision ID: e5b8f3a1c720
Revises: c4a7e2b9d013
Create Date: 2026-11-29 23:45:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "e5b8f3a1c720"
down_revision: str | None = "c4a7e2b9d013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

KEY = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _sqlite() -> bool:
    return op.get_bind().dialect.name == "sqlite"


def _check_sqlite_foreign_keys_off() -> None:
    # Rebuilding `session` drops the old table; with foreign keys enforced that would first
    # delete every session and, by cascade, every run and message.
    if op.get_bind().exec_driver_sql("PRAGMA foreign_keys").scalar():
        raise RuntimeError("this migration must run with SQLite foreign keys off")


def upgrade() -> None:
    if _sqlite():
        _check_sqlite_foreign_keys_off()
        # The rebuilt table makes `key` its rowid, which numbers the existing rows.
        with op.batch_alter_table("session", recreate="always") as batch:
            batch.add_column(sa.Column("key", sa.Integer(), nullable=False))
            batch.drop_constraint(op.f("pk_session"), type_="primary")
            batch.create_primary_key(op.f("pk_session"), ["key"])
            batch.create_unique_constraint(op.f("uq_session_id"), ["id"])
    else:
        op.drop_constraint(op.f("fk_message_session_id_session"), "message", type_="foreignkey")
        op.drop_constraint(op.f("fk_run_session_id_session"), "run", type_="foreignkey")
        op.drop_constraint(op.f("pk_session"), "session", type_="primary")
        op.execute("ALTER TABLE session ADD COLUMN key BIGSERIAL")  # numbers the existing rows
        op.create_primary_key(op.f("pk_session"), "session", ["key"])
        op.create_unique_constraint(op.f("uq_session_id"), "session", ["id"])
        op.create_foreign_key(
            op.f("fk_run_session_id_session"),
            "run",
            "session",
            ["session_id"],
            ["id"],
            ondelete="CASCADE",
        )

    op.add_column("message", sa.Column("session_key", KEY, nullable=True))
    op.execute(
        "UPDATE message SET session_key = (SELECT key FROM session WHERE id = message.session_id)"
    )
    with op.batch_alter_table("message") as batch:
        if _sqlite():
            batch.drop_constraint(op.f("fk_message_session_id_session"), type_="foreignkey")
        batch.drop_constraint(op.f("pk_message"), type_="primary")
        batch.drop_column("session_id")
        batch.alter_column("session_key", existing_type=KEY, nullable=False)
        batch.create_primary_key(op.f("pk_message"), ["session_key", "seq"])
        batch.create_foreign_key(
            op.f("fk_message_session_key_session"),
            "session",
            ["session_key"],
            ["key"],
            ondelete="CASCADE",
        )


def downgrade() -> None:
    op.add_column("message", sa.Column("session_id", sa.String(length=128), nullable=True))
    op.execute(
        "UPDATE message SET session_id = (SELECT id FROM session WHERE key = message.session_key)"
    )
    with op.batch_alter_table("message") as batch:
        batch.drop_constraint(op.f("fk_message_session_key_session"), type_="foreignkey")
        batch.drop_constraint(op.f("pk_message"), type_="primary")
        batch.drop_column("session_key")
        batch.alter_column("session_id", existing_type=sa.String(length=128), nullable=False)
        batch.create_primary_key(op.f("pk_message"), ["session_id", "seq"])
        if _sqlite():  # SQLite checks the referred key when rows change, not now
            batch.create_foreign_key(
                op.f("fk_message_session_id_session"),
                "session",
                ["session_id"],
                ["id"],
                ondelete="CASCADE",
            )

    if _sqlite():
        _check_sqlite_foreign_keys_off()
        with op.batch_alter_table("session", recreate="always") as batch:
            batch.drop_constraint(op.f("uq_session_id"), type_="unique")
            batch.drop_constraint(op.f("pk_session"), type_="primary")
            batch.drop_column("key")
            batch.create_primary_key(op.f("pk_session"), ["id"])
        return
    op.drop_constraint(op.f("fk_run_session_id_session"), "run", type_="foreignkey")
    op.drop_constraint(op.f("pk_session"), "session", type_="primary")
    op.drop_constraint(op.f("uq_session_id"), "session", type_="unique")
    op.drop_column("session", "key")
    op.create_primary_key(op.f("pk_session"), "session", ["id"])
    for table in ("run", "message"):
        op.create_foreign_key(
            op.f(f"fk_{table}_session_id_session"),
            table,
            "session",
            ["session_id"],
            ["id"],
            ondelete="CASCADE",
        )
