"""The SQL both stores' writes are made of: the columns a write inserts, and the claim
under the ownership fence that every write starts with."""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import String
from sqlalchemy.dialects import postgresql

from app.db import models
from app.db.base import Base
from app.domain import RunStatus

_PG = postgresql.dialect()  # type: ignore[no-untyped-call]  # SQLAlchemy leaves it untyped


def _typed(model: type[Base], *, names: Iterable[str]) -> dict[str, str]:
    """Columns of the model and the PostgreSQL types their parameters are cast to (an INSERT
    … SELECT must spell them out). Strings go as text: the column's own length limit then
    refuses a value too long, where a cast to varchar(n) would cut it."""
    columns = model.__table__.columns
    return {
        name: "text" if isinstance(columns[name].type, String) else columns[name].type.compile(_PG)
        for name in names
    }


# The columns each write inserts (a session's `key` is the database's to number).
SESSION_COLUMNS = _typed(
    models.Session, names=(c.name for c in models.Session.__table__.columns if c.name != "key")
)
RUN_COLUMNS = _typed(
    models.Run,
    names=(
        "id",
        "session_id",
        "agent",
        "user_id",
        "status",
        "metadata",
        "idempotency_key",
        "request_fingerprint",
        "created_at",
        "iterations",
        "input_tokens",
        "output_tokens",
    ),
)
MESSAGE_COLUMNS = _typed(
    models.Message,
    names=(
        c.name
        for c in models.Message.__table__.columns
        if c.name not in ("session_key", "created_at")
    ),
)
JSON_COLUMNS = frozenset(
    name
    for table in (SESSION_COLUMNS, RUN_COLUMNS, MESSAGE_COLUMNS)
    for name, type_ in table.items()
    if type_ == "JSON"
)


# JournalStore.stored: the session's message count and a run's status, as the columns of one
# row (NULL: no such row).
STORED_COLUMNS = (
    "(SELECT message_count FROM session WHERE id = :session_id) AS count,"
    " (SELECT status FROM run WHERE id = :run_id) AS status"
)


# JournalStore.last_message: the session's last stored message, as far as telling whose it
# is goes (StoredTail).
LAST_MESSAGE_SQL = (
    "SELECT role, content, tool_call_id, tool_calls, created_at FROM message"
    " WHERE session_key = (SELECT key FROM session WHERE id = :session_id)"
    " ORDER BY seq DESC LIMIT 1"
)


def claim_sql(
    fence_sql: str, *, create: bool, touch: bool, postgres: bool, runs: bool = False
) -> str:
    """The claim every write starts with: create the session, or advance its message count
    from `:expected` to `:new_count` — only while the fence holds. On PostgreSQL
    (`postgres`) a created session's parameters are cast to their column types, and the fence
    is asked once the session's row, and with `runs` the run rows the write updates
    (`:locked_runs`), are locked: asked of the row as its scan found it, it would be this
    runner's answer from before any wait for a row, and a client that only locked one
    (`SELECT … FOR UPDATE`) leaves nothing for PostgreSQL to check again, so a write could
    commit after its runner lost the session during the wait. (SQLite has one writer at a
    time: a write there waits for the file, not for a row.)"""
    if create:
        values = ", ".join(
            f"CAST(:s_{c} AS {t})" if postgres else f":s_{c}" for c, t in SESSION_COLUMNS.items()
        )
        return (
            f"INSERT INTO session ({', '.join(SESSION_COLUMNS)}) SELECT {values} WHERE {fence_sql}"
        )
    touched = ", updated_at = :now" if touch else ""
    update = f"UPDATE session SET message_count = :new_count{touched}"
    if not postgres:
        return f"{update} WHERE id = :session_id AND message_count = :expected AND {fence_sql}"
    # MATERIALIZED CTEs run as written (of a subquery, PostgreSQL moved the fence below the
    # lock). The session's row is locked first, as a DELETE locks it, then the runs in the
    # order of their ids; the fence filters the locked session row, after a count of the
    # locked runs that PostgreSQL evaluates before that row's scan.
    ctes = [
        "locked AS MATERIALIZED (SELECT id FROM session"
        " WHERE id = :session_id AND message_count = :expected FOR NO KEY UPDATE)"
    ]
    after_runs = ""
    if runs:
        ctes.append(
            "runs AS MATERIALIZED (SELECT id FROM run"
            " WHERE id = ANY(CAST(:locked_runs AS text[])) AND EXISTS (SELECT 1 FROM locked)"
            " ORDER BY id FOR NO KEY UPDATE)"
        )
        after_runs = "(SELECT count(*) FROM runs) >= 0 AND "
    return (
        f"WITH {', '.join(ctes)}"
        f" {update} WHERE id = (SELECT id FROM locked WHERE {after_runs}{fence_sql})"
    )


def run_update_sql(columns: Iterable[str], *, where: str) -> str:
    """Set these run columns from `:u_<column>` parameters."""
    return f"UPDATE run SET {', '.join(f'{c} = :u_{c}' for c in columns)} WHERE {where}"


def interrupted_sql(where: str) -> str:
    """Mark the runs `where` selects `interrupted` as of `:now`."""
    return (
        f"UPDATE run SET status = '{RunStatus.INTERRUPTED.value}', finished_at = :now WHERE {where}"
    )
