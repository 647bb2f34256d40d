"""GET /healthz and GET /readyz."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from app.errors import ConfigError
from app.llm.base import ModelRequest, ModelResponse
from app.main import create_app
from app.settings import Settings
from tests.api.conftest import build_app
from tests.api.helpers import assert_problem, serve
from tests.support.fake_anthropic import FakeAnthropic


async def test_alive_and_ready_on_a_migrated_database(client: httpx.AsyncClient) -> None:
    alive = await client.get("/healthz")
    ready = await client.get("/readyz")

    assert (alive.status_code, alive.json()) == (200, {"status": "ok"})
    assert ready.status_code == 200, ready.text
    assert ready.json()["status"] == "ready"


async def test_head_answers_as_get_without_the_body(client: httpx.AsyncClient) -> None:
    # Load balancers probe with HEAD; every GET route has one (RFC 9110).
    for path in ("/healthz", "/readyz", "/v1/agents", "/metrics"):
        got, head = await client.get(path), await client.head(path)
        assert head.status_code == got.status_code == 200, (path, head.status_code)
        assert head.content == b"", path
        assert head.headers["content-type"] == got.headers["content-type"], path
        assert head.headers["content-length"] == got.headers["content-length"], path
    missing = await client.head("/v1/sessions/nobody")
    assert (missing.status_code, missing.content) == (404, b"")
    assert (await client.head("/v1/runs")).status_code == 405  # POST only


async def test_while_draining_reads_are_answered_and_new_runs_refused(
    database_url: str, agents_file: Path, fake_model: FakeAnthropic
) -> None:
    # The first version of the shutdown check for bodies still arriving answered every
    # request 503 once shutdown had begun, reads included.
    app = build_app(database_url, agents_file, fake_model)
    async with serve(app) as client:
        app.state.lifecycle.drain()
        await asyncio.sleep(0.05)  # the loop runs what drain() scheduled

        for path in ("/healthz", "/v1/agents", "/v1/sessions", "/openapi.json"):
            assert (await client.get(path)).status_code == 200, path
        assert_problem(await client.get("/readyz"), 503, "shutting_down")
        refused = await client.post("/v1/runs", json={"agent": "echo", "message": "hi"})
        assert_problem(refused, 503, "shutting_down")
    assert fake_model.requests == []


async def test_while_draining_a_finished_keyed_turn_is_still_replayed(
    database_url: str, agents_file: Path, fake_model: FakeAnthropic
) -> None:
    # §4: a finished turn answers its stored result. A replica that had taken its SIGTERM in
    # answered such a retry 503 shutting_down, as if the turn had not run.
    app = build_app(database_url, agents_file, fake_model)
    body = {"agent": "echo", "message": "hi", "session_id": "s-drain"}
    key = {"Idempotency-Key": "turn-1"}
    async with serve(app) as client:
        ran = await client.post("/v1/runs", json=body, headers=key)
        assert ran.status_code == 200, ran.text
        model_calls = len(fake_model.requests)
        app.state.lifecycle.drain()
        await asyncio.sleep(0.05)  # the loop runs what drain() scheduled

        replayed = await client.post("/v1/runs", json=body, headers=key)
        assert replayed.status_code == 200, replayed.text
        assert replayed.headers.get("idempotent-replayed") == "true"
        assert replayed.json() == ran.json()
        for refused in (
            await client.post("/v1/runs", json=body, headers={"Idempotency-Key": "turn-2"}),
            await client.post("/v1/runs", json=body),
        ):
            assert_problem(refused, 503, "shutting_down")
    assert len(fake_model.requests) == model_calls


class ClosingModel:
    """A model client that only records being closed."""

    def __init__(self) -> None:
        self.closed = 0

    async def complete(self, request: ModelRequest) -> ModelResponse:
        raise AssertionError("no turn runs in this test")

    async def aclose(self) -> None:
        self.closed += 1


async def test_a_start_that_fails_closes_what_it_had_opened(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'served.db'}"
    first = create_app(Settings(database_url=url))
    second_model = ClosingModel()
    second = create_app(Settings(database_url=url), llm=second_model)

    async with serve(first):
        with pytest.raises(ConfigError, match="another process is serving"):
            async with serve(second):
                pass
    assert second_model.closed == 1  # opened before the serving lock was refused
