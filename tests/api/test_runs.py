"""POST /v1/runs and GET /v1/runs/{run_id}: stateless and durable turns, model failures."""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime
from pathlib import Path

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from app.db.session import Database
from tests.api.conftest import build_app
from tests.api.helpers import Json, assert_problem, get_ok, run, serve
from tests.support.agents import NEWER_STOP
from tests.support.fake_anthropic import FakeAnthropic
from tests.support.fake_anthropic_replies import STOPPED_TEXT_CHARS
from tests.support.tool_server import ToolServer

RUN_FIELDS = {"run_id", "session_id", "status", "response", "iterations", "messages", "usage"}
TRIAGE_ROLES = ["user", "assistant", "tool", "tool", "assistant"]


def assert_completed_triage(body: Json, message: str) -> None:
    """A finished `triage` turn: one tool step (get_issue + post_slack), then the final text."""
    assert RUN_FIELDS | {"error"} <= body.keys(), body
    assert body["status"] == "complete"
    assert body["error"] is None
    assert body["iterations"] == 2
    assert body["response"].startswith("done after 1 steps")
    messages = body["messages"]
    assert [m["role"] for m in messages] == TRIAGE_ROLES
    assert messages[0]["content"] == message
    assert [c["name"] for c in messages[1]["tool_calls"]] == ["get_issue", "post_slack"]
    assert messages[-1]["content"] == body["response"]
    usage = body["usage"]
    assert set(usage) == {"input_tokens", "output_tokens"}
    assert usage["input_tokens"] > 0 and usage["output_tokens"] > 0


@asynccontextmanager
async def directly(database_url: str) -> AsyncIterator[AsyncConnection]:
    """A transaction on the service's database itself, past the API."""
    db = await Database.connect(database_url, pool_size=1)
    try:
        async with db.engine.begin() as conn:
            yield conn
    finally:
        await db.dispose()


async def row_counts(database_url: str) -> dict[str, int]:
    """How many rows each table of the service holds, read from the database itself."""
    async with directly(database_url) as conn:
        return {
            table: (await conn.execute(text(f"SELECT count(*) FROM {table}"))).scalar_one()
            for table in ("session", "run", "message")
        }


async def test_stateless_run_answers_and_writes_nothing(
    client: httpx.AsyncClient, tool_server: ToolServer, database_url: str
) -> None:
    body = await run(client, "triage", "triage issue 7")

    assert body["session_id"] is None
    assert_completed_triage(body, "triage issue 7")
    assert {m["run_id"] for m in body["messages"]} == {body["run_id"]}  # the user's too
    # Numbered and timed as a new session's would be, though nothing is stored.
    assert [m["seq"] for m in body["messages"]] == [1, 2, 3, 4, 5]
    times = [datetime.fromisoformat(m["created_at"]) for m in body["messages"]]
    assert times == sorted(times)
    assert tool_server.count("get_issue") == tool_server.count("post_slack") == 1
    assert (await get_ok(client, "/v1/sessions")) == {"data": [], "next_after": None}
    for run_id in (body["run_id"], "00000000-0000-0000-0000-000000000000", "nope"):
        assert_problem(await client.get(f"/v1/runs/{run_id}"), 404, "run_not_found")
    assert await row_counts(database_url) == {"session": 0, "run": 0, "message": 0}


async def test_durable_run_is_recorded_with_its_messages(client: httpx.AsyncClient) -> None:
    body = await run(client, "triage", "triage issue 7", session_id="s-1", metadata={"k": 1})

    assert body["session_id"] == "s-1"
    assert_completed_triage(body, "triage issue 7")
    assert [m["seq"] for m in body["messages"]] == [1, 2, 3, 4, 5]
    assert {m["run_id"] for m in body["messages"]} == {body["run_id"]}

    record = await get_ok(client, f"/v1/runs/{body['run_id']}")
    for field in sorted(RUN_FIELDS | {"error", "metadata"}):
        assert record[field] == body[field], field
    created = datetime.fromisoformat(record["created_at"])
    finished = datetime.fromisoformat(record["finished_at"])
    assert created <= finished

    history = await get_ok(client, "/v1/sessions/s-1/messages")
    assert history["data"] == record["messages"]
    # The final answer of a turn that used tools is stored too.
    assert history["data"][-1]["role"] == "assistant"
    assert history["data"][-1]["content"] == body["response"]
    # Written with the run's end, as of it: it had been stamped ~20 us after finished_at,
    # and the session's updated_at too.
    assert datetime.fromisoformat(history["data"][-1]["created_at"]) == finished
    session = await get_ok(client, "/v1/sessions/s-1")
    assert datetime.fromisoformat(session["updated_at"]) == finished


async def test_second_turn_appends_to_the_session(
    client: httpx.AsyncClient, fake_model: FakeAnthropic
) -> None:
    first = await run(client, "echo", "one", session_id="chat")
    second = await run(client, "echo", "two", session_id="chat")

    assert [m["seq"] for m in first["messages"]] == [1, 2]
    assert [m["seq"] for m in second["messages"]] == [3, 4]
    assert second["response"] == "echo: two"
    sent = fake_model.requests[-1]["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "user"]

    history = (await get_ok(client, "/v1/sessions/chat/messages"))["data"]
    assert [(m["seq"], m["role"], m["content"]) for m in history] == [
        (1, "user", "one"),
        (2, "assistant", "echo: one"),
        (3, "user", "two"),
        (4, "assistant", "echo: two"),
    ]
    assert [m["run_id"] for m in history] == [first["run_id"]] * 2 + [second["run_id"]] * 2
    assert (await get_ok(client, "/v1/sessions/chat"))["message_count"] == 4


async def test_model_failure_is_a_run_error_and_writes_no_history(
    client: httpx.AsyncClient, tool_server: ToolServer
) -> None:
    for agent, error_type in [("broken-model", "api_error"), ("overloaded", "overloaded_error")]:
        for session_id in (None, f"failing-{agent}"):
            body = await run(client, agent, "hello", session_id=session_id)

            assert body["status"] == "error", body
            assert body["session_id"] == session_id
            assert body["response"] is None
            assert body["error"]["type"] == error_type
            assert isinstance(body["error"]["message"], str) and body["error"]["message"]
            assert body["messages"] == []  # the turn stored none, not even its user message
        messages = await client.get(f"/v1/sessions/failing-{agent}/messages")
        # Whether or not the failed turn left an empty session behind, it left no history.
        if messages.status_code != 404:
            assert messages.status_code == 200, messages.text
            assert messages.json()["data"] == []
    assert tool_server.invocations == []


async def test_model_failure_leaves_the_history_as_it_was(
    client: httpx.AsyncClient, fake_model: FakeAnthropic
) -> None:
    for status, error_type in [(500, "api_error"), (529, "overloaded_error")]:
        chat = f"chat-{status}"
        await run(client, "echo", "one", session_id=chat)
        before = await get_ok(client, f"/v1/sessions/{chat}/messages")

        fake_model.fail_next(1, status)
        failed = await run(client, "echo", "two", session_id=chat)

        assert failed["status"] == "error"
        assert failed["error"]["type"] == error_type
        assert (await get_ok(client, f"/v1/sessions/{chat}"))["message_count"] == 2
        assert await get_ok(client, f"/v1/sessions/{chat}/messages") == before
        record = await get_ok(client, f"/v1/runs/{failed['run_id']}")
        assert record["status"] == "error"
        assert record["error"] == failed["error"]
        assert record["messages"] == failed["messages"] == []

        # The failed turn's message is not part of what the model sees next.
        third = await run(client, "echo", "three", session_id=chat)
        assert [m["seq"] for m in third["messages"]] == [3, 4]
        contents = [m["content"] for m in fake_model.requests[-1]["messages"]]
        assert "two" not in json.dumps(contents)


async def test_metadata_is_kept_on_the_session_and_on_each_run(client: httpx.AsyncClient) -> None:
    first = await run(client, "echo", "one", session_id="meta", metadata={"ticket": "T-1"})
    second = await run(client, "echo", "two", session_id="meta", metadata={"step": 2})

    assert first["metadata"] == {"ticket": "T-1"}
    assert second["metadata"] == {"step": 2}
    session = await get_ok(client, "/v1/sessions/meta")
    assert session["metadata"] == {"ticket": "T-1"}
    assert (await get_ok(client, f"/v1/runs/{first['run_id']}"))["metadata"] == {"ticket": "T-1"}
    assert (await get_ok(client, f"/v1/runs/{second['run_id']}"))["metadata"] == {"step": 2}
    runs = (await get_ok(client, "/v1/sessions/meta/runs"))["data"]
    assert [r["metadata"] for r in runs] == [{"step": 2}, {"ticket": "T-1"}]


@pytest.mark.parametrize(
    ("agent", "stop_reason"),
    [("cut-off", "max_tokens"), ("context-cut-off", "model_context_window_exceeded")],
)
async def test_a_tool_call_cut_off_by_a_token_limit_is_never_made(
    client: httpx.AsyncClient, tool_server: ToolServer, agent: str, stop_reason: str
) -> None:
    # Its input may be incomplete (the answer stopped at max_tokens, or at the context
    # window): the run ends as a failed model call, storing nothing of that answer.
    for session_id in (None, agent):
        body = await run(client, agent, "post the report", session_id=session_id)
        assert body["status"] == "error", body
        assert body["error"]["type"] == stop_reason
        assert "the call was not made" in body["error"]["message"]
        assert body["stop_reason"] == stop_reason
        assert body["messages"] == []
        assert body["usage"]["output_tokens"] > 0  # the answer was paid for all the same
    assert tool_server.invocations == []
    assert (await get_ok(client, f"/v1/sessions/{agent}/messages"))["data"] == []


async def shown_everywhere(client: httpx.AsyncClient, body: Json) -> list[str | None]:
    """The run's stop_reason as its record and its session's runs list show it."""
    record = await get_ok(client, f"/v1/runs/{body['run_id']}")
    runs = (await get_ok(client, f"/v1/sessions/{body['session_id']}/runs"))["data"]
    (listed,) = [r for r in runs if r["run_id"] == body["run_id"]]
    return [record["stop_reason"], listed["stop_reason"]]


@pytest.mark.parametrize(
    ("agent", "stop_reason"),
    [
        ("cut-short", "max_tokens"),
        ("refused", "refusal"),
        # A newer stop reason, longer than any the API has: its first 64 characters.
        ("newer-stop", NEWER_STOP[:64]),
    ],
)
async def test_a_text_answer_that_stopped_short_completes_and_says_why(
    client: httpx.AsyncClient, agent: str, stop_reason: str
) -> None:
    # It ended `complete` with the text it had, and nothing told a client that this text
    # was cut off mid-sentence: its stop reason does.
    for session_id in (None, f"stopped-{agent}"):
        body = await run(client, agent, "tell me everything", session_id=session_id)

        assert body["status"] == "complete", body
        assert body["error"] is None
        assert body["response"] == "echo: tell me everything"[:STOPPED_TEXT_CHARS]
        assert body["stop_reason"] == stop_reason
        assert [m["role"] for m in body["messages"]] == ["user", "assistant"]
    assert await shown_everywhere(client, body) == [stop_reason] * 2


async def test_a_finished_turn_says_end_turn_with_or_without_tools(
    client: httpx.AsyncClient,
) -> None:
    # With tools the stop reason is the last answer's, not the `tool_use` of the step's.
    for agent in ("echo", "triage"):
        for session_id in (None, f"finished-{agent}"):
            body = await run(client, agent, "triage issue 7", session_id=session_id)
            assert body["status"] == "complete", body
            assert body["stop_reason"] == "end_turn"
        assert await shown_everywhere(client, body) == ["end_turn"] * 2
    assert body["iterations"] == 2


async def test_a_turn_whose_first_model_call_failed_has_no_stop_reason(
    client: httpx.AsyncClient, fake_model: FakeAnthropic
) -> None:
    for session_id in (None, "no-answer"):
        body = await run(client, "broken-model", "hello", session_id=session_id)
        assert (body["status"], body["stop_reason"]) == ("error", None)
    assert await shown_everywhere(client, body) == [None, None]

    await run(client, "cut-short", "one", session_id="no-answer-later")
    fake_model.fail_next(1, 529)
    failed = await run(client, "cut-short", "two", session_id="no-answer-later")
    assert (failed["status"], failed["stop_reason"]) == ("error", None)
    assert await shown_everywhere(client, failed) == [None, None]


async def test_a_replay_answers_the_stop_reason_the_turn_stored(
    client: httpx.AsyncClient, fake_model: FakeAnthropic
) -> None:
    body = {"agent": "cut-short", "message": "tell me everything", "session_id": "replayed"}
    key = {"Idempotency-Key": "k-stop"}
    first = await client.post("/v1/runs", json=body, headers=key)
    assert first.status_code == 200, first.text
    assert first.json()["stop_reason"] == "max_tokens"
    model_calls = len(fake_model.requests)

    again = await client.post("/v1/runs", json=body, headers=key)

    assert again.status_code == 200, again.text
    assert again.headers.get("idempotent-replayed") == "true"
    assert again.json() == first.json()
    assert len(fake_model.requests) == model_calls


async def test_text_the_stores_cannot_hold_is_stored_replaced(
    client: httpx.AsyncClient, tool_server: ToolServer
) -> None:
    # A NUL (PostgreSQL text) or a lone surrogate (no UTF-8 form) from the model was a 500
    # after the tool had run, and lost the turn: each is stored as U+FFFD instead.
    body = await run(client, "unstorable", "look it up", session_id="odd")

    assert body["status"] == "complete", body
    assert body["response"].endswith(" \ufffd\ufffd")
    assert [m["content"] for m in body["messages"] if m["role"] == "assistant"] == [
        "step 1 \ufffd\ufffd",
        body["response"],
    ]
    assert body["messages"][1]["tool_calls"][0]["arguments"] == {"id": "id-1 \ufffd\ufffd"}
    assert [i.body for i in tool_server.invocations] == [{"id": "id-1 \ufffd\ufffd"}]
    assert (await get_ok(client, "/v1/sessions/odd/messages"))["data"] == body["messages"]
    assert (await get_ok(client, f"/v1/runs/{body['run_id']}"))["response"] == body["response"]


async def test_what_the_model_sends_is_stored_whole_on_every_store(
    client: httpx.AsyncClient, tool_server: ToolServer
) -> None:
    # PostgreSQL refused a tool_use id over 128 characters, a tool name over 64 and a token
    # count over 2^31 - 1 after the tool had run: a 500, and the session could not be
    # resumed (each repair wrote the same id). SQLite stored them; now both do.
    body = await run(client, "outsized", "post the report", session_id="outsized")

    assert body["status"] == "complete", body
    assert body["usage"]["input_tokens"] == 2 * 3_000_000_000
    calls = body["messages"][1]["tool_calls"]
    assert [(len(c["id"]), c["name"]) for c in calls] == [(300, "post_slack"), (300, "n" * 100)]
    results = {m["tool_call_id"]: m for m in body["messages"] if m["role"] == "tool"}
    assert results.keys() == {c["id"] for c in calls}
    assert results[calls[1]["id"]]["is_error"] and results[calls[1]["id"]]["tool_name"] == "n" * 100
    assert tool_server.count("post_slack") == 1
    assert (await get_ok(client, "/v1/sessions/outsized/messages"))["data"] == body["messages"]
    stored = await get_ok(client, f"/v1/runs/{body['run_id']}")
    assert stored["usage"] == body["usage"]


async def test_a_call_id_the_api_would_refuse_back_is_never_run(
    client: httpx.AsyncClient, tool_server: ToolServer, fake_model: FakeAnthropic
) -> None:
    # `call:…` ran the tool, was stored, and was refused by the API in the same turn's next
    # call and in every later one: the side effect done, the session dead.
    body = await run(client, "bad-ids", "post it", session_id="bad-ids")

    assert body["status"] == "error", body
    assert body["error"]["type"] == "api_error"
    assert "is not of A-Z a-z 0-9 _ -" in body["error"]["message"]
    assert tool_server.count("post_slack") == 0
    assert (await get_ok(client, "/v1/sessions/bad-ids/messages"))["data"] == []
    assert len(fake_model.requests) == 1


async def test_a_call_id_an_earlier_turn_used_is_never_run(
    client: httpx.AsyncClient, tool_server: ToolServer, fake_model: FakeAnthropic
) -> None:
    # The model (here a test double) names its first call of every turn `toolu_step0_call0`.
    # The second turn's call ran and was stored, and then the API refused every request of
    # the session: its ids must be unique over the whole history.
    first = await run(client, "reused-ids", "post it", session_id="reused")
    assert first["status"] == "complete", first
    assert tool_server.count("post_slack") == 1

    second = await run(client, "reused-ids", "post it again", session_id="reused")

    assert second["status"] == "error", second
    assert second["error"]["type"] == "api_error"
    assert "'toolu_step0_call0' was used by an earlier call" in second["error"]["message"]
    assert tool_server.count("post_slack") == 1
    stored = (await get_ok(client, "/v1/sessions/reused/messages"))["data"]
    assert stored == first["messages"]
    assert fake_model.requests[-1]["messages"][-1]["content"][-1]["text"] == "post it again"


def without_tools(agents_file: Path) -> Path:
    """A copy of the test agents file in which `triage` has no tools."""
    toolless = agents_file.with_name("toolless.yaml")
    toolless.write_text(
        agents_file.read_text().replace(
            "system: You triage incoming issues.\n    tools: [get_issue, post_slack]",
            "system: You triage incoming issues.\n    tools: []",
        )
    )
    return toolless


async def test_an_agent_whose_tools_were_all_removed_continues_its_sessions(
    database_url: str, agents_file: Path, fake_model: FakeAnthropic
) -> None:
    # Its history holds tool_use and tool_result blocks, and the API refuses those in a
    # request that defines no tools: every later turn failed.
    async with serve(build_app(database_url, agents_file, fake_model)) as before:
        first = await run(before, "triage", "triage issue 7", session_id="s-1")
    assert first["status"] == "complete", first

    async with serve(build_app(database_url, without_tools(agents_file), fake_model)) as after:
        assert (await get_ok(after, "/v1/agents/triage"))["tools"] == []
        second = await run(after, "triage", "anything else?", session_id="s-1")

    assert (second["status"], second["response"]) == ("complete", "echo: anything else?")
    sent = fake_model.requests[-1]
    assert [t["name"] for t in sent["tools"]] == ["get_issue", "post_slack"]
    assert sent["tool_choice"] == {"type": "none"}


async def test_a_model_error_is_stored_whatever_its_type_and_text(
    client: httpx.AsyncClient, fake_model: FakeAnthropic
) -> None:
    # The API error's type and message are stored with the run: a type over 64 characters
    # or a NUL in either was a 500 on PostgreSQL, not the run `error` §3 describes.
    fake_model.fail_next(1, 400, "invalid_" * 12 + "\x00")

    body = await run(client, "echo", "hello", session_id="odd-error")

    assert body["status"] == "error", body
    assert body["error"]["type"] == "invalid_" * 12 + "\ufffd"
    assert "\x00" not in body["error"]["message"] and "invalid_" in body["error"]["message"]
    assert (await get_ok(client, f"/v1/runs/{body['run_id']}"))["error"] == body["error"]


async def test_a_key_stored_by_a_build_that_hashed_floats_as_sent_still_replays(
    client: httpx.AsyncClient, database_url: str
) -> None:
    # Builds before 2026-11-30 stored the fingerprint of 12.0 as written; one of their keys
    # must still replay after an upgrade (CONTRACT §4), and still refuse another body.
    body = {"agent": "echo", "message": "pay", "session_id": "old-key", "metadata": {"n": 12.0}}
    key = {"Idempotency-Key": "k-1"}
    first = await client.post("/v1/runs", json=body, headers=key)
    assert first.status_code == 200, first.text
    as_sent = json.dumps(body, sort_keys=True, separators=(",", ":"))
    old = hashlib.sha256(as_sent.encode()).hexdigest()
    async with directly(database_url) as conn:
        stored = await conn.execute(
            text("UPDATE run SET request_fingerprint = :old WHERE id = :id"),
            {"old": old, "id": first.json()["run_id"]},
        )
        assert stored.rowcount == 1

    again = await client.post("/v1/runs", json=body, headers=key)
    assert again.status_code == 200, again.text
    assert again.headers.get("idempotent-replayed") == "true"
    assert again.json()["run_id"] == first.json()["run_id"]
    other = await client.post("/v1/runs", json={**body, "message": "pay twice"}, headers=key)
    assert_problem(other, 422, "idempotency_key_reused")
