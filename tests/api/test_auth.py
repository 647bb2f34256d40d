"""API keys: only a whole key, the scheme in any case, on every /v1 route also under a prefix
(an ASGI server's root_path, or mounted in another app); tenants' sessions stay theirs."""

from __future__ import annotations

from pathlib import Path

import httpx
from fastapi import FastAPI

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


def keyed_app(agents_file: Path, database_url: str = "memory://") -> FastAPI:
    keys = "key-acme:acme,key-globex:globex"
    return create_app(Settings(database_url=database_url, agents_file=agents_file, api_keys=keys))


async def test_only_a_whole_key_is_a_key(agents_file: Path) -> None:
    async with serve(keyed_app(agents_file)) as http:
        for near in ("key-ac", "key-", "k", "key-acme-x", "xkey-acme"):
            refused = await http.get("/v1/sessions", headers={"Authorization": f"Bearer {near}"})
            assert_problem(refused, 401, "unauthorized")


async def test_the_scheme_is_read_in_any_case(agents_file: Path) -> None:
    # RFC 9110: the auth scheme is case-insensitive; the key itself is not.
    async with serve(keyed_app(agents_file)) as http:
        for scheme in ("Bearer", "bearer", "BEARER", "bEaReR"):
            allowed = await http.get(
                "/v1/sessions", headers={"Authorization": f"{scheme} key-acme"}
            )
            assert allowed.status_code == 200, (scheme, allowed.text)
        refused = await http.get("/v1/sessions", headers={"Authorization": "Bearer KEY-ACME"})
        assert_problem(refused, 401, "unauthorized")


async def test_a_deployment_without_keys_sees_no_tenants_sessions(
    agents_file: Path, database_url: str
) -> None:
    # Sessions made for a tenant stay that tenant's when the same database is served
    # without API_KEYS (no tenant is another tenant): 404, as to any other tenant.
    acme = {"Authorization": "Bearer key-acme"}
    body = {"agent": "echo", "message": "hi", "session_id": "s-tenant"}
    async with serve(keyed_app(agents_file, database_url)) as http:
        made = await http.post("/v1/runs", json=body, headers=acme)
        assert made.status_code == 200, made.text
    run_id = made.json()["run_id"]
    plain = create_app(Settings(database_url=database_url, agents_file=agents_file))
    async with serve(plain) as http:
        assert_problem(await http.get("/v1/sessions/s-tenant"), 404, "session_not_found")
        assert_problem(await http.delete("/v1/sessions/s-tenant"), 404, "session_not_found")
        assert_problem(await http.post("/v1/runs", json=body), 404, "session_not_found")
        assert_problem(await http.get(f"/v1/runs/{run_id}"), 404, "run_not_found")
        assert (await http.get("/v1/sessions")).json()["data"] == []
