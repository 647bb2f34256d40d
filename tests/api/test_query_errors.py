"""Bad values in a path or a query string (limits, cursors, filters, NUL, repeats) are 422s."""

from __future__ import annotations

import base64
import time

import httpx
import pytest

from tests.api.helpers import assert_all, assert_problem, outcome, run

SESSION_LISTS = ["/v1/sessions", "/v1/sessions/s-1/messages", "/v1/sessions/s-1/runs"]
BAD_LIMITS = ["0", "-1", "201", "1000", "abc", "1.5", ""]


def cursor(listing: str, raw: str) -> str:
    """A cursor of the list `listing` ("sessions", "runs of <session id>") with this decoded
    content."""
    return base64.urlsafe_b64encode(f"{listing}|{raw}".encode()).decode().rstrip("=")


def bad_cursors(path: str) -> list[str]:
    """Malformed cursors for the list at `path`."""
    listing = {
        "/v1/sessions": "sessions",
        "/v1/sessions/s-1/runs": "runs of s-1",
        "/v1/sessions/s-1/messages": "messages",  # its cursors are seqs: any of these is bad
    }[path]
    return [
        "garbage",
        "!!!",
        "-1",
        "²",  # str.isdigit() says yes, int() says no
        "9" * 30,
        cursor(listing, "x|y"),
        cursor(listing, "2024-01-01T00:00:00+00:00"),
        cursor(listing, "0001-01-01T00:00:00+14:00|k"),
        cursor(listing, "9999-12-31T23:59:59-14:00|k"),
    ]


@pytest.fixture
async def session(client: httpx.AsyncClient) -> str:
    """A session `s-1` with one echo turn."""
    await run(client, "echo", "hi", session_id="s-1")
    return "s-1"


@pytest.mark.usefixtures("session")
async def test_bad_limits(client: httpx.AsyncClient) -> None:
    outcomes = {
        f"{path}?limit={limit}": outcome(await client.get(path, params={"limit": limit}))
        for path in [*SESSION_LISTS, "/v1/agents"]
        for limit in BAD_LIMITS
    }

    assert_all(outcomes, 422, "validation_error")


@pytest.mark.usefixtures("session")
async def test_bad_cursors(client: httpx.AsyncClient) -> None:
    outcomes = {
        f"{path}?after={after}": outcome(await client.get(path, params={"after": after}))
        for path in SESSION_LISTS
        for after in bad_cursors(path)
    }

    assert_all(outcomes, 422, "validation_error")


@pytest.mark.usefixtures("session")
async def test_every_list_refuses_what_is_not_its_cursor_in_the_same_words(
    client: httpx.AsyncClient,
) -> None:
    # The history's said "String should match pattern '^[0-9]{0,9}$'", and the others did
    # so of a character no cursor holds.
    details = {
        (path, after): (await client.get(path, params={"after": after})).json().get("detail")
        for path in SESSION_LISTS
        for after in ("abc", "a.b", "1e3", "-1", "2 ")
    }
    assert details == {
        key: f"'after' is not a cursor this list returned: {key[1]!r}" for key in details
    }


async def test_a_cursor_of_another_list_is_refused(client: httpx.AsyncClient) -> None:
    for session_id in ("s-1", "s-1", "s-2", "s-2"):
        await run(client, "echo", "hi", session_id=session_id)

    def first_cursor(page: httpx.Response) -> str:
        cursor: str = page.json()["next_after"]
        assert cursor, page.text
        return cursor

    sessions_cursor = first_cursor(await client.get("/v1/sessions", params={"limit": 1}))
    runs_cursor = first_cursor(await client.get("/v1/sessions/s-1/runs", params={"limit": 1}))
    outcomes = {
        f"{path} after {name}": outcome(await client.get(path, params={"after": after}))
        for path, name, after in (
            ("/v1/sessions/s-1/runs", "a sessions cursor", sessions_cursor),
            ("/v1/sessions", "a runs cursor", runs_cursor),
            ("/v1/sessions/s-2/runs", "another session's runs cursor", runs_cursor),
        )
    }
    assert_all(outcomes, 422, "validation_error")
    # Each is taken by its own list.
    assert (await client.get("/v1/sessions/s-1/runs", params={"after": runs_cursor})).is_success


@pytest.mark.usefixtures("session")
async def test_an_empty_cursor_is_the_first_page(client: httpx.AsyncClient) -> None:
    for path in [*SESSION_LISTS, "/v1/agents"]:
        first = await client.get(path)
        empty = await client.get(path, params={"after": ""})
        assert first.status_code == 200 and first.json()["data"], (path, first.text)
        assert (empty.status_code, empty.json()) == (200, first.json()), path


@pytest.mark.usefixtures("session")
async def test_nul_in_a_path_or_query_value_is_a_validation_error(
    client: httpx.AsyncClient,
) -> None:
    # PostgreSQL text cannot hold NUL: such a value must be refused before any query, and
    # alike on both stores (it was a 500 on PostgreSQL, a 404 or an empty page on SQLite).
    with_nul = {
        name: cursor(name, "2024-01-01T00:00:00+00:00|s\x00-1") for name in ("sessions", "runs")
    }
    outcomes = {
        url: outcome(await client.get(url))
        for url in [
            "/v1/runs/%00",
            "/v1/runs/r%00x",
            "/v1/agents/echo%00",
            "/v1/sessions?user_id=%00",
            "/v1/sessions?agent=a%00b",
            "/v1/sessions/s-1?user_id=u%00",
            f"/v1/sessions?after={with_nul['sessions']}",
            f"/v1/sessions/s-1/runs?after={with_nul['runs']}",
            "/v1/sessions/s-1/messages?after=1%00",
        ]
    }

    assert_all(outcomes, 422, "validation_error")


@pytest.mark.usefixtures("session")
async def test_a_query_parameter_sent_twice_is_a_validation_error(
    client: httpx.AsyncClient,
) -> None:
    # The router read the last value: `?user_id=bob&user_id=alice` acted as alice, where a
    # proxy or an audit log reading the first would have seen bob.
    urls = [
        *(f"{path}?limit=1&limit=2" for path in [*SESSION_LISTS, "/v1/agents"]),
        "/v1/sessions?user_id=bob&user_id=alice",
        "/v1/sessions/s-1?user_id=a&user_id=a",
        "/v1/sessions?agent=echo&limit=5&agent=triage",
    ]
    outcomes = {url: outcome(await client.get(url)) for url in urls}
    assert_all(outcomes, 422, "validation_error")

    body = assert_problem(await client.get("/v1/sessions?limit=1&limit=2"), 422, "validation_error")
    assert body["errors"] == [
        {"loc": ["query", "limit"], "msg": "must be sent once", "type": "value_error"}
    ]


async def test_many_repeated_parameters_are_answered_without_a_quadratic_count(
    client: httpx.AsyncClient,
) -> None:
    # Counted with list.count per name, 21,000 repeats took ~5 s of CPU on /healthz, which
    # needs no key. Counted once, it is milliseconds (a parameter /healthz does not take is
    # not counted at all).
    for path, parameter, repeats, status in [
        ("/healthz", "ab", 21_000, 200),
        ("/v1/agents", "limit", 10_000, 422),  # as many as a URL can hold
    ]:
        started = time.monotonic()
        response = await client.get(f"{path}?" + "&".join([parameter] * repeats))
        took = time.monotonic() - started

        assert response.status_code == status, response.text
        assert took < 2, f"{took:.1f} s to answer one request"


async def test_a_query_parameter_the_route_does_not_take_is_ignored(
    client: httpx.AsyncClient,
) -> None:
    # It never reaches a handler, let alone a query: sent twice or holding NUL, it is no
    # more refused than once (/healthz answered 422 to `?a=1&a=2`, undocumented).
    urls = ["/healthz?a=1&a=2", "/readyz?a=%00", "/metrics?x=1&x=2", "/v1/agents/echo?a=1&a=2"]
    statuses = {url: (await client.get(url)).status_code for url in urls}
    assert statuses == dict.fromkeys(urls, 200)


async def test_an_empty_filter_of_the_sessions_list_is_a_validation_error(
    client: httpx.AsyncClient,
) -> None:
    # It filtered on "" and answered an empty page, where every route taking a user_id
    # refuses the empty one.
    outcomes = {
        url: outcome(await client.get(url))
        for url in ["/v1/sessions?user_id=", "/v1/sessions?agent="]
    }
    assert_all(outcomes, 422, "validation_error")
