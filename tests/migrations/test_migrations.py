"""Migrations on a fresh, empty database of each backend: up, down, up; no autogenerate diff."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect, text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from app.db.base import Base
from app.db.migrate import current_revision, downgrade, head_revision, upgrade
from app.db.urls import async_url
from tests.conftest import PG_ADMIN_URL, REQUIRE_POSTGRES, _pg_admin, _pg_url

TABLES = {"session", "run", "message"}
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def empty_url(backend: str, tmp_path: Path) -> Iterator[str]:
    """A database with nothing in it, not even alembic_version."""
    if backend == "sqlite":
        yield f"sqlite:///{tmp_path / 'fresh.db'}"
        return
    name = f"ar_migrate_{uuid.uuid4().hex[:12]}"
    try:
        _pg_admin(f'CREATE DATABASE "{name}"')
    except (OSError, asyncpg.PostgresError) as exc:
        if REQUIRE_POSTGRES:
            pytest.fail(f"PostgreSQL is required but unreachable at {PG_ADMIN_URL}: {exc}")
        pytest.skip(f"PostgreSQL unreachable at {PG_ADMIN_URL}: {exc}")
    try:
        yield _pg_url(name)
    finally:
        _pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _schema(connection: Connection) -> tuple[set[str], list[Any]]:
    """The tables present, and what autogenerate would change to match the models."""
    context = MigrationContext.configure(connection, opts={"compare_type": True})
    return set(inspect(connection).get_table_names()), compare_metadata(context, Base.metadata)


def inspect_schema(database_url: str) -> tuple[set[str], list[Any], str | None]:
    """(tables, autogenerate diff, alembic revision) of the database, from a fresh engine."""

    async def go() -> tuple[set[str], list[Any], str | None]:
        engine = create_async_engine(async_url(database_url), poolclass=NullPool)
        try:
            async with engine.connect() as conn:
                tables, diff = await conn.run_sync(_schema)
                revision = await current_revision(conn) if "alembic_version" in tables else None
                return tables, diff, revision
        finally:
            await engine.dispose()

    return asyncio.run(go())


def test_upgrade_downgrade_upgrade_leaves_no_autogenerate_diff(empty_url: str) -> None:
    head = head_revision()
    assert head is not None

    upgrade(empty_url)
    tables, diff, revision = inspect_schema(empty_url)
    assert tables == TABLES | {"alembic_version"}
    assert diff == []
    assert revision == head

    downgrade(empty_url, revision="base")
    tables, diff, revision = inspect_schema(empty_url)
    assert tables == {"alembic_version"}
    assert revision is None
    # The no-diff assertions mean something only if compare_metadata sees a difference.
    assert {entry[1].name for entry in diff if entry[0] == "add_table"} == TABLES

    upgrade(empty_url)
    tables, diff, revision = inspect_schema(empty_url)
    assert tables == TABLES | {"alembic_version"}
    assert diff == []
    assert revision == head

    upgrade(empty_url)  # already at head: nothing changes
    assert inspect_schema(empty_url) == (TABLES | {"alembic_version"}, [], head)


def _sql(database_url: str, *statements: str) -> list[Any]:
    """Run statements in one transaction; the rows of the last one."""

    async def go() -> list[Any]:
        engine = create_async_engine(async_url(database_url), poolclass=NullPool)
        try:
            async with engine.begin() as conn:
                for statement in statements:
                    result = await conn.execute(text(statement))
                return list(result) if result.returns_rows else []
        finally:
            await engine.dispose()

    return asyncio.run(go())


def test_the_message_key_migration_keeps_every_message_both_ways(empty_url: str) -> None:
    before = "9b3f5d1e7a22"  # message still has its surrogate id
    upgrade(empty_url, revision=before)
    _sql(
        empty_url,
        "INSERT INTO session (id, agent, metadata, message_count, created_at, updated_at)"
        " VALUES ('s', 'main', '{}', 3, '2026-11-29 00:00:00', '2026-11-29 00:00:00')",
        *(
            "INSERT INTO message (session_id, seq, role, content, is_error, created_at)"
            f" VALUES ('s', {seq}, 'user', 'm{seq}', false, '2026-11-29 00:00:00')"
            for seq in (1, 2, 3)
        ),
    )
    history = "SELECT seq, content FROM message WHERE session_id = 's' ORDER BY seq"

    upgrade(empty_url, revision="c4a7e2b9d013")
    assert _sql(empty_url, history) == [(1, "m1"), (2, "m2"), (3, "m3")]

    downgrade(empty_url, revision=before)
    assert _sql(empty_url, history) == [(1, "m1"), (2, "m2"), (3, "m3")]
    ids = [row[0] for row in _sql(empty_url, "SELECT id FROM message")]
    assert len(set(ids)) == 3 and None not in ids


def test_the_session_key_migration_keeps_every_message_with_its_session(empty_url: str) -> None:
    before = "c4a7e2b9d013"  # message rows still carry session_id
    upgrade(empty_url, revision=before)
    _sql(
        empty_url,
        *(
            "INSERT INTO session (id, agent, metadata, message_count, created_at, updated_at)"
            f" VALUES ('{sid}', 'main', '{{}}', 2, '2026-11-29 00:00:00', '2026-11-29 00:00:00')"
            for sid in ("b", "a")
        ),
        "INSERT INTO run (id, session_id, agent, status, iterations, input_tokens,"
        " output_tokens, metadata, created_at)"
        " VALUES ('r', 'a', 'main', 'complete', 1, 0, 0, '{}', '2026-11-29 00:00:00')",
        *(
            "INSERT INTO message (session_id, seq, role, content, is_error, created_at)"
            f" VALUES ('{sid}', {seq}, 'user', '{sid}{seq}', false, '2026-11-29 00:00:00')"
            for sid in ("a", "b")
            for seq in (1, 2)
        ),
    )
    old_history = "SELECT session_id, seq, content FROM message ORDER BY session_id, seq"
    stored = [("a", 1, "a1"), ("a", 2, "a2"), ("b", 1, "b1"), ("b", 2, "b2")]
    assert _sql(empty_url, old_history) == stored

    upgrade(empty_url)
    assert inspect_schema(empty_url)[1] == []
    history = (
        "SELECT s.id, m.seq, m.content FROM message m JOIN session s ON s.key = m.session_key"
        " ORDER BY s.id, m.seq"
    )
    assert _sql(empty_url, history) == stored
    # A new session is numbered after the existing ones; deleting one takes its messages.
    _sql(
        empty_url,
        "INSERT INTO session (id, agent, metadata, message_count, created_at, updated_at)"
        " VALUES ('c', 'main', '{}', 0, '2026-11-29 00:00:00', '2026-11-29 00:00:00')",
    )
    keys = dict(_sql(empty_url, "SELECT id, key FROM session"))
    assert len(set(keys.values())) == 3 and keys["c"] > max(keys["a"], keys["b"])
    _sql(empty_url, "DELETE FROM session WHERE id = 'c'")

    downgrade(empty_url, revision=before)
    assert _sql(empty_url, old_history) == stored
    assert _sql(empty_url, "SELECT id, session_id FROM run") == [("r", "a")]


def test_the_stop_reason_migration_adds_a_null_stop_reason_and_keeps_every_run(
    empty_url: str,
) -> None:
    before = "3f6a9c2d8e41"  # run has no stop_reason
    upgrade(empty_url, revision=before)
    _sql(
        empty_url,
        "INSERT INTO session (id, agent, metadata, message_count, created_at, updated_at)"
        " VALUES ('s', 'main', '{}', 0, '2026-11-30 00:00:00', '2026-11-30 00:00:00')",
        "INSERT INTO run (id, session_id, agent, status, response, iterations, input_tokens,"
        " output_tokens, metadata, created_at)"
        " VALUES ('r', 's', 'main', 'complete', 'done', 1, 3, 4, '{}', '2026-11-30 00:00:00')",
    )
    runs = "SELECT id, status, response, iterations, input_tokens, output_tokens FROM run"
    stored = [("r", "complete", "done", 1, 3, 4)]

    upgrade(empty_url)
    assert inspect_schema(empty_url)[1] == []
    assert _sql(empty_url, runs) == stored
    assert _sql(empty_url, "SELECT stop_reason FROM run") == [(None,)]
    _sql(empty_url, "UPDATE run SET stop_reason = 'max_tokens'")

    downgrade(empty_url, revision=before)
    assert _sql(empty_url, runs) == stored
    assert "stop_reason" not in inspect_columns(empty_url, "run")


def inspect_columns(database_url: str, table: str) -> set[str]:
    """The names of the table's columns."""

    async def go() -> set[str]:
        engine = create_async_engine(async_url(database_url), poolclass=NullPool)
        try:
            async with engine.connect() as conn:
                columns = await conn.run_sync(lambda c: inspect(c).get_columns(table))
                return {column["name"] for column in columns}
        finally:
            await engine.dispose()

    return asyncio.run(go())


def test_concurrent_upgrades_in_threads_both_succeed(empty_url: str) -> None:
    barrier = threading.Barrier(2)

    def race() -> None:
        barrier.wait(timeout=10)
        upgrade(empty_url)

    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(race) for _ in range(2)]
        for future in futures:
            future.result(timeout=60)

    tables, diff, revision = inspect_schema(empty_url)
    assert tables == TABLES | {"alembic_version"}
    assert diff == []
    assert revision == head_revision()


def test_concurrent_upgrades_from_two_processes_both_succeed(empty_url: str) -> None:
    # Two replicas starting at once: separate interpreters, one database.
    code = "import sys; from app.db.migrate import upgrade; upgrade(sys.argv[1])"
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", code, empty_url],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    for process in processes:
        _, stderr = process.communicate(timeout=60)
        assert process.returncode == 0, stderr

    tables, diff, revision = inspect_schema(empty_url)
    assert tables == TABLES | {"alembic_version"}
    assert diff == []
    assert revision == head_revision()
