"""A crash never loses or changes what earlier turns committed (CONTRACT §2), on both stores.

One session lives through a crash in each §6 window in turn, each resumed by resubmitting
its turn: after every crash, and after every resume, all that was committed before reads back
exactly as it was (seq, role, content, tool calls, run id, time), and no side effect ran twice.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from app.failpoints import NAMES
from tests.crash.support import (
    assert_history_consistent,
    assert_idempotency_keys,
    crash_run,
    list_messages,
    post_run,
    run_body,
    server_maker,
)
from tests.support.fake_anthropic import FakeAnthropic
from tests.support.tool_server import ToolServer

pytestmark = pytest.mark.crash

TURN = ["user", "assistant", "tool", "tool", "assistant"]  # a triage turn: one step, then text


def test_a_session_keeps_its_past_through_a_crash_in_every_window(
    tmp_path: Path, database_url: str, fake_model: FakeAnthropic, tool_server: ToolServer
) -> None:
    server = server_maker(
        tmp_path, database_url=database_url, fake_model=fake_model, tool_server=tool_server
    )
    with server(label="before") as plain, plain.client() as client:
        for n in (1, 2):
            run = post_run(client, run_body("triage", message=f"triage issue {n}"))
            assert run["status"] == "complete", run
        kept = list_messages(client)
    assert [m["role"] for m in kept] == TURN * 2

    for window in NAMES:  # in the order a turn reaches them
        body = run_body("triage", message=f"triage the issue at {window}")
        with server(label=f"crash-{window}", failpoints=window) as armed:
            crash_run(armed, body)
        with server(label=f"resume-{window}") as resumed, resumed.client() as client:
            snapshot = list_messages(client)
            assert snapshot[: len(kept)] == kept, f"{window}: committed history changed"
            run = post_run(client, body)
            assert run["status"] == "complete", run
            history = list_messages(client)
            assert history[: len(snapshot)] == snapshot, f"{window}: the resume changed history"
            assert [m["role"] for m in history[-len(TURN) :]] == TURN
            assert_history_consistent(history)
        kept = history

    posts = tool_server.per_call("post_slack")  # not safe_to_retry: never run twice
    assert posts and set(posts.values()) == {1}, posts
    assert tool_server.count("post_slack") == len(posts)
    assert_idempotency_keys(tool_server)
