"""Schema upgrades with alembic, safe when several replicas start at once."""

from __future__ import annotations

import fcntl
import functools
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeGuard

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, text
from sqlalchemy.ext.asyncio import AsyncConnection

from app.db.outages import read_again_if_disconnected
from app.db.session import Database
from app.db.urls import MEMORY_URL, check_database_url, sqlite_file
from app.errors import ConfigError

# Alembic keeps its migration context in a process-wide global: one upgrade per process at a time.
_in_process = threading.Lock()

# pg_advisory_xact_lock key that serialises concurrent upgrades ("agentrun" in ASCII).
MIGRATION_LOCK_KEY = 0x6167656E7472756E


def migrations_dir() -> Path:
    """The alembic scripts: beside the `app` package in a checkout, else ./migrations (as in
    the image); ConfigError when neither is there."""
    for folder in (Path(__file__).resolve().parents[2] / "migrations", Path.cwd() / "migrations"):
        if (folder / "env.py").exists():
            return folder
    raise ConfigError(
        "the schema migrations are not beside the app package nor in ./migrations;"
        " run agent-runner from the folder that holds migrations/"
    )


def alembic_config(database_url: str | None) -> Config:
    """An alembic Config for DATABASE_URL (no alembic.ini needed)."""
    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    if database_url is not None:
        config.attributes["database_url"] = check_database_url(database_url)
    return config


def head_revision() -> str | None:
    """The newest migration."""
    return ScriptDirectory.from_config(alembic_config(None)).get_current_head()


@functools.cache  # the build's migrations do not change while it runs; /readyz asks often
def known_revisions() -> frozenset[str]:
    """Every migration this build has (a schema at another one is a newer build's)."""
    scripts = ScriptDirectory.from_config(alembic_config(None))
    return frozenset(script.revision for script in scripts.walk_revisions())


def from_a_newer_build(revision: str | None) -> TypeGuard[str]:
    """Whether a schema at `revision` is a newer build's: a migration this build lacks."""
    return revision is not None and revision not in known_revisions()


async def current_revision(conn: AsyncConnection) -> str | None:
    """The revision the connected database is at, or None before the first migration; a
    database that does not answer raises (it is not a schema without migrations)."""
    if not await conn.run_sync(lambda sync: inspect(sync).has_table("alembic_version")):
        return None
    return (await conn.execute(text("SELECT version_num FROM alembic_version"))).scalar()


@contextmanager
def _file_lock(database_url: str) -> Iterator[None]:
    """On SQLite, one upgrader at a time per database file (PostgreSQL locks in env.py)."""
    database = sqlite_file(database_url)
    if database is None:
        yield
        return
    path = Path(f"{database}.migrate.lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def upgrade(database_url: str, *, revision: str = "head") -> None:
    """Upgrade the schema to `revision`; memory:// has none to upgrade."""
    if database_url == MEMORY_URL:
        return
    with _in_process, _file_lock(database_url):
        command.upgrade(alembic_config(database_url), revision)


def downgrade(database_url: str, *, revision: str) -> None:
    """Downgrade the schema to `revision` (used by the migration tests)."""
    with _in_process, _file_lock(database_url):
        command.downgrade(alembic_config(database_url), revision)


@dataclass(frozen=True)
class DatabaseState:
    revision: str | None  # None for memory://, which has none
    read_only: bool  # PostgreSQL takes no writes now (a standby, default_transaction_read_only)


@read_again_if_disconnected
async def database_state(db: Database) -> DatabaseState:
    """The schema's revision and whether the database takes writes, read on one connection:
    raises whatever the driver raises when the database does not answer."""
    async with db.engine.connect() as conn:
        if not db.durable:
            await conn.execute(text("SELECT 1"))
            return DatabaseState(None, read_only=False)
        revision = await current_revision(conn)
        if db.dialect != "postgresql":
            return DatabaseState(revision, read_only=False)
        sql = "SELECT pg_is_in_recovery() OR current_setting('transaction_read_only') = 'on'"
        read_only = bool(await conn.scalar(text(sql)))
        if read_only:  # perhaps this connection's own default: the next check asks a new one
            await conn.invalidate()
        return DatabaseState(revision, read_only=read_only)
