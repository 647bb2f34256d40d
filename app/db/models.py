"""ORM models: session, run, message.

`session.message_count` is both the number of stored messages and the highest `seq`; every
durable write advances it with a compare-and-set in the same transaction as its inserts, so two
writers can never interleave on one session (the second one's update matches no row).

A session is named by its `id` (the client's, up to 128 characters) everywhere but in
`message`, whose rows carry the session's integer `key` instead: messages are most of what is
stored, and a narrow primary key keeps PostgreSQL's index pages full (its B-tree packs pages
under insertions that climb within a session only for entries of at most 16 bytes of key;
with the id in the key, pages split half full).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import Mapped, mapped_column

from app.db.base import Base, UTCDateTime, utcnow

# A 64-bit key, which on SQLite must be spelled INTEGER to be the table's rowid.
KEY = BigInteger().with_variant(Integer, "sqlite")


class Session(Base):
    __tablename__ = "session"

    key: Mapped[int] = mapped_column(KEY, primary_key=True)
    id: Mapped[str] = mapped_column(String(128), unique=True)
    agent: Mapped[str] = mapped_column(String(64))
    tenant_id: Mapped[str | None] = mapped_column(String(128))
    user_id: Mapped[str | None] = mapped_column(String(128))
    metadata_: Mapped[dict[str, Any]] = mapped_column("metadata", JSON, default=dict)
    message_count: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)

    __table_args__ = (Index(None, "updated_at", "id"),)


class Run(Base):
    __tablename__ = "run"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("session.id", ondelete="CASCADE"))
    agent: Mapped[str] = mapped_column(String(64))
    user_id: Mapped[str | None] = mapped_column(String(128))
    status: Mapped[str] = mapped_column(String(32))
    response: Mapped[str | None] = mapped_column(Text)
    iterations: Mapped[int] = mapped_column(Integer, default=0)
    # What the model API sends is stored whole: no length or range of ours applies to it.
    input_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    output_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    error_type: Mapped[str | None] = mapped_column(Text)
    error_message: Mapped[str | None] = mapped_column(Text)
    # The stop reason of the turn's last model answer, cut to 64 characters by the runner
    # (STOP_REASON_MAX); null when the turn got no answer from the model, or has not ended.
    stop_reason: Mapped[str | None] = mapped_column(String(64))
    metadata_: Mapped[dict[str, Any]] = mapped_column("metadata", JSON, default=dict)
    # Idempotency-Key of the request that started this turn, and a hash of its body.
    idempotency_key: Mapped[str | None] = mapped_column(String(255))
    request_fingerprint: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)

    __table_args__ = (
        Index(None, "session_id", "created_at"),
        UniqueConstraint("session_id", "idempotency_key"),
    )


class Message(Base):
    """One message of a session's history, named by its place in it: (session_key, seq)."""

    __tablename__ = "message"

    session_key: Mapped[int] = mapped_column(
        KEY, ForeignKey("session.key", ondelete="CASCADE"), primary_key=True, autoincrement=False
    )
    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    role: Mapped[str] = mapped_column(String(16))
    content: Mapped[str] = mapped_column(Text)
    tool_calls: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON(none_as_null=True))
    tool_call_id: Mapped[str | None] = mapped_column(Text)  # as the model sent them
    tool_name: Mapped[str | None] = mapped_column(Text)
    is_error: Mapped[bool] = mapped_column(Boolean, default=False)
    run_id: Mapped[str | None] = mapped_column(String(36))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
