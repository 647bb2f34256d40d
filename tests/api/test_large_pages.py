"""Lists of large rows through the API: a page ends early, `next_after` set, where its text
would pass PAGE_MAX_BYTES (the rule's edges: tests/integration/test_pages.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx

from app.schemas.common import PAGE_MAX_BYTES
from tests.api.helpers import get_ok, run

Json = dict[str, Any]

# Each large row holds about this many bytes of text: four fit a page, a fifth does not.
LARGE = 900_000


def _message_bytes(message: Json) -> int:
    """The bytes of a message's stored text (its calls' JSON as the store keeps it)."""
    calls = message["tool_calls"]
    return len(message["content"].encode()) + (len(json.dumps(calls)) if calls else 0)


def _metadata_bytes(row: Json) -> int:
    """The bytes of a row's metadata as the store keeps it (JSON, non-ASCII escaped)."""
    return len(json.dumps(row["metadata"]))


async def _walk(
    client: httpx.AsyncClient, url: str, *, limit: int, size: Callable[[Json], int]
) -> list[list[Json]]:
    """Every page of a list, checking that each page is as full as its budget lets it be:
    `limit` rows, or as many as fit PAGE_MAX_BYTES (at least one), the next row not."""
    pages: list[list[Json]] = []
    after: str | None = None
    while True:
        query: dict[str, Any] = {"limit": limit, **({"after": after} if after else {})}
        page = await get_ok(client, url, **query)
        rows = page["data"]
        assert rows or not pages, "only the first page of an empty list is empty"
        assert len(rows) <= limit
        assert len(rows) == 1 or sum(size(r) for r in rows) <= PAGE_MAX_BYTES
        if pages and len(pages[-1]) < limit:  # the page before ended early: this row did not fit
            assert sum(size(r) for r in pages[-1]) + size(rows[0]) > PAGE_MAX_BYTES
        pages.append(rows)
        after = page["next_after"]
        if after is None:
            return pages


async def test_history_of_large_messages_is_walked_in_pages_that_fit(
    client: httpx.AsyncClient,
) -> None:
    for n in range(3):
        await run(client, "echo", f"turn {n} " + "m" * LARGE, session_id="large")

    pages = await _walk(client, "/v1/sessions/large/messages", limit=50, size=_message_bytes)

    assert [len(p) for p in pages] == [4, 2]  # user, echo, user, echo | user, echo
    walked = [m for page in pages for m in page]
    assert [m["seq"] for m in walked] == list(range(1, 7))
    assert [m["content"][:7] for m in walked[::2]] == ["turn 0 ", "turn 1 ", "turn 2 "]
    assert all(m["content"].startswith("echo: turn ") for m in walked[1::2])


async def test_sessions_and_runs_with_large_metadata_are_walked_in_pages_that_fit(
    client: httpx.AsyncClient,
) -> None:
    for n in range(6):
        await run(client, "echo", f"hi {n}", session_id=f"meta-{n}", metadata={"pad": "s" * LARGE})
        await run(client, "echo", f"again {n}", session_id="runs", metadata={"pad": "r" * LARGE})

    sessions = await _walk(client, "/v1/sessions", limit=200, size=_metadata_bytes)
    runs = await _walk(client, "/v1/sessions/runs/runs", limit=200, size=_metadata_bytes)

    # Seven sessions: "runs" (its first turn's metadata was kept on it too), updated last.
    assert [len(p) for p in sessions] == [4, 3]
    assert [s["id"] for p in sessions for s in p] == ["runs"] + [
        f"meta-{n}" for n in reversed(range(6))
    ]
    assert [len(p) for p in runs] == [4, 2]
    assert [r["response"] for p in runs for r in p] == [
        f"echo: again {n}" for n in reversed(range(6))
    ]


async def test_the_limit_ends_a_page_of_large_rows_that_fit(client: httpx.AsyncClient) -> None:
    for n in range(2):
        await run(client, "echo", f"turn {n} " + "m" * LARGE, session_id="three")

    pages = await _walk(client, "/v1/sessions/three/messages", limit=3, size=_message_bytes)

    assert [len(p) for p in pages] == [3, 1]
