"""docker-compose.yml and the Dockerfile: valid, as described, and runnable as composed.

The live test starts `agent-runner serve` with exactly the environment compose gives the `app`
service (service host names mapped to 127.0.0.1) against the local PostgreSQL, so a change to
either file that the app does not accept fails here instead of on somebody's laptop.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from sqlalchemy.engine import make_url

from app.settings import Settings
from tests.conftest import _pg_admin
from tests.ops.deployfiles import (
    COMPOSE_SCHEMA,
    DOCKERFILE,
    Instruction,
    dockerfile_instructions,
    env_of,
    environment,
    healthcheck_command,
    last,
    load_compose,
    mounts,
    published_ports,
    repo_path,
    stages,
    with_port,
)
from tests.ops.helpers import command_server

SERVE_COMMAND = ["agent-runner", "serve", "--host", "0.0.0.0", "--port", "8000"]


def compose_validator() -> jsonschema.Draft7Validator:
    """The vendored Compose Specification schema (it uses draft-4/7 style `id`s)."""
    schema = json.loads(COMPOSE_SCHEMA.read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def final_stage() -> list[Instruction]:
    """The instructions of the Dockerfile's last stage (the image that runs)."""
    return stages(dockerfile_instructions(DOCKERFILE.read_text()))[-1]


def image_command(stage: list[Instruction]) -> list[str]:
    """ENTRYPOINT + CMD of a stage, both in exec form."""
    entrypoint, cmd = last(stage, "ENTRYPOINT"), last(stage, "CMD")
    assert entrypoint is not None and cmd is not None
    return [*entrypoint.exec_form(), *cmd.exec_form()]


# --- static checks ------------------------------------------------------------------------------


def test_compose_file_validates_against_the_compose_specification() -> None:
    errors = [e.message for e in compose_validator().iter_errors(load_compose())]
    assert errors == []


def _bogus_condition(compose: dict[str, Any]) -> None:
    compose["services"]["app"]["depends_on"]["db"]["condition"] = "bogus"


def _unknown_service_key(compose: dict[str, Any]) -> None:
    compose["services"]["app"]["restart_when"] = "always"


def _ports_not_a_list(compose: dict[str, Any]) -> None:
    compose["services"]["app"]["ports"] = {"8000": 8000}


@pytest.mark.parametrize("breakage", [_bogus_condition, _unknown_service_key, _ports_not_a_list])
def test_the_schema_check_rejects_a_broken_compose_file(breakage: Any) -> None:
    broken = copy.deepcopy(load_compose())
    breakage(broken)
    assert list(compose_validator().iter_errors(broken)), "the broken copy passed validation"


def test_db_service_has_a_healthcheck_and_a_named_volume() -> None:
    compose = load_compose()
    db = compose["services"]["db"]
    test = db["healthcheck"]["test"]
    assert test and "pg_isready" in " ".join(test if isinstance(test, list) else [test])
    named = set(compose.get("volumes") or {})
    data = [m for m in mounts(db) if m.target == "/var/lib/postgresql/data"]
    assert len(data) == 1 and data[0].source in named, mounts(db)


def test_app_service_waits_for_a_healthy_db_and_gets_its_settings() -> None:
    compose = load_compose()
    app, db = compose["services"]["app"], compose["services"]["db"]
    assert app["depends_on"]["db"]["condition"] == "service_healthy"

    env = environment(app, {})
    url = make_url(env["DATABASE_URL"])
    assert url.get_backend_name() == "postgresql"
    assert url.host == "db" and (url.port or 5432) == 5432
    db_env = environment(db, {})
    assert (url.username, url.password, url.database) == (
        db_env["POSTGRES_USER"],
        db_env["POSTGRES_PASSWORD"],
        db_env["POSTGRES_DB"],
    )

    agents = [m for m in mounts(app) if m.target == env["AGENTS_FILE"]]
    assert len(agents) == 1, f"AGENTS_FILE={env['AGENTS_FILE']} is not mounted: {mounts(app)}"
    assert agents[0].read_only and repo_path(agents[0].source).is_file()

    assert ("8000", "8000") in published_ports(app)
    # Passed through from the host: set there, it arrives; unset, it is empty, not missing.
    assert environment(app, {"ANTHROPIC_API_KEY": "sk-from-host"})["ANTHROPIC_API_KEY"] == (
        "sk-from-host"
    )
    assert env["ANTHROPIC_API_KEY"] == ""


def test_compose_gives_the_app_longer_than_its_shutdown_grace_to_stop() -> None:
    app = load_compose()["services"]["app"]
    grace_s = float(
        environment(app, {}).get(
            "SHUTDOWN_GRACE_S", Settings.model_fields["shutdown_grace_s"].default
        )
    )
    match = re.fullmatch(r"(\d+)s", app["stop_grace_period"])
    assert match is not None, app["stop_grace_period"]
    # Beyond the grace: a step in flight when it ends finishes its calls before the exit.
    assert int(match.group(1)) >= grace_s + 10


def test_dockerfile_is_multi_stage_non_root_with_healthcheck_and_serve_command() -> None:
    instructions = dockerfile_instructions(DOCKERFILE.read_text())
    assert len(stages(instructions)) >= 2  # multi-stage: no build tools in the image
    stage = final_stage()
    user = last(stage, "USER")
    assert user is not None and user.args.split(":")[0] not in ("root", "0")
    healthcheck = last(stage, "HEALTHCHECK")
    assert healthcheck is not None
    assert "/healthz" in " ".join(healthcheck_command(healthcheck))
    assert ":8000/" in " ".join(healthcheck_command(healthcheck))
    assert image_command(stage) == SERVE_COMMAND
    exposed = last(stage, "EXPOSE")
    assert exposed is not None and "8000" in exposed.args.split()
    # What the service writes goes to the volume its user owns, never to the read-only
    # working directory: the SQLite default and the example email tool's outbox.
    volume = last(stage, "VOLUME")
    assert volume is not None and "/data" in volume.args
    env = env_of(stage)
    assert env["DATABASE_URL"].startswith("sqlite:////data/")
    assert env["DEMO_OUTBOX"].startswith("/data/")


# --- the composed app, live -------------------------------------------------------------------


def _quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _quote_literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


@pytest.fixture
def compose_db(pg_template: str) -> Iterator[dict[str, str]]:
    """The role the compose `db` service creates, and a fresh database it owns on the local
    server (named `<POSTGRES_DB>_test_<random>`: a database of the compose file's own name on
    the test server is not the test's to drop); the database's name is `POSTGRES_DB`.

    The role gets LOGIN and owns its database: less than the postgres image grants
    POSTGRES_USER (a superuser), so what works here works there.
    """
    db_env = environment(load_compose()["services"]["db"], {})
    user, password = db_env["POSTGRES_USER"], db_env["POSTGRES_PASSWORD"]
    name = f"{db_env['POSTGRES_DB']}_test_{uuid.uuid4().hex[:12]}"
    drop = f"DROP DATABASE IF EXISTS {_quote_ident(name)} WITH (FORCE)"
    _pg_admin(
        drop,
        "DO $$ BEGIN "
        f"IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = {_quote_literal(user)}) THEN "
        f"CREATE ROLE {_quote_ident(user)} LOGIN PASSWORD {_quote_literal(password)}; "
        "END IF; END $$",
        f"CREATE DATABASE {_quote_ident(name)} OWNER {_quote_ident(user)}",
    )
    yield {**db_env, "POSTGRES_DB": name}
    _pg_admin(drop)


@pytest.mark.postgres
def test_the_app_serves_with_exactly_the_environment_compose_gives_it(
    compose_db: dict[str, str], tmp_path: Path
) -> None:
    compose = load_compose()
    app = compose["services"]["app"]
    stage = final_stage()
    # The image's ENV first, compose's `environment` over it; PATH is the image's venv first.
    image_env = {k: v for k, v in env_of(stage).items() if k != "PATH"}
    app_env = environment(app, {})  # the host has no ANTHROPIC_API_KEY
    url = make_url(app_env["DATABASE_URL"])
    assert url.host in compose["services"], f"DATABASE_URL names no compose service: {url.host}"
    assert url.database == environment(compose["services"]["db"], {})["POSTGRES_DB"]
    database_url = url.set(host="127.0.0.1", database=compose_db["POSTGRES_DB"]).render_as_string(
        hide_password=False
    )
    mounted = {m.target: m for m in mounts(app)}
    assert app_env["AGENTS_FILE"] in mounted
    env = {
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        **({"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {}),
        **image_env,
        **app_env,
        "AGENTS_FILE": str(repo_path(mounted[app_env["AGENTS_FILE"]].source)),
        "DEMO_OUTBOX": str(tmp_path / "outbox.jsonl"),
    }
    command = image_command(stage)
    server = command_server(
        argv=lambda port: with_port(command, port),
        env=env,
        database_url=database_url,
        log_path=tmp_path / "server.log",
    )
    with server, server.client() as client:
        ready = client.get("/readyz")
        assert ready.status_code == 200, ready.text
        run = client.post(
            "/v1/runs",
            json={"agent": "support", "message": "Where is order A-1001?", "session_id": "c-1"},
        )
        assert run.status_code == 200, run.text
        assert run.json()["status"] == "complete", run.json()
        assert len((tmp_path / "outbox.jsonl").read_text().splitlines()) == 1

        healthcheck = last(stage, "HEALTHCHECK")
        assert healthcheck is not None
        probe = [a.replace(":8000/", f":{server.port}/") for a in healthcheck_command(healthcheck)]
        done = subprocess.run(probe, env=env, capture_output=True, timeout=20, check=False)
        assert done.returncode == 0, done.stderr.decode(errors="replace")
    # The same probe fails once nothing listens: it tests the server, not just python.
    done = subprocess.run(probe, env=env, capture_output=True, timeout=20, check=False)
    assert done.returncode != 0
