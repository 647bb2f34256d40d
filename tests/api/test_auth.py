"""API keys when the app is served under a prefix (an ASGI server's root_path, or mounted in
another app): the key is still required on every /v1 route, and the tenant still found."""

from __future__ import annotations

from pathlib import Path

import httpx

from app.api.auth import RequireApiKey
from app.main import create_app
from app.settings import Settings
from tests.api.helpers import assert_problem, serve


async def test_keys_are_required_under_a_root_path(agents_file: Path) -> None:
    settings = Settings(database_url="memory://", agents_file=agents_file, api_keys="k1:t1")
    app = create_app(settings)
    # As uvicorn --root-path does: the prefix is in both `path` and `root_path`.
    transport = httpx.ASGITransport(app=app, root_path="/api", raise_app_exceptions=False)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://test") as http,
    ):
        refused = await http.get("/api/v1/agents")
        allowed = await http.get("/api/v1/agents", headers={"Authorization": "Bearer k1"})
        alive = await http.get("/api/healthz")

    assert_problem(refused, 401, "unauthorized")
    assert allowed.status_code == 200, allowed.text
    assert "echo" in [agent["name"] for agent in allowed.json()["data"]]
    assert alive.status_code == 200


async def test_a_v1_route_the_key_check_did_not_see_fails_closed(agents_file: Path) -> None:
    # Were RequireApiKey ever bypassed (a mount, a reordered middleware), no /v1 route may
    # answer as if no key were needed: /v1/agents, which uses no tenant, included.
    settings = Settings(database_url="memory://", agents_file=agents_file, api_keys="k1:t1")
    app = create_app(settings)
    check: object = RequireApiKey
    app.user_middleware = [m for m in app.user_middleware if m.cls is not check]

    async with serve(app) as http:
        agents = await http.get("/v1/agents", headers={"Authorization": "Bearer k1"})
        alive = await http.get("/healthz")

    assert_problem(agents, 500, "internal_error")
    assert alive.status_code == 200
