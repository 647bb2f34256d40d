"""Small helpers shared by the API tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI

PROBLEM_JSON = "application/problem+json"
PROBLEM_FIELDS = {"type", "title", "status", "detail", "code"}

Json = dict[str, Any]


@asynccontextmanager
async def serve(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """Run the app's lifespan around an in-process client (ASGITransport does not run it).

    An unhandled error answers its 500 instead of raising in the test, so a test that says
    "never 5xx" fails on the status with the body in view.
    """
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as http,
    ):
        yield http


def assert_problem(response: httpx.Response, status: int, code: str) -> Json:
    """`response` is an RFC 9457 problem with this status and code; its body."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith(PROBLEM_JSON), response.headers
    body: Json = response.json()
    assert body.keys() >= PROBLEM_FIELDS, body
    assert body["status"] == status, body
    assert body["code"] == code, body
    assert isinstance(body["type"], str) and body["type"], body
    assert isinstance(body["title"], str) and body["title"], body
    assert isinstance(body["detail"], str), body
    return body


async def run(client: httpx.AsyncClient, agent: str, message: str, **fields: Any) -> Json:
    """POST /v1/runs and expect 200; the run."""
    response = await client.post("/v1/runs", json={"agent": agent, "message": message, **fields})
    assert response.status_code == 200, response.text
    body: Json = response.json()
    return body


async def get_ok(client: httpx.AsyncClient, url: str, **params: Any) -> Json:
    """GET and expect 200 with a JSON body."""
    response = await client.get(url, params=params)
    assert response.status_code == 200, response.text
    body: Json = response.json()
    return body


async def all_pages(
    client: httpx.AsyncClient, url: str, *, limit: int, **params: Any
) -> list[Json]:
    """Every item of a list, walked page by page with `limit` and `after`."""
    items: list[Json] = []
    after: str | None = None
    for _ in range(1000):
        query = {**params, "limit": limit, **({"after": after} if after is not None else {})}
        page = await get_ok(client, url, **query)
        assert set(page) == {"data", "next_after"}, page
        assert len(page["data"]) <= limit
        items.extend(page["data"])
        after = page["next_after"]
        if after is None:
            return items
        assert len(page["data"]) == limit, "a page before the last one is full"
    raise AssertionError(f"{url} never ended")


async def post_raw(
    client: httpx.AsyncClient, content: bytes, *, content_type: str = "application/json"
) -> httpx.Response:
    """POST /v1/runs with these exact bytes."""
    return await client.post("/v1/runs", content=content, headers={"content-type": content_type})


def outcome(response: httpx.Response) -> tuple[int, str]:
    """(status, problem code) — the code is "<not problem+json>" when the body is not one."""
    content_type = response.headers.get("content-type", "")
    try:
        body = response.json()
    except ValueError:
        body = None
    if not content_type.startswith(PROBLEM_JSON) or not isinstance(body, dict):
        return response.status_code, "<not problem+json>"
    if not body.keys() >= PROBLEM_FIELDS or body["status"] != response.status_code:
        return response.status_code, "<incomplete problem>"
    return response.status_code, str(body["code"])


def assert_all(outcomes: dict[str, tuple[int, str]], status: int, code: str) -> None:
    """Every case answered this problem; a failure lists each case that did not."""
    wrong = {case: got for case, got in outcomes.items() if got != (status, code)}
    assert not wrong, f"expected ({status}, {code!r}) for every case; got:\n{listing(wrong)}"


def assert_no_server_errors(outcomes: dict[str, tuple[int, str]]) -> None:
    """No case answered a 5xx, and every 4xx was a problem document."""
    wrong = {
        case: got
        for case, got in outcomes.items()
        if got[0] >= 500 or (got[0] >= 400 and got[1].startswith("<"))
    }
    assert not wrong, f"a 5xx, or a 4xx that is not problem+json:\n{listing(wrong)}"


def listing(cases: dict[str, Any]) -> str:
    """One `case: value` line per case, for assertion messages."""
    return "\n".join(f"  {case}: {value}" for case, value in cases.items())
