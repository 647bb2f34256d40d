"""The durable writes of a turn, one transaction each (CONTRACT §2), on either store.

A write is described by a `JournalWrite` and carried out by the store's `JournalStore`, in
SQL sent on the database driver itself (SQLAlchemy's layers cost more than the statements):
- SQLite: `SqliteJournalStore`, a few fixed statements in one transaction body on
  `Database.writes`, on the event loop's thread (app/db/session.py, InlineTransactor).
- PostgreSQL: `PostgresJournalStore`, ONE statement per write (data-modifying CTEs) in
  autocommit: a write is one round trip and one commit.

Every write claims the session's next `seq` values with a compare-and-set on
`session.message_count` (or creates the session) under the ownership fence
(services/ownership.py), and only a successful claim inserts anything. A runner that lost the
session, or a second writer, therefore writes nothing and gets SessionConflict; a repeated
write conflicts on `(session_key, seq)` instead of duplicating. Messages name their session
by its `key` (app/db/models.py), which the write finds from the session's id.
"""

from __future__ import annotations

from app.db.journal.postgres import PostgresJournalStore
from app.db.journal.sqlite import SqliteJournalStore
from app.db.journal.write import JournalStore, JournalWrite, StoredTail, WriteOutcomeUnknown
from app.db.session import Database, InlineTransactor

__all__ = [
    "JournalStore",
    "JournalWrite",
    "PostgresJournalStore",
    "SqliteJournalStore",
    "StoredTail",
    "WriteOutcomeUnknown",
    "journal_store",
]


def journal_store(db: Database, *, fence_sql: str) -> JournalStore:
    """The store's way of writing, fenced by the ownership's SQL conditions."""
    if db.dialect == "postgresql":
        return PostgresJournalStore(db.engine, fence_sql)
    assert isinstance(db.writes, InlineTransactor)
    return SqliteJournalStore(db.writes, fence_sql=fence_sql)
