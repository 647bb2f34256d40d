"""Alembic environment: the app's drivers (SQLite's own for SQLite), and a lock so concurrent
upgrades run one at a time."""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy import create_engine, text
from sqlalchemy.engine import URL, Connection, make_url
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from app.db.base import UTCDateTime
from app.db.migrate import MIGRATION_LOCK_KEY, from_a_newer_build
from app.db.models import Base
from app.db.urls import async_url, pg_connector
from app.errors import SchemaAhead

config = context.config
target_metadata = Base.metadata


def _render_item(type_: str, obj: object, autogen_context: object) -> str | bool:
    """Render our UTCDateTime as the plain column type it stores, so scripts need no app import."""
    if type_ == "type" and isinstance(obj, UTCDateTime):
        return "sa.DateTime(timezone=True)"
    return False


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
        render_item=_render_item,
    )
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            # Held until this transaction ends: a second replica waits, then finds nothing to do.
            connection.execute(text(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK_KEY})"))
        current = context.get_context().get_current_revision()
        if from_a_newer_build(current):
            raise SchemaAhead(current)  # alembic's own error would be a traceback
        context.run_migrations()


async def _run_async(database_url: str) -> None:
    # Connected as the service connects (pg_connector), so the URL's options mean the same.
    connect = pg_connector(database_url)
    engine = create_async_engine(async_url(database_url), poolclass=NullPool, async_creator=connect)
    try:
        async with engine.connect() as connection:
            await connection.run_sync(_run)
    finally:
        await engine.dispose()


def _run_sqlite(url: URL) -> None:
    # The standard library's driver on this thread, not aiosqlite: when a file cannot be
    # opened, aiosqlite's worker thread outlives the event loop and prints a traceback of its
    # own after the one-line error (about one start in four).
    engine = create_engine(url.set(drivername="sqlite"), poolclass=NullPool)
    try:
        with engine.connect() as connection:
            _run(connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    raise SystemExit("offline (--sql) migrations are not supported; run `agent-runner migrate`")
_configured = config.attributes.get("database_url") or config.get_main_option("sqlalchemy.url")
if _configured is None:
    raise SystemExit("no database URL: run `agent-runner migrate` (it reads DATABASE_URL)")
_url = make_url(_configured)
if _url.get_backend_name() == "sqlite":
    _run_sqlite(_url)
else:
    asyncio.run(_run_async(_configured))
