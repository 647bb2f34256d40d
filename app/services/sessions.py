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
from app.db.pages import Paged
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
from app.schemas.common import (
    PAGE_MAX_BYTES,
    Page,
    decode_cursor,
    decode_seq,
    encode_cursor,
    next_after,
)
from app.schemas.runs import MessageRead, RunSummary
from app.schemas.sessions import SessionRead
from app.services.access import active_run, check_session_access, read_runs_owned, run_summary
from app.services.ownership import Ownership

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
            row = await self._visible(
                session, session_id=session_id, tenant_id=tenant_id, user_id=user_id
            )
            waiting = await self._waiting(session, rows=[row])
        held = await self.ownership.held_among([session_id])
        waiting = await self._still_waiting([row], waiting=waiting, held=held)
        return _session_read(row, status=_status(held=bool(held), orphans=bool(waiting)))

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
            listed = await SessionRepository(session).list(
                tenant_id=tenant_id,
                agent=agent,
                user_id=user_id,
                after=decode_cursor(after, listing=SESSIONS_LIST) if after else None,
                limit=limit,
                budget=PAGE_MAX_BYTES,
            )
            rows = listed.rows
            waiting = await self._waiting(session, rows=rows)
        # One ownership lookup for the page, outside the transaction.
        held = await self.ownership.held_among([r.id for r in rows])
        waiting = await self._still_waiting(rows, waiting=waiting, held=held)
        page = [
            _session_read(r, status=_status(held=r.id in held, orphans=r.id in waiting))
            for r in rows
        ]
        cursor = next_after(
            rows,
            more=listed.more,
            cursor=lambda r: encode_cursor(r.updated_at, key=r.id, listing=SESSIONS_LIST),
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
            row = await self._visible(
                session, session_id=session_id, tenant_id=tenant_id, user_id=user_id
            )
            page = await MessageRepository(session).page(
                row.key, after_seq=after_seq, limit=limit, budget=PAGE_MAX_BYTES
            )
        data = [MessageRead.of(row_to_message(r)) for r in page.rows]
        return Page(
            data=data,
            next_after=next_after(page.rows, more=page.more, cursor=lambda r: str(r.seq)),
        )

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

        async def read() -> Paged[models.Run]:
            async with self.db.reads.begin() as session:
                await self._visible(
                    session, session_id=session_id, tenant_id=tenant_id, user_id=user_id
                )
                return await RunRepository(session).list_for_session(
                    session_id,
                    after=decode_cursor(after, listing=runs_list) if after else None,
                    limit=limit,
                    budget=PAGE_MAX_BYTES,
                )

        page, ownerless = await read_runs_owned(
            self.ownership, read=read, runs_of=lambda page: page.rows
        )
        data = [run_summary(r, ownerless=r.id in ownerless) for r in page.rows]
        cursor = next_after(
            page.rows,
            more=page.more,
            cursor=lambda r: encode_cursor(r.created_at, key=r.id, listing=runs_list),
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
            active = await active_run(
                self.db, ownership=self.ownership, busy=busy, session_id=session_id, since=asked
            )
            raise SessionBusy(session_id, active_run_id=active) from busy

    async def _delete_held(self, session_id: str) -> None:
        """The delete, while this runner holds the session. Should its connection end under
        it (the server had ended it unseen), whether it committed is unknown; nobody else
        can have changed the session meanwhile, so the session's presence tells, and it is
        sent again if it had not."""
        # Every write goes through db.writes (app/db/session.py, a Transactor).
        delete = partial(
            delete_session,
            session_id=session_id,
            fence_sql=self.ownership.fence_sql,
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
            await self._visible(
                session, session_id=session_id, tenant_id=tenant_id, user_id=user_id
            )

    @staticmethod
    async def _waiting(
        session: AsyncSession, *, rows: Sequence[models.Session]
    ) -> dict[str, frozenset[str]]:
        """The sessions with calls waiting for a result, and those calls' ids."""
        steps = await MessageRepository(session).last_tool_steps([r.key for r in rows])
        waiting = {r.id: orphaned_calls(steps.get(r.key, []))[1] for r in rows}
        return {s: frozenset(c.id for c in calls) for s, calls in waiting.items() if calls}

    async def _still_waiting(
        self, rows: Sequence[models.Session], *, waiting: dict[str, frozenset[str]], held: set[str]
    ) -> dict[str, frozenset[str]]:
        """`waiting` (as read before `held` was asked), less the sessions nobody holds whose
        calls no longer wait when read again: their turn answered them and ended between the
        read and the question, so they are idle, not in need of a resume. A call that waited
        both times waited, with nobody to answer it, when the question was asked."""
        doubted = [r for r in rows if r.id in waiting and r.id not in held]
        if not doubted:
            return waiting
        async with self.db.reads.begin() as session:
            again = await self._waiting(session, rows=doubted)
        answered = {r.id for r in doubted if not waiting[r.id] & again.get(r.id, frozenset())}
        return {s: calls for s, calls in waiting.items() if s not in answered}

    @staticmethod
    async def _visible(
        session: AsyncSession, *, session_id: str, tenant_id: str | None, user_id: str | None
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


def _session_read(row: models.Session, *, status: SessionStatus) -> SessionRead:
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
