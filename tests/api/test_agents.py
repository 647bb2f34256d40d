"""GET /v1/agents and GET /v1/agents/{name}."""

from __future__ import annotations

import httpx

from tests.api.helpers import all_pages, assert_problem, get_ok

AGENTS = [
    "bad-ids",
    "big-read",
    "broken-model",
    "context-cut-off",
    "cut-off",
    "cut-short",
    "echo",
    "newer-stop",
    "outsized",
    "overloaded",
    "refused",
    "reused-ids",
    "slow",
    "slow-read",
    "ten-steps",
    "triage",
    "two-steps",
    "unstorable",
]
TOOL_FIELDS = {"name", "description", "input_schema", "safe_to_retry"}


async def test_agents_in_pages_and_one_by_name(client: httpx.AsyncClient) -> None:
    page = await get_ok(client, "/v1/agents")

    assert set(page) == {"data", "next_after"}
    assert page["next_after"] is None
    assert [a["name"] for a in page["data"]] == AGENTS
    for agent in page["data"]:
        for tool in agent["tools"]:
            assert tool.keys() >= TOOL_FIELDS, tool
    for limit in (1, 2, 3, 7):
        assert await all_pages(client, "/v1/agents", limit=limit) == page["data"]

    agent = await get_ok(client, "/v1/agents/triage")

    assert agent["name"] == "triage"
    tools = {t["name"]: t for t in agent["tools"]}
    assert list(tools) == ["get_issue", "post_slack"]
    assert tools["get_issue"]["safe_to_retry"] is True
    assert tools["post_slack"]["safe_to_retry"] is False
    assert tools["get_issue"]["description"] == "Fetch an issue by id"
    assert tools["post_slack"]["input_schema"]["required"] == ["channel", "text"]
    assert next(a for a in page["data"] if a["name"] == "triage") == agent
    assert_problem(await client.get("/v1/agents/nobody"), 404, "agent_not_found")
