"""Reading and deleting sessions, their messages and runs."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncSession

from app.db import models
from app.db.base import utcnow
from app.db.outages import read_again_if_disconnected
from app.db.repositories import (
    MessageRepository,
    RunRepository,
    SessionRepository,
    delete_session,
    row_to_message,
)
from app.db.session import Database
from app.domain import SessionStatus, orphaned_calls
from app.errors import SessionBusy, SessionNotFound
from app.metrics import Metrics
from app.schemas.common import Page, decode_cursor, decode_seq, encode_cursor, next_after
from app.schemas.runs import MessageRead, RunSummary, SessionRead
from app.services.access import active_run, check_session_access
from app.services.ownership import Ownership
from app.services.runs import run_summary, running_held

log = logging.getLogger(__name__)

# What a cursor names as its list (app.schemas.common.encode_cursor).
SESSIONS_LIST = "sessions"


@dataclass
class SessionService:
    """Reading and deleting sessions, their messages and runs, as their tenant and user."""

    db: Database
    ownership: Ownership
    metrics: Metrics

    @read_again_if_disconnected
    async def get(
        self, session_id: str, *, tenant_id: str | None, user_id: str | None
    ) -> SessionRead:
        """One session with its status."""
        async with self.db.reads.begin() as session:
            row = await self._visible(session, session_id, tenant_id=tenant_id, user_id=user_id)
            orphaned = await self._orphaned(session, [row])
        held = await self.ownership.is_held(session_id)
        return _session_read(row, _status(held=held, orphans=bool(orphaned)))

    @read_again_if_disconnected
    async def list(
        self,
        *,
        tenant_id: str | None,
        agent: str | None,
        user_id: str | None,
        after: str | None,
        limit: int,
    ) -> Page[SessionRead]:
        """Sessions, most recently updated first."""
        async with self.db.reads.begin() as session:
            rows = await SessionRepository(session).list(
                tenant_id=tenant_id,
                agent=agent,
                user_id=user_id,
                after=decode_cursor(after, listing=SESSIONS_LIST) if after else None,
                limit=limit + 1,
            )
            orphaned = await self._orphaned(session, rows[:limit])
        # One ownership lookup for the page, outside the transaction.
        held = await self.ownership.held_among([r.id for r in rows[:limit]])
        page = [
            _session_read(r, _status(held=r.id in held, orphans=r.id in orphaned))
            for r in rows[:limit]
        ]
        cursor = next_after(
            rows, limit, lambda r: encode_cursor(r.updated_at, r.id, listing=SESSIONS_LIST)
        )
        return Page(data=page, next_after=cursor)

    @read_again_if_disconnected
    async def messages(
        self,
        session_id: str,
        *,
        tenant_id: str | None,
        user_id: str | None,
        after: str | None,
        limit: int,
    ) -> Page[MessageRead]:
        """The history in order."""
        after_seq = decode_seq(after) if after else None
        async with self.db.reads.begin() as session:
            row = await self._visible(session, session_id, tenant_id=tenant_id, user_id=user_id)
            rows = await MessageRepository(session).page(
                row.key, after_seq=after_seq, limit=limit + 1
            )
        data = [MessageRead.of(row_to_message(r)) for r in rows[:limit]]
        return Page(data=data, next_after=next_after(rows, limit, lambda r: str(r.seq)))

    @read_again_if_disconnected
    async def runs(
        self,
        session_id: str,
        *,
        tenant_id: str | None,
        user_id: str | None,
        after: str | None,
        limit: int,
    ) -> Page[RunSummary]:
        """The session's runs, newest first."""
        runs_list = f"runs of {session_id}"  # a cursor of one session's runs, not another's
        async with self.db.reads.begin() as session:
            await self._visible(session, session_id, tenant_id=tenant_id, user_id=user_id)
            rows = await RunRepository(session).list_for_session(
                session_id,
                after=decode_cursor(after, listing=runs_list) if after else None,
                limit=limit + 1,
            )
        held = await running_held(self.ownership, session_id, rows[:limit])
        data = [run_summary(r, held=held) for r in rows[:limit]]
        cursor = next_after(
            rows, limit, lambda r: encode_cursor(r.created_at, r.id, listing=runs_list)
        )
        return Page(data=data, next_after=cursor)

    async def delete(self, session_id: str, *, tenant_id: str | None, user_id: str | None) -> None:
        """Delete the session, its runs and messages; not while a run is in progress."""
        # First: a 409 must not tell other tenants or users that the session exists.
        await self._check_visible(session_id, tenant_id=tenant_id, user_id=user_id)
        asked = utcnow()
        try:
            async with self.ownership.hold(session_id):
                await self._check_visible(session_id, tenant_id=tenant_id, user_id=user_id)
                await self._delete_held(session_id)
        except SessionBusy as busy:
            self.metrics.session_busy.inc()
            active = await active_run(self.db, self.ownership, busy, session_id, since=asked)
            raise SessionBusy(session_id, active) from busy

    async def _delete_held(self, session_id: str) -> None:
        """The delete, while this runner holds the session. Should its connection end under
        it (the server had ended it unseen), whether it committed is unknown; nobody else
        can have changed the session meanwhile, so the session's presence tells, and it is
        sent again if it had not."""
        # Every write goes through db.writes (app/db/session.py, a Transactor).
        delete = partial(
            delete_session,
            session_id=session_id,
            row_fence_sql=self.ownership.row_fence_sql,
            fence=self.ownership.fence_params(session_id),
        )
        try:
            await self.db.writes.transact(delete)
        except DBAPIError as exc:
            if not exc.connection_invalidated:
                raise
            if await self._stored(session_id):
                log.info("a pooled database connection had been ended: deleting again")
                await self.db.writes.transact(delete)

    @read_again_if_disconnected
    async def _stored(self, session_id: str) -> bool:
        async with self.db.reads.begin() as session:
            return await SessionRepository(session).get(session_id) is not None

    @read_again_if_disconnected
    async def _check_visible(
        self, session_id: str, *, tenant_id: str | None, user_id: str | None
    ) -> None:
        async with self.db.reads.begin() as session:
            await self._visible(session, session_id, tenant_id=tenant_id, user_id=user_id)

    @staticmethod
    async def _orphaned(session: AsyncSession, rows: Sequence[models.Session]) -> set[str]:
        """Which of the sessions have calls waiting for a result (`needs_resume`)."""
        steps = await MessageRepository(session).last_tool_steps([r.key for r in rows])
        return {r.id for r in rows if orphaned_calls(steps.get(r.key, []))[1]}

    @staticmethod
    async def _visible(
        session: AsyncSession, session_id: str, *, tenant_id: str | None, user_id: str | None
    ) -> models.Session:
        row = await SessionRepository(session).get(session_id)
        if row is None:
            raise SessionNotFound(session_id)
        check_session_access(row, tenant_id=tenant_id, user_id=user_id, for_turn=False)
        return row


def _status(*, held: bool, orphans: bool) -> SessionStatus:
    if held:
        return SessionStatus.RUNNING
    return SessionStatus.NEEDS_RESUME if orphans else SessionStatus.IDLE


def _session_read(row: models.Session, status: SessionStatus) -> SessionRead:
    return SessionRead(
        id=row.id,
        agent=row.agent,
        user_id=row.user_id,
        tenant_id=row.tenant_id,
        metadata=row.metadata_ or {},
        created_at=row.created_at,
        updated_at=row.updated_at,
        message_count=row.message_count,
        status=status,
    )
