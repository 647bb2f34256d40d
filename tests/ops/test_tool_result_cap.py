"""A tool result past TOOL_RESULT_MAX_BYTES is stored truncated, so the session's later model
calls (which send every result again) stay within the model's limits; on both stores."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support.fake_anthropic import FakeAnthropic
from tests.support.server import AgentsServer
from tests.support.tool_server import BIG_READ_ROWS, ToolServer

WHOLE = json.dumps({"rows": BIG_READ_ROWS}, separators=(",", ":"))


def big_read(client: httpx.Client, session_id: str, message: str) -> list[dict[str, object]]:
    """Run the big-read turn; the session's tool messages."""
    body = {"agent": "big-read", "message": message, "session_id": session_id}
    run = client.post("/v1/runs", json=body)
    assert run.status_code == 200, run.text
    assert run.json()["status"] == "complete", run.json()
    history = client.get(f"/v1/sessions/{session_id}/messages", params={"limit": 100})
    assert history.status_code == 200, history.text
    return [m for m in history.json()["data"] if m["role"] == "tool"]


def sent_results(fake_model: FakeAnthropic) -> list[str]:
    """The content of every tool_result block the model was sent, last request first."""
    last = fake_model.requests[-1]
    return [
        block["content"]
        for message in last["messages"]
        if isinstance(message["content"], list)
        for block in message["content"]
        if block["type"] == "tool_result"
    ]


@pytest.mark.parametrize(
    ("limit", "env"), [(256 * 1024, {}), (4096, {"TOOL_RESULT_MAX_BYTES": "4096"})]
)
def test_a_result_past_the_limit_is_stored_truncated_and_the_session_goes_on(
    database_url: str,
    agents_server: AgentsServer,
    fake_model: FakeAnthropic,
    tool_server: ToolServer,
    limit: int,
    env: dict[str, str],
) -> None:
    assert len(WHOLE) > 1_000_000  # the tool's answer, four times the default limit
    server = agents_server(database_url=database_url, env=env)
    with server, server.client() as client:
        first = big_read(client, "big", "read it all")
        second = big_read(client, "big", "read it again")
    assert tool_server.count("big_read") == 2
    assert len(first) == 1 and second[0] == first[0]  # what the first turn stored, unchanged
    for stored in second:
        content = str(stored["content"])
        assert limit - 8 <= len(content.encode()) <= limit
        assert stored["is_error"] is False
        body = json.loads(content)
        assert body["kind"] == "tool-result-truncated"
        assert f"was more than {limit:,} bytes" in body["note"]  # read no further
        assert WHOLE.startswith(body["head"]) and len(body["head"]) > limit // 2
    # The second turn's model call was sent both results as stored, not the tool's answers.
    assert sent_results(fake_model) == [m["content"] for m in second]
