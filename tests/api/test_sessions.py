"""GET/DELETE /v1/sessions...: fields, order, filters, pagination, binding rules."""

from __future__ import annotations

import json
from datetime import datetime

import httpx

from tests.api.helpers import all_pages, assert_problem, get_ok, run
from tests.support.fake_anthropic import FakeAnthropic

SESSION_FIELDS = {
    "id",
    "agent",
    "user_id",
    "tenant_id",
    "metadata",
    "created_at",
    "updated_at",
    "message_count",
    "status",
}
MESSAGE_FIELDS = {
    "seq",
    "role",
    "content",
    "tool_calls",
    "tool_call_id",
    "tool_name",
    "run_id",
    "created_at",
}
SESSION_ROUTES = ["", "/messages", "/runs"]


async def test_session_fields(client: httpx.AsyncClient) -> None:
    first = await run(
        client, "triage", "issue 7", session_id="s-1", user_id="u-1", metadata={"a": [1]}
    )

    # A session created with a user_id is read with that user_id (the query parameter).
    session = await get_ok(client, "/v1/sessions/s-1", user_id="u-1")

    assert session.keys() >= SESSION_FIELDS, session
    assert session["id"] == "s-1"
    assert session["agent"] == "triage"
    assert session["user_id"] == "u-1"
    assert session["tenant_id"] is None
    assert session["metadata"] == {"a": [1]}
    assert session["message_count"] == 5
    assert session["status"] == "idle"
    created = datetime.fromisoformat(session["created_at"])
    assert created <= datetime.fromisoformat(session["updated_at"])
    record = await get_ok(client, f"/v1/runs/{first['run_id']}")
    assert session["created_at"] == record["created_at"]  # created by the run, as it began
    assert created.utcoffset() is not None, "timestamps carry their time zone"


async def test_message_fields(client: httpx.AsyncClient) -> None:
    body = await run(client, "triage", "issue 7", session_id="s-1")

    messages = (await get_ok(client, "/v1/sessions/s-1/messages"))["data"]

    assert [m["seq"] for m in messages] == [1, 2, 3, 4, 5]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool", "assistant"]
    for message in messages:
        assert message.keys() >= MESSAGE_FIELDS, message
        assert message["run_id"] == body["run_id"]
        assert isinstance(message["content"], str)
        datetime.fromisoformat(message["created_at"])
    calls = messages[1]["tool_calls"]
    assert [set(c) for c in calls] == [{"id", "name", "arguments"}] * 2
    assert [c["name"] for c in calls] == ["get_issue", "post_slack"]
    assert calls[1]["arguments"] == {"channel": "channel-1", "text": "text-1"}
    for call, result in zip(calls, messages[2:4], strict=True):
        assert result["tool_call_id"] == call["id"]
        assert result["tool_name"] == call["name"]
        assert result["tool_calls"] == []
    assert json.loads(messages[2]["content"])["title"] == "Printer on fire"
    assert json.loads(messages[3]["content"])["ok"] is True
    assert messages[0]["tool_call_id"] is None and messages[0]["tool_name"] is None


async def test_messages_pagination_walks_the_whole_history(client: httpx.AsyncClient) -> None:
    await run(client, "ten-steps", "go", session_id="long")

    whole = (await get_ok(client, "/v1/sessions/long/messages", limit=200))["data"]
    walked = await all_pages(client, "/v1/sessions/long/messages", limit=3)

    assert [m["seq"] for m in whole] == list(range(1, 23))  # user, 10 x (call, result), final
    assert walked == whole


async def test_sessions_most_recently_updated_first_with_filters(
    client: httpx.AsyncClient,
) -> None:
    await run(client, "echo", "hi", session_id="a", user_id="u-1")
    await run(client, "echo", "hi", session_id="b", user_id="u-2")
    await run(client, "triage", "hi", session_id="c")
    await run(client, "echo", "again", session_id="a", user_id="u-1")

    async def ids(**params: str) -> list[str]:
        return [s["id"] for s in (await get_ok(client, "/v1/sessions", **params))["data"]]

    assert await ids() == ["a", "c", "b"]
    assert await ids(agent="echo") == ["a", "b"]
    assert await ids(agent="triage") == ["c"]
    assert await ids(user_id="u-2") == ["b"]
    assert await ids(agent="echo", user_id="u-1") == ["a"]
    assert await ids(agent="triage", user_id="u-1") == []
    assert await ids(agent="nobody") == []


async def test_sessions_pagination_has_no_duplicates_or_gaps(client: httpx.AsyncClient) -> None:
    for n in range(7):
        await run(client, "echo", "hi", session_id=f"p-{n}", user_id="even" if n % 2 else None)

    whole = (await get_ok(client, "/v1/sessions", limit=200))["data"]
    assert [s["id"] for s in whole] == [f"p-{n}" for n in reversed(range(7))]
    for limit in (1, 2, 3, 7):
        assert await all_pages(client, "/v1/sessions", limit=limit) == whole
    evens = await all_pages(client, "/v1/sessions", limit=2, user_id="even")
    assert [s["id"] for s in evens] == ["p-5", "p-3", "p-1"]


async def test_session_runs_newest_first_with_pagination(client: httpx.AsyncClient) -> None:
    run_ids = [(await run(client, "echo", f"turn {n}", session_id="r"))["run_id"] for n in range(4)]

    whole = (await get_ok(client, "/v1/sessions/r/runs"))["data"]

    assert [r["run_id"] for r in whole] == list(reversed(run_ids))
    assert {r["status"] for r in whole} == {"complete"}
    assert {r["session_id"] for r in whole} == {"r"}
    assert await all_pages(client, "/v1/sessions/r/runs", limit=1) == whole
    assert await all_pages(client, "/v1/sessions/r/runs", limit=3) == whole


async def test_deleted_and_unknown_sessions_are_not_found(client: httpx.AsyncClient) -> None:
    body = await run(client, "triage", "issue 7", session_id="gone")
    await run(client, "echo", "hi", session_id="kept")

    deleted = await client.delete("/v1/sessions/gone")

    assert deleted.status_code == 204, deleted.text
    assert deleted.content == b""
    for session_id in ("gone", "never-was"):
        for route in SESSION_ROUTES:
            url = f"/v1/sessions/{session_id}{route}"
            assert_problem(await client.get(url), 404, "session_not_found")
        url = f"/v1/sessions/{session_id}"
        assert_problem(await client.delete(url), 404, "session_not_found")
    assert_problem(await client.get(f"/v1/runs/{body['run_id']}"), 404, "run_not_found")
    listed = (await get_ok(client, "/v1/sessions"))["data"]
    assert [s["id"] for s in listed] == ["kept"]
    # The id is free again: a new session, bound to whatever agent asks first.
    again = await run(client, "echo", "hi", session_id="gone")
    assert [m["seq"] for m in again["messages"]] == [1, 2]


async def test_session_is_bound_to_its_agent(
    client: httpx.AsyncClient, fake_model: FakeAnthropic
) -> None:
    await run(client, "echo", "hi", session_id="bound")
    asked = len(fake_model.requests)

    response = await client.post(
        "/v1/runs", json={"agent": "triage", "message": "hi", "session_id": "bound"}
    )

    assert_problem(response, 409, "session_agent_mismatch")
    assert len(fake_model.requests) == asked
    session = await get_ok(client, "/v1/sessions/bound")
    assert (session["agent"], session["message_count"]) == ("echo", 2)


async def test_session_created_with_a_user_serves_only_that_user(
    client: httpx.AsyncClient, fake_model: FakeAnthropic
) -> None:
    await run(client, "echo", "hi", session_id="mine", user_id="alice")
    asked = len(fake_model.requests)

    for other in ({"user_id": "mallory"}, {}):
        body = {"agent": "echo", "message": "hi", "session_id": "mine", **other}
        problem = assert_problem(
            await client.post("/v1/runs", json=body), 403, "session_access_denied"
        )
        # Not "belongs to another user_id", which a request that sent none has not named.
        assert problem["detail"] == (
            "Session 'mine' serves only requests with the user_id it was created with."
        )

    assert len(fake_model.requests) == asked
    response = await client.get("/v1/sessions/mine", params={"user_id": "mallory"})
    assert_problem(response, 403, "session_access_denied")
    # A read that names no user acts for the tenant.
    assert (await get_ok(client, "/v1/sessions/mine"))["user_id"] == "alice"
    assert (await get_ok(client, "/v1/sessions/mine", user_id="alice"))["message_count"] == 2
    same = await run(client, "echo", "again", session_id="mine", user_id="alice")
    assert [m["seq"] for m in same["messages"]] == [3, 4]
