"""PostgreSQL: the journal's connections die under a run. One that died idle in the pool (a
proxy's or the server's idle timeout) is replaced before the write, which goes on; one that dies
under the write is told committed or not from the session's state while the session is still
held, and the turn goes on; with the hold gone too it answers 503, and the session resumes with
the side effect that ran kept at most once."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import asyncpg
import httpx
import pytest
from sqlalchemy.engine import make_url

from tests.support.polling import wait_for
from tests.support.server import AgentsServer
from tests.support.tool_server import ToolServer
from tests.support.transactions import SessionRowLock, TableLock

TURN = {"agent": "slow", "message": "post it slowly", "session_id": "lost-connection"}
KEY = {"Idempotency-Key": "turn-1"}
ECHO = {"agent": "echo", "message": "hello"}

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.parametrize("backend", ["postgres"], indirect=True),
]


def _terminate_pooled_connections(database_url: str) -> int:
    """End every backend on the database but the one holding advisory locks (the server's
    ownership connection): what is left is the server's connection pool."""

    async def go() -> int:
        url = make_url(database_url)
        admin = url.set(drivername="postgresql", database="postgres")
        conn = await asyncpg.connect(admin.render_as_string(hide_password=False))
        try:
            ended = await conn.fetchval(
                "SELECT count(*) FROM ("
                " SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity"
                " WHERE datname = $1"
                " AND pid NOT IN (SELECT pid FROM pg_locks WHERE locktype = 'advisory')"
                ") AS ended",
                url.database,
            )
            return int(ended)
        finally:
            await conn.close()

    return asyncio.run(go())


def _backends(database_url: str) -> int:
    """How many connections the database has (but this one)."""

    async def count() -> int:
        url = make_url(database_url).set(drivername="postgresql")
        conn = await asyncpg.connect(url.render_as_string(hide_password=False))
        try:
            sql = (
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            return int(await conn.fetchval(sql))
        finally:
            await conn.close()

    return asyncio.run(count())


def _turn_in_flight(
    pool: ThreadPoolExecutor, client: httpx.Client, tool_server: ToolServer
) -> Future[httpx.Response]:
    """The keyed turn, posted and waiting inside its slow_post call (the tool server holds it)."""
    in_flight = pool.submit(client.post, "/v1/runs", json=TURN, headers=KEY)
    wait_for(tool_server.in_flight.is_set, timeout=20, what="slow_post in flight")
    return in_flight


def _resume(client: httpx.Client) -> None:
    """The keyed turn resubmitted completes."""
    resumed = client.post("/v1/runs", json=TURN, headers=KEY)
    assert resumed.status_code == 200, resumed.text
    assert resumed.json()["status"] == "complete"


@contextmanager
def _write_2_ended_while_waiting(
    database_url: str,
    pg_admin: Callable[..., None],
    tool_server: ToolServer,
    *,
    hold_too: bool = False,
    first: str | None = None,
) -> Iterator[SessionRowLock]:
    """Write #2 waits on the session's row (another client holds it until the block ends);
    its backend is ended while it waits (after the statement `first`, if given), and with
    `hold_too` the server's lock connection just before it: ended in one statement, the
    write's end could be seen, and the session's state read, while the hold still stood."""
    database = make_url(database_url).database
    ended = (
        f"SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity WHERE datname = '{database}'"
    )
    with SessionRowLock(database_url, session_id=TURN["session_id"]) as row:
        tool_server.release()
        wait_for(row.blocked, timeout=20, what="write #2 waiting on the row")
        if first is not None:
            pg_admin(first)
        if hold_too:
            pg_admin(f"{ended} AND pid IN (SELECT pid FROM pg_locks WHERE locktype = 'advisory')")
        pg_admin(f"{ended} AND wait_event_type = 'Lock'")
        yield row


def _slow_post_result(client: httpx.Client) -> dict[str, Any]:
    """The session's one slow_post result, after a turn with one user message."""
    history = client.get(f"/v1/sessions/{TURN['session_id']}/messages").json()["data"]
    assert sum(1 for m in history if m["role"] == "user") == 1
    results = [m for m in history if m["role"] == "tool" and m["tool_name"] == "slow_post"]
    assert len(results) == 1
    result: dict[str, Any] = results[0]
    return result


def _kept_its_result(done: httpx.Response, client: httpx.Client, tool_server: ToolServer) -> None:
    """The turn completed, its slow_post ran once, and the tool's own answer is stored."""
    assert done.status_code == 200, done.text
    assert done.json()["status"] == "complete"
    result = _slow_post_result(client)
    assert tool_server.count("slow_post") == 1
    assert not result["is_error"]
    assert "kind" not in json.loads(result["content"])


def _refused_then_resumed(refused: httpx.Response, client: httpx.Client) -> None:
    """The turn was answered 503 `database_unavailable`; resubmitted, it completes."""
    assert refused.status_code == 503, refused.text
    assert refused.json()["code"] == "database_unavailable"
    _resume(client)


def test_pooled_connections_that_died_idle_are_replaced_and_the_turn_keeps_its_results(
    database_url: str, tool_server: ToolServer, agents_server: AgentsServer
) -> None:
    server = agents_server(database_url=database_url).start()
    try:
        with ThreadPoolExecutor(max_workers=8) as pool, server.client(timeout=60) as client:
            # Turns in parallel leave several connections in the pool, all soon dead.
            warm = [
                pool.submit(client.post, "/v1/runs", json={**ECHO, "session_id": f"warm-{i}"})
                for i in range(8)
            ]
            assert all(f.result(timeout=30).status_code == 200 for f in warm)
            in_flight = _turn_in_flight(pool, client, tool_server)
            assert _terminate_pooled_connections(database_url) >= 2
            tool_server.release()  # write #2 checks out a connection the server has ended
            _kept_its_result(in_flight.result(timeout=30), client, tool_server)
    finally:
        server.kill()


@pytest.mark.parametrize(
    ("hold_too", "logged"),
    [
        # The server still holds the session, so the stored state tells it the write did not
        # commit: it is sent again, and goes through once the row is free.
        (False, "had not committed: sent again"),
        # The lock connection ends too (backends ended, a network path lost): nobody took the
        # session, so the turn takes it again and finds it as the write left it before. The
        # turn answered 503 here, and the post that was made became a durability error.
        (True, "taken again, the write had not committed: sent again"),
    ],
    ids=["session-held", "hold-lost-too"],
)
def test_a_write_whose_connection_dies_under_it_is_told_committed_or_not_and_goes_on(
    database_url: str,
    pg_admin: Callable[..., None],
    agents_server: AgentsServer,
    tool_server: ToolServer,
    hold_too: bool,
    logged: str,
) -> None:
    server = agents_server(database_url=database_url).start()
    try:
        with ThreadPoolExecutor(max_workers=1) as pool, server.client(timeout=60) as client:
            in_flight = _turn_in_flight(pool, client, tool_server)
            with _write_2_ended_while_waiting(
                database_url, pg_admin, tool_server, hold_too=hold_too
            ) as row:
                wait_for(row.blocked, timeout=20, what="write #2 sent again, waiting")
            _kept_its_result(in_flight.result(timeout=30), client, tool_server)
        assert logged in server.logs()
    finally:
        server.kill()


def test_a_write_whose_connection_dies_with_the_hold_and_the_database_answers_503(
    database_url: str,
    pg_admin: Callable[..., None],
    agents_server: AgentsServer,
    tool_server: ToolServer,
) -> None:
    # As above, but the database takes no connection meanwhile (a restart, a failover): the
    # session cannot be taken again nor its state read, and an outage is not waited for.
    database = make_url(database_url).database
    server = agents_server(database_url=database_url).start()
    try:
        with ThreadPoolExecutor(max_workers=1) as pool, server.client(timeout=60) as client:
            in_flight = _turn_in_flight(pool, client, tool_server)
            refuse = f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS false'
            with _write_2_ended_while_waiting(
                database_url, pg_admin, tool_server, hold_too=True, first=refuse
            ):
                refused = in_flight.result(timeout=30)
            pg_admin(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS true')
            _refused_then_resumed(refused, client)
            result = _slow_post_result(client)
        assert tool_server.count("slow_post") == 1
        assert json.loads(result["content"])["kind"] == "tool-durability-error"
    finally:
        server.kill()
        pg_admin(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS true')


def test_a_write_that_cannot_connect_at_all_answers_503(
    database_url: str,
    tool_server: ToolServer,
    agents_server: AgentsServer,
    pg_admin: Callable[..., None],
) -> None:
    # The database refuses new connections (a role that may no longer log in, a database
    # being dropped, too many clients) while a run's tool is in flight: the driver's own
    # error reached the client as a 500 `internal_error`.
    database = make_url(database_url).database
    server = agents_server(database_url=database_url).start()
    try:
        with ThreadPoolExecutor(max_workers=1) as pool, server.client(timeout=60) as client:
            in_flight = _turn_in_flight(pool, client, tool_server)
            pg_admin(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS false')
            assert _terminate_pooled_connections(database_url) >= 1
            # A read checks out a dead connection, and its replacement is refused; so is
            # every connection write #2 tries to open.
            assert client.get("/v1/sessions").status_code == 503
            tool_server.release()
            refused = in_flight.result(timeout=30)
            pg_admin(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS true')
            _refused_then_resumed(refused, client)
        assert tool_server.count("slow_post") == 1
    finally:
        server.kill()
        pg_admin(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS true')


def _lose_both_connections_under_writes(
    database_url: str,
    pg_admin: Callable[..., None],
    pool: ThreadPoolExecutor,
    client: httpx.Client,
    sessions: list[str],
) -> None:
    """The sessions' turns at once, on a pool of two: both its connections wait for a table
    lock under a write, and are ended there."""
    database = make_url(database_url).database
    lock = TableLock(database_url)
    lock.take()
    try:
        turns = [
            pool.submit(client.post, "/v1/runs", json={**ECHO, "session_id": session})
            for session in sessions
        ]
        wait_for(lambda: lock.waiting() == 2, timeout=30, what="the pool's two connections")
        pg_admin(
            "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity"
            f" WHERE datname = '{database}' AND wait_event_type = 'Lock'"
        )
    finally:
        lock.release()
    for turn in turns:  # each told whether its write committed, or 503
        assert turn.result(timeout=60).status_code in (200, 503)


def test_connections_lost_under_writes_leave_the_pool_no_bigger(
    database_url: str, pg_admin: Callable[..., None], agents_server: AgentsServer
) -> None:
    # A connection lost under a write disposed of the whole pool: connections checked out at
    # that moment went back to the old pool when returned, and stayed open for good. A
    # replica held one or two more connections past DATABASE_POOL_SIZE after each such loss.
    server = agents_server(database_url=database_url, env={"DATABASE_POOL_SIZE": "2"}).start()
    try:
        with ThreadPoolExecutor(max_workers=6) as pool, server.client(timeout=60) as client:
            for cycle in range(3):
                sessions = [f"c{cycle}-{i}" for i in range(6)]
                _lose_both_connections_under_writes(database_url, pg_admin, pool, client, sessions)
            for i in range(4):  # the pool's connections are each used again
                answer = client.post("/v1/runs", json={**ECHO, "session_id": f"after-{i}"})
                assert answer.status_code == 200, answer.text
            assert _backends(database_url) <= 3  # the pool's two and the ownership's
    finally:
        server.kill()
