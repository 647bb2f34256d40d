"""Repositories: the queries (and the delete) inside the caller's transaction; they never commit.

The hot path, the runner's per-step writes, is not here but in app/db/journal/.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Select, bindparam, delete, func, select, text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncSession

from app.db import models
from app.db.pages import Paged, page_statement, read_page, stored_bytes
from app.domain import Message, Role, RunStatus, ToolCall
from app.errors import SessionConflict


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


# The columns a domain message is made of, in the order of `_message`'s parameters.
_MESSAGE_FIELDS = tuple(
    getattr(models.Message, name)
    for name in (
        "role",
        "content",
        "tool_calls",
        "tool_call_id",
        "tool_name",
        "is_error",
        "seq",
        "run_id",
        "created_at",
    )
)


def _message(  # noqa: PLR0917  # a row's columns, in `_MESSAGE_FIELDS` order
    role: str,
    content: str,
    tool_calls: list[dict[str, Any]] | None,
    tool_call_id: str | None,
    tool_name: str | None,
    is_error: bool,
    seq: int,
    run_id: str | None,
    created_at: datetime,
) -> Message:
    return Message(
        role=Role(role),
        content=content,
        tool_calls=[
            ToolCall(c["id"], c["name"], c.get("arguments") or {}) for c in tool_calls or []
        ],
        tool_call_id=tool_call_id,
        tool_name=tool_name,
        is_error=is_error,
        seq=seq,
        run_id=run_id,
        created_at=created_at,
    )


def row_to_message(row: models.Message) -> Message:
    """The domain message of a stored row."""
    return _message(*(getattr(row, column.key) for column in _MESSAGE_FIELDS))


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
        params: dict[str, Any] = {"tenant_id": tenant_id, "agent": agent, "user_id": user_id}
        if after is not None:
            params["after_at"], params["after_id"] = after
        statement = _sessions_page(
            tenant=tenant_id is not None,
            agent=agent is not None,
            user=user_id is not None,
            after=after is not None,
        )
        return await read_page(
            self._s, statement=statement, params=params, limit=limit, budget=budget
        )


@functools.cache
def _sessions_page(*, tenant: bool, agent: bool, user: bool, after: bool) -> Select[Any]:
    """The page statement of sessions filtered so (`SessionRepository.list`'s parameters)."""
    session = models.Session
    query = select(session).where(
        session.tenant_id == bindparam("tenant_id") if tenant else session.tenant_id.is_(None)
    )
    if agent:
        query = query.where(session.agent == bindparam("agent"))
    if user:
        query = query.where(session.user_id == bindparam("user_id"))
    if after:
        at = bindparam("after_at", type_=session.updated_at.type)
        query = query.where(
            (session.updated_at < at)
            | ((session.updated_at == at) & (session.id < bindparam("after_id")))
        )
    return page_statement(
        query,
        entity=session,
        keys=(session.updated_at, session.id),
        descending=True,
        size=stored_bytes(session.metadata_),
    )


class MessageRepository:
    """A session's messages, by the session's `key`."""

    def __init__(self, session: AsyncSession) -> None:
        self._s = session

    async def history(self, session_key: int) -> list[Message]:
        """The whole history in `seq` order. Read as columns, not as ORM rows: a turn reads
        it before its first step, on the event loop's thread, and ORM rows took twice as long
        (200 ms for 5,000 messages)."""
        rows = await self._s.execute(
            select(*_MESSAGE_FIELDS)
            .where(models.Message.session_key == session_key)
            .order_by(models.Message.seq)
        )
        return [_message(*row) for row in rows]

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
        params = {"session_key": session_key, "after_seq": after_seq or 0}  # seqs start at 1
        return await read_page(
            self._s, statement=_history_page(), params=params, limit=limit, budget=budget
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


@functools.cache
def _history_page() -> Select[Any]:
    """The page statement of a session's history (`MessageRepository.page`)."""
    message = models.Message
    return page_statement(
        select(message).where(
            message.session_key == bindparam("session_key"),
            message.seq > bindparam("after_seq"),
        ),
        entity=message,
        keys=(message.seq,),
        descending=False,
        size=stored_bytes(message.content, message.tool_calls),
    )


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
        params: dict[str, Any] = {"session_id": session_id}
        if after is not None:
            params["after_at"], params["after_id"] = after
        return await read_page(
            self._s,
            statement=_runs_page(after=after is not None),
            params=params,
            limit=limit,
            budget=budget,
        )


@functools.cache
def _runs_page(*, after: bool) -> Select[Any]:
    """The page statement of a session's runs (`RunRepository.list_for_session`)."""
    run = models.Run
    query = select(run).where(run.session_id == bindparam("session_id"))
    if after:
        at = bindparam("after_at", type_=run.created_at.type)
        query = query.where(
            (run.created_at < at) | ((run.created_at == at) & (run.id < bindparam("after_id")))
        )
    return page_statement(
        query,
        entity=run,
        keys=(run.created_at, run.id),
        descending=True,
        size=stored_bytes(run.metadata_, run.response, run.error_message),
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
