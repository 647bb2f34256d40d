"""Lists of large rows: a page ends early, `next_after` set, where its text passes the budget."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from app.db.repositories import page_length
from app.schemas.common import PAGE_MAX_CHARS
from tests.api.helpers import get_ok, run

Json = dict[str, Any]

# Each large row holds about this much text: four fit a page, a fifth does not.
LARGE = 900_000


def _message_chars(message: Json) -> int:
    calls = message["tool_calls"]
    return len(message["content"]) + (len(json.dumps(calls)) if calls else 0)


def _metadata_chars(row: Json) -> int:
    return len(json.dumps(row["metadata"]))


async def _walk(
    client: httpx.AsyncClient, url: str, *, limit: int, size: Callable[[Json], int]
) -> list[list[Json]]:
    """Every page of a list, checking that each page is as full as its budget lets it be:
    `limit` rows, or as many as fit PAGE_MAX_CHARS (at least one), the next row not."""
    pages: list[list[Json]] = []
    after: str | None = None
    while True:
        query: dict[str, Any] = {"limit": limit, **({"after": after} if after else {})}
        page = await get_ok(client, url, **query)
        rows = page["data"]
        assert rows or not pages, "only the first page of an empty list is empty"
        assert len(rows) <= limit
        assert len(rows) == 1 or sum(size(r) for r in rows) <= PAGE_MAX_CHARS
        if pages and len(pages[-1]) < limit:  # the page before ended early: this row did not fit
            assert sum(size(r) for r in pages[-1]) + size(rows[0]) > PAGE_MAX_CHARS
        pages.append(rows)
        after = page["next_after"]
        if after is None:
            return pages


async def test_history_of_large_messages_is_walked_in_pages_that_fit(
    client: httpx.AsyncClient,
) -> None:
    for n in range(3):
        await run(client, "echo", f"turn {n} " + "m" * LARGE, session_id="large")

    pages = await _walk(client, "/v1/sessions/large/messages", limit=50, size=_message_chars)

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

    sessions = await _walk(client, "/v1/sessions", limit=200, size=_metadata_chars)
    runs = await _walk(client, "/v1/sessions/runs/runs", limit=200, size=_metadata_chars)

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

    pages = await _walk(client, "/v1/sessions/three/messages", limit=3, size=_message_chars)

    assert [len(p) for p in pages] == [3, 1]


@pytest.mark.parametrize(
    ("sizes", "limit", "budget", "rows", "more"),
    [
        ([], 5, 10, [], False),
        ([3, 3, 3], 5, 10, [3, 3, 3], False),
        ([3, 3, 3, 3], 3, 10, [3, 3, 3], True),  # read limit + 1: more follow
        ([4, 4, 4], 5, 10, [4, 4], True),  # the third would pass the budget
        ([5, 5], 5, 10, [5, 5], False),  # exactly the budget fits
        ([25, 1], 5, 10, [25], True),  # a first row larger than the budget is a page
        ([1, 25], 5, 10, [1], True),
    ],
)
def test_page_length(
    sizes: list[int], limit: int, budget: int, rows: list[int], more: bool
) -> None:
    page = page_length(sizes, limit=limit, budget=budget)
    assert list(page.rows) == rows
    assert page.more is more
