"""The schema revision a test database stores, read (or set) past the service, on either store."""

from __future__ import annotations

import asyncio

from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from app.db.migrate import current_revision
from app.db.urls import async_url


def stored_revision(database_url: str, *, set_to: str | None = None) -> str | None:
    """The revision alembic_version holds, first set to `set_to` if given."""

    async def go() -> str | None:
        engine = create_async_engine(async_url(database_url), poolclass=NullPool)
        try:
            async with engine.begin() as conn:
                if set_to is not None:
                    update = text("UPDATE alembic_version SET version_num = :revision")
                    await conn.execute(update, {"revision": set_to})
                return await current_revision(conn)
        finally:
            await engine.dispose()

    return asyncio.run(go())
