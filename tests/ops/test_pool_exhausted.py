"""PostgreSQL: while every pooled connection is in use, a turn whose tools ran waits for one
instead of giving up and losing their results."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import httpx
import pytest

from app.db.outages import POOL_BUSY_DETAIL
from tests.ops.helpers import scrape, value
from tests.support.polling import wait_for
from tests.support.server import AgentsServer
from tests.support.tool_server import ToolServer
from tests.support.transactions import TableLock

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.parametrize("backend", ["postgres"], indirect=True),
]

POOL_TIMEOUT_S = 10  # the engine's pool_timeout (app/db/session.py)


def _in_thread(post: Callable[[], httpx.Response]) -> tuple[threading.Thread, list[httpx.Response]]:
    answers: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: answers.append(post()), daemon=True)
    thread.start()
    return thread, answers


@pytest.mark.timeout(180)
def test_a_turn_whose_tools_ran_waits_for_a_connection_and_keeps_their_results(
    database_url: str, tmp_path: Path, tool_server: ToolServer, agents_server: AgentsServer
) -> None:
    # Its write #2 gave up after the pool's 10 s with 503: the result of a side effect that
    # had run was lost (the resubmission stored a durability error in its place).
    server = agents_server(database_url=database_url, env={"DATABASE_POOL_SIZE": "2"})
    lock = TableLock(database_url)
    with server, server.client(timeout=120) as client:

        def run(agent: str, session_id: str) -> httpx.Response:
            body = {"agent": agent, "message": "issue 7", "session_id": session_id}
            return client.post("/v1/runs", json=body)

        held, held_answer = _in_thread(lambda: run("slow", "held"))
        wait_for(tool_server.in_flight.is_set, timeout=30, what="slow_post in flight")
        lock.take()
        try:
            # Two turns take the pool's two connections and wait on the lock with them.
            others = [_in_thread(partial(run, "triage", f"other-{i}")) for i in range(2)]
            wait_for(lambda: lock.waiting() == 2, timeout=30, what="both connections waiting")
            # A request that has not written yet gives up after the pool's timeout.
            busy, busy_answer = _in_thread(partial(run, "triage", "latecomer"))
            tool_server.release()  # slow_post answers: its write #2 needs a connection
            busy.join(timeout=60)
            [refused] = busy_answer
            assert refused.status_code == 503, refused.text
            assert refused.json()["detail"] == POOL_BUSY_DETAIL
            time.sleep(5)  # past the pool's timeout for write #2 too, with room for a slow start
        finally:
            lock.release()
        for thread, _ in [(held, held_answer), *others]:
            thread.join(timeout=60)
        [answer] = held_answer
        assert answer.status_code == 200, answer.text
        assert answer.json()["status"] == "complete"
        for _, [other] in others:
            assert other.status_code == 200, other.text
        messages = client.get("/v1/sessions/held/messages").json()["data"]
    [result] = [m for m in messages if m["role"] == "tool" and m["tool_name"] == "slow_post"]
    assert (result["is_error"], json.loads(result["content"])) == (False, {"ok": True})
    assert tool_server.count("slow_post") == 1


@pytest.mark.timeout(120)
def test_turns_past_the_pools_size_wait_for_a_pooled_connection(
    database_url: str, tool_server: ToolServer, agents_server: AgentsServer
) -> None:
    # The pool opened as many connections again under load, each closed as soon as it was
    # given back: past the pool's size, every transaction paid for a new connection.
    server = agents_server(database_url=database_url, env={"DATABASE_POOL_SIZE": "2"})
    lock = TableLock(database_url)
    with server, server.client(timeout=60) as client:

        def run(session_id: str) -> httpx.Response:
            body = {"agent": "triage", "message": "issue 7", "session_id": session_id}
            return client.post("/v1/runs", json=body)

        lock.take()
        try:
            turns = [_in_thread(partial(run, f"turn-{i}")) for i in range(4)]
            wait_for(lambda: lock.waiting() == 2, timeout=30, what="the pool's two connections")
            time.sleep(1)  # time for the other two turns to open connections, had they any
            assert lock.waiting() == 2
            assert lock.connected() == 3  # the pool's two and the ownership's lock connection
            busy = scrape(client)  # what an operator sizing the pool sees
        finally:
            lock.release()
        for thread, _ in turns:
            thread.join(timeout=POOL_TIMEOUT_S + 20)
        idle = scrape(client)
    for _, [answer] in turns:
        assert answer.status_code == 200, answer.text
        assert answer.json()["status"] == "complete"
    assert value(busy, "agent_runner_database_pool_size") == 2
    assert value(busy, "agent_runner_database_connections", state="in_use") == 2
    assert value(busy, "agent_runner_database_connections", state="idle") == 0
    assert value(idle, "agent_runner_database_connections", state="in_use") == 0
    assert value(idle, "agent_runner_database_connections", state="idle") == 2
