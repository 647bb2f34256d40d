"""GET /healthz and GET /readyz."""

from __future__ import annotations

import httpx


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
