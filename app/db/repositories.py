"""Repositories: the queries (and the delete) inside the caller's transaction; they never commit.

The hot path, the runner's per-step writes, is not here but in app/db/journal/.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, TypeVar

from sqlalchemy import ColumnElement, Select, Text, cast, delete, func, select, text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import QueryableAttribute

from app.db import models
from app.domain import Message, Role, RunStatus, ToolCall
from app.errors import SessionConflict

T = TypeVar("T")


@dataclass(frozen=True)
class Paged(Generic[T]):
    """The rows of one page of a list, and whether more rows follow them."""

    rows: Sequence[T]
    more: bool


def page_length(sizes: Sequence[int], *, limit: int, budget: int) -> Paged[int]:
    """How many of the rows of these sizes (read `limit + 1`, in the list's order) a page
    holds, as `rows` (their sizes), and whether more follow: at most `limit` rows, and none
    that would take their sum past `budget`, but for the first."""
    total = 0
    for index, size in enumerate(sizes[:limit]):
        total += size
        if index and total > budget:
            return Paged(sizes[:index], more=True)
    return Paged(sizes[:limit], more=len(sizes) > limit)


Column = ColumnElement[Any] | QueryableAttribute[Any]


def chars(*columns: Column) -> ColumnElement[int]:
    """The characters the values of these text or JSON columns hold (a NULL none)."""
    lengths: list[ColumnElement[int]] = [
        func.coalesce(func.length(cast(c, Text)), 0) for c in columns
    ]
    total = lengths[0]
    for length in lengths[1:]:
        total = total + length
    return total


async def read_page(
    session: AsyncSession,
    *,
    query: Select[T],
    limit: int,
    budget: int,
    size: ColumnElement[int],
    keys: Sequence[Column],
    through: Callable[[Sequence[Any]], ColumnElement[bool]],
) -> Paged[T]:
    """One page of the ORM rows `query` selects in its order: at most `limit` rows, whose
    text (`size`, in characters) passes `budget` only if the page is one row.

    First the rows' `keys` and `size` are read, `limit + 1` of them, which tells how many
    rows the page holds; then the rows themselves, up to and including the last one it
    holds (`through` its keys). No row past the page is read whole."""
    sized = (await session.execute(query.with_only_columns(*keys, size).limit(limit + 1))).all()
    page = page_length([row[-1] for row in sized], limit=limit, budget=budget)
    if not page.rows:
        return Paged([], more=False)
    last = tuple(sized[len(page.rows) - 1])
    rows = (await session.scalars(query.where(through(last)).limit(len(page.rows)))).all()
    return Paged(rows, more=page.more)


def message_to_row(message: Message, *, now: datetime) -> dict[str, Any]:
    """The insert parameters of one history message (its `seq` and `run_id` must be set),
    but for its session, which each store names in its own way."""
    return {
        "seq": message.seq,
        "role": message.role.value,
        "content": message.content,
        "tool_calls": [c.as_json() for c in message.tool_calls] if message.tool_calls else None,
        "tool_call_id": message.tool_call_id,
        "tool_name": message.tool_name,
        "is_error": message.is_error,
        "run_id": message.run_id,
        "created_at": now,
    }


def row_to_message(row: models.Message) -> Message:
    """The domain message of a stored row."""
    return Message(
        role=Role(row.role),
        content=row.content,
        tool_calls=[
            ToolCall(c["id"], c["name"], c.get("arguments") or {}) for c in row.tool_calls or []
        ],
        tool_call_id=row.tool_call_id,
        tool_name=row.tool_name,
        is_error=row.is_error,
        seq=row.seq,
        run_id=row.run_id,
        created_at=row.created_at,
    )


class SessionRepository:
    def __init__(self, session: AsyncSession) -> None:
        self._s = session

    async def get(self, session_id: str) -> models.Session | None:
        """The session row, or None."""
        return await self._s.scalar(select(models.Session).where(models.Session.id == session_id))

    async def list(
        self,
        *,
        tenant_id: str | None,
        agent: str | None,
        user_id: str | None,
        after: tuple[datetime, str] | None,
        limit: int,
        budget: int,
    ) -> Paged[models.Session]:
        """Sessions, most recently updated first, keyset-paginated on (updated_at, id)."""
        query = select(models.Session).where(
            models.Session.tenant_id.is_(None)
            if tenant_id is None
            else models.Session.tenant_id == tenant_id
        )
        if agent is not None:
            query = query.where(models.Session.agent == agent)
        if user_id is not None:
            query = query.where(models.Session.user_id == user_id)
        if after is not None:
            updated_at, session_id = after
            query = query.where(
                (models.Session.updated_at < updated_at)
                | ((models.Session.updated_at == updated_at) & (models.Session.id < session_id))
            )
        session = models.Session
        return await read_page(
            self._s,
            query=query.order_by(session.updated_at.desc(), session.id.desc()),
            limit=limit,
            budget=budget,
            size=chars(session.metadata_),
            keys=(session.updated_at, session.id),
            through=lambda last: (
                (session.updated_at > last[0])
                | ((session.updated_at == last[0]) & (session.id >= last[1]))
            ),
        )


class MessageRepository:
    """A session's messages, by the session's `key`."""

    def __init__(self, session: AsyncSession) -> None:
        self._s = session

    async def history(self, session_key: int) -> list[Message]:
        """The whole history in `seq` order."""
        rows = await self._s.scalars(
            select(models.Message)
            .where(models.Message.session_key == session_key)
            .order_by(models.Message.seq)
        )
        return [row_to_message(r) for r in rows]

    async def overtaken(self, session_key: int, *, run_id: str) -> bool:
        """Whether another run stored a message after this run's first one."""
        first = (
            select(func.min(models.Message.seq))
            .where(models.Message.session_key == session_key, models.Message.run_id == run_id)
            .scalar_subquery()
        )
        later = await self._s.scalar(
            select(models.Message.seq)
            .where(
                models.Message.session_key == session_key,
                models.Message.run_id.is_distinct_from(run_id),
                models.Message.seq > first,
            )
            .limit(1)
        )
        return later is not None

    async def last_tool_steps(self, session_keys: Sequence[int]) -> dict[int, list[Message]]:
        """Per session, the last assistant message that asked for tools and everything after
        it (sessions that never asked for a tool are left out): one query for a page. Only
        what tells which calls wait for a result is read (roles, call ids): contents are
        left empty, since a tool result may be megabytes."""
        if not session_keys:
            return {}
        message = models.Message
        last = (
            select(message.session_key, func.max(message.seq).label("seq"))
            .where(
                message.session_key.in_(session_keys),
                message.role == Role.ASSISTANT.value,
                message.tool_calls.is_not(None),
            )
            .group_by(message.session_key)
            .subquery()
        )
        rows = await self._s.execute(
            select(message.session_key, message.role, message.tool_calls, message.tool_call_id)
            .join(last, (message.session_key == last.c.session_key) & (message.seq >= last.c.seq))
            .order_by(message.session_key, message.seq)
        )
        steps: dict[int, list[Message]] = {}
        for key, role, tool_calls, tool_call_id in rows:
            calls = [ToolCall(c["id"], c["name"], {}) for c in tool_calls or []]
            entry = Message(Role(role), "", calls, tool_call_id=tool_call_id)
            steps.setdefault(key, []).append(entry)
        return steps

    async def page(
        self, session_key: int, *, after_seq: int | None, limit: int, budget: int
    ) -> Paged[models.Message]:
        """One page of the history, in order."""
        message = models.Message
        query = select(message).where(message.session_key == session_key)
        if after_seq is not None:
            query = query.where(message.seq > after_seq)
        return await read_page(
            self._s,
            query=query.order_by(message.seq),
            limit=limit,
            budget=budget,
            size=chars(message.content, message.tool_calls),
            keys=(message.seq,),
            through=lambda last: message.seq <= last[0],
        )

    async def for_run(self, session_key: int, *, run_id: str) -> Sequence[models.Message]:
        """The messages a run stored, in order (a scan of its session's history: run_id has no
        index of its own, which would cost every message row more than this read saves)."""
        return (
            await self._s.scalars(
                select(models.Message)
                .where(models.Message.session_key == session_key, models.Message.run_id == run_id)
                .order_by(models.Message.seq)
            )
        ).all()


class RunRepository:
    def __init__(self, session: AsyncSession) -> None:
        self._s = session

    async def get(self, run_id: str) -> models.Run | None:
        """The run row, or None."""
        return await self._s.get(models.Run, run_id)

    async def by_idempotency_key(self, session_id: str, *, key: str) -> models.Run | None:
        """The session's run started under `key`, if any."""
        return await self._s.scalar(
            select(models.Run).where(
                models.Run.session_id == session_id, models.Run.idempotency_key == key
            )
        )

    @staticmethod
    def _running(session_id: str) -> Select[str]:
        return select(models.Run.id).where(
            models.Run.session_id == session_id, models.Run.status == RunStatus.RUNNING
        )

    async def latest_running(self, session_id: str) -> str | None:
        """The newest run of the session still marked `running`."""
        return await self._s.scalar(
            self._running(session_id).order_by(models.Run.created_at.desc()).limit(1)
        )

    async def finished_since(self, session_id: str, *, moment: datetime) -> str | None:
        """The run of the session that finished last, if that was at or after `moment`."""
        return await self._s.scalar(
            select(models.Run.id)
            .where(models.Run.session_id == session_id, models.Run.finished_at >= moment)
            .order_by(models.Run.finished_at.desc())
            .limit(1)
        )

    async def running_ids(self, session_id: str) -> list[str]:
        """Ids of the session's runs still marked `running`."""
        return list(await self._s.scalars(self._running(session_id)))

    async def list_for_session(
        self, session_id: str, *, after: tuple[datetime, str] | None, limit: int, budget: int
    ) -> Paged[models.Run]:
        """The session's runs, newest first, keyset-paginated on (created_at, id)."""
        query = select(models.Run).where(models.Run.session_id == session_id)
        if after is not None:
            created_at, run_id = after
            query = query.where(
                (models.Run.created_at < created_at)
                | ((models.Run.created_at == created_at) & (models.Run.id < run_id))
            )
        run = models.Run
        return await read_page(
            self._s,
            query=query.order_by(run.created_at.desc(), run.id.desc()),
            limit=limit,
            budget=budget,
            size=chars(run.metadata_, run.response, run.error_message),
            keys=(run.created_at, run.id),
            through=lambda last: (
                (run.created_at > last[0]) | ((run.created_at == last[0]) & (run.id >= last[1]))
            ),
        )


def delete_session(
    conn: Connection, *, session_id: str, fence_sql: str, fence: dict[str, Any]
) -> None:
    """Delete the session with its runs and messages (a Transactor body), only while the
    ownership's fence holds, as every durable write checks it: the session's row is
    locked first, so a write of whoever took the session over waits for this one and then
    finds nothing to write to, and the fence is asked last, before the commit (the hold
    may have ended while the lock, or a delete, waited for a row). SessionConflict, and
    nothing deleted, if the fence does not hold."""
    locked = select(models.Session.key).where(models.Session.id == session_id).with_for_update()
    key = conn.execute(locked).scalar()
    if key is None:
        raise SessionConflict(session_id)
    conn.execute(delete(models.Message).where(models.Message.session_key == key))
    conn.execute(delete(models.Run).where(models.Run.session_id == session_id))
    conn.execute(delete(models.Session).where(models.Session.id == session_id))
    if not conn.execute(select(text(fence_sql).bindparams(**fence))).scalar():
        raise SessionConflict(session_id)  # and the deletes are rolled back
