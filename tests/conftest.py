"""Shared fixtures: both stores, the fake model, the tool server.

PostgreSQL: `TEST_POSTGRES_URL` (default postgresql://postgres@127.0.0.1:5432/test) names an
admin connection; each test gets a fresh database cloned from a migrated template. With
`AGENT_RUNNER_REQUIRE_POSTGRES=1` (CI) an unreachable server fails the tests instead of
skipping them.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import asyncpg
import pytest
from sqlalchemy.engine import make_url

from app.db.migrate import upgrade
from tests.support.agents import write_agents_file
from tests.support.fake_anthropic import FakeAnthropic
from tests.support.server import AgentsServer, ServerProcess
from tests.support.tool_server import ToolServer

PG_ADMIN_URL = os.environ.get("TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
REQUIRE_POSTGRES = os.environ.get("AGENT_RUNNER_REQUIRE_POSTGRES") == "1"
BACKENDS = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
]


def _pg_url(database: str) -> str:
    return make_url(PG_ADMIN_URL).set(database=database).render_as_string(hide_password=False)


def _pg_admin(*statements: str) -> None:
    async def run() -> None:
        conn = await asyncpg.connect(PG_ADMIN_URL.replace("postgresql://", "postgres://", 1))
        try:
            for statement in statements:
                await conn.execute(statement)
        finally:
            await conn.close()

    asyncio.run(run())


@pytest.fixture(scope="session")
def pg_template() -> Iterator[str]:
    """A migrated template database on the test PostgreSQL server."""
    name = f"ar_template_{uuid.uuid4().hex[:10]}"
    try:
        _pg_admin(f'CREATE DATABASE "{name}"')
    except (OSError, asyncpg.PostgresError) as exc:
        if REQUIRE_POSTGRES:
            pytest.fail(f"PostgreSQL is required but unreachable at {PG_ADMIN_URL}: {exc}")
        pytest.skip(f"PostgreSQL unreachable at {PG_ADMIN_URL}: {exc}")
    upgrade(_pg_url(name))
    yield name
    _pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def pg_admin() -> Callable[..., None]:
    """Run statements on the test PostgreSQL server as its admin (CREATE/DROP DATABASE)."""
    return _pg_admin


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A migrated SQLite file to copy per test."""
    path = tmp_path_factory.mktemp("template") / "template.db"
    upgrade(f"sqlite:///{path}")
    return path


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """Which store this test runs on."""
    value: str = request.param
    return value


@pytest.fixture
def database_url(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, migrated database of the test's backend."""
    if backend == "sqlite":
        path = tmp_path / "agent_runner.db"
        shutil.copyfile(request.getfixturevalue("sqlite_template"), path)
        yield f"sqlite:///{path}"
        return
    with _fresh_pg_database(request.getfixturevalue("pg_template")) as url:
        yield url


@pytest.fixture
def another_pg_database_url(pg_template: str) -> Iterator[str]:
    """A second fresh, migrated database on the test PostgreSQL server (another deployment)."""
    with _fresh_pg_database(pg_template) as url:
        yield url


@contextmanager
def _fresh_pg_database(template: str) -> Iterator[str]:
    name = f"ar_test_{uuid.uuid4().hex[:12]}"
    _pg_admin(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
    try:
        yield _pg_url(name)
    finally:
        _pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def fake_model_server() -> Iterator[FakeAnthropic]:
    """One fake Messages API for the whole run."""
    with FakeAnthropic() as fake:
        yield fake


@pytest.fixture
def fake_model(fake_model_server: FakeAnthropic) -> FakeAnthropic:
    """The fake Messages API, with no requests recorded yet."""
    fake_model_server.reset()
    return fake_model_server


@pytest.fixture(scope="session")
def tool_server_session() -> Iterator[ToolServer]:
    """One HTTP tool server for the whole run."""
    with ToolServer() as server:
        yield server


@pytest.fixture
def tool_server(tool_server_session: ToolServer) -> ToolServer:
    """The HTTP tool server, with no invocations recorded yet."""
    tool_server_session.reset()
    return tool_server_session


@pytest.fixture
def agents_server(
    tmp_path: Path, fake_model: FakeAnthropic, tool_server: ToolServer
) -> AgentsServer:
    """Builds servers of the test agents on the fake model and tool server (AgentsServer)."""

    def build(*, database_url: str, env: dict[str, str] | None = None) -> ServerProcess:
        return ServerProcess(
            database_url=database_url,
            log_path=tmp_path / "server.log",
            agents_file=write_agents_file(tmp_path, tool_server.url),
            model_url=fake_model.url,
            env=env,
        )

    return build


@pytest.fixture(autouse=True)
def _demo_outbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The example send_email tool appends to DEMO_OUTBOX; keep it out of the working tree.
    monkeypatch.setenv("DEMO_OUTBOX", str(tmp_path / "outbox.jsonl"))


# Fixtures only a PostgreSQL test asks for (directly or through another fixture).
PG_FIXTURES = {"pg_template", "pg_admin", "another_pg_database_url"}


def pytest_configure(config: pytest.Config) -> None:
    """Ctrl-C as a terminal gives it: a suite started as a background job (`make test &`, a
    runner's `nohup ... &`) inherits SIGINT ignored, and would pass that on to every command
    and server under test, whose tests of SIGINT then fail. Handled here, it is the default
    again in each child: at exec, and in the forkserver's forks (tests/support/forked.py)."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test on PostgreSQL carries the `postgres` marker, however it came to be on it
    (a `backend` parameter of any id, a PostgreSQL fixture): `-m postgres` selects it, and
    in CI its skip is a failure (below)."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        on_backend = callspec is not None and callspec.params.get("backend") == "postgres"
        if on_backend or PG_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.postgres)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """In CI (AGENT_RUNNER_REQUIRE_POSTGRES=1) a skipped PostgreSQL test is a failure."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]  # pluggy's result object
    if REQUIRE_POSTGRES and report.skipped and "postgres" in item.keywords:
        report.outcome = "failed"
        report.longrepr = f"PostgreSQL test skipped in CI: {report.longrepr}"
