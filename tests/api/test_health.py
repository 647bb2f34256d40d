"""GET /healthz and GET /readyz."""

from __future__ import annotations

import httpx


async def test_alive_and_ready_on_a_migrated_database(client: httpx.AsyncClient) -> None:
    alive = await client.get("/healthz")
    ready = await client.get("/readyz")

    assert (alive.status_code, alive.json()) == (200, {"status": "ok"})
    assert ready.status_code == 200, ready.text
    assert ready.json()["status"] == "ready"
