"""One run at a time per session (CONTRACT §4): in one process, and across processes."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from tests.ownership.conftest import Servers
from tests.ownership.helpers import (
    POSTGRES_ONLY,
    Background,
    Json,
    assert_busy,
    fire_together,
    history,
    ok,
    run_body,
    session_runs,
    session_status,
)
from tests.support.fake_anthropic import FakeAnthropic
from tests.support.polling import wait_for
from tests.support.server import ServerProcess
from tests.support.tool_server import ToolServer
from tests.support.transactions import SessionRowLock


def split(responses: list[httpx.Response]) -> tuple[Json, list[Json]]:
    """The one 200's run and the other answers' problems (each a 409 session_busy)."""
    statuses = Counter(r.status_code for r in responses)
    winners = [r for r in responses if r.status_code == 200]
    assert len(winners) == 1, (statuses, [r.text for r in responses if r.status_code != 409])
    return ok(winners[0]), [assert_busy(r) for r in responses if r is not winners[0]]


def assert_ran_once(server: ServerProcess, run: Json, tool_server: ToolServer) -> None:
    """The winner finished its turn alone, and each of its tools was invoked exactly once."""
    assert run["status"] == "complete", run
    assert tool_server.count("get_issue") == 1, tool_server.invocations
    assert tool_server.count("post_slack") == 1, tool_server.invocations
    session_id = run["session_id"]
    with server.client() as client:
        assert [r["run_id"] for r in session_runs(client, session_id)] == [run["run_id"]]
        assert {m["run_id"] for m in history(client, session_id)} == {run["run_id"]}


def test_twenty_concurrent_posts_on_one_session(
    servers: Servers, fake_model: FakeAnthropic, tool_server: ToolServer
) -> None:
    """Exactly one of 20 simultaneous turns runs; the 19 others are 409 naming the winner."""
    server = servers.start("server")
    fake_model.set_delay(2)  # the winner holds the session well past the last arrival
    body = run_body("triage", "Triage issue 7", "s-twenty")
    run, busy = split(fire_together([(server.url, body)] * 20))
    assert len(busy) == 19
    assert [p["active_run_id"] for p in busy] == [run["run_id"]] * 19
    assert_ran_once(server, run, tool_server)


@POSTGRES_ONLY
def test_concurrent_posts_across_two_processes(
    servers: Servers, fake_model: FakeAnthropic, tool_server: ToolServer
) -> None:
    """Two replicas on one PostgreSQL, ten requests each at once: one turn runs, in one place."""
    a, b = servers.new("a"), servers.new("b")
    servers.start_all(a, b)
    fake_model.set_delay(2)  # as above
    body = run_body("triage", "Triage issue 8", "s-replicas")
    run, busy = split(fire_together([(a.url, body)] * 10 + [(b.url, body)] * 10))
    assert len(busy) == 19
    # Every 409 names the winner, also from the replica that learns of it only from the
    # store (where it may not be stored yet when the lock is found taken).
    named = Counter(p["active_run_id"] for p in busy)
    assert named == {run["run_id"]: 19}, named
    assert_ran_once(a, run, tool_server)


@POSTGRES_ONLY
def test_every_busy_answer_across_replicas_names_a_run_of_the_session(
    servers: Servers, fake_model: FakeAnthropic, tool_server: ToolServer
) -> None:
    """Short turns, bursts across two replicas: a refused request names the run that held
    the session, even when that run was not stored yet, or had finished, when it looked."""
    a, b = servers.new("a"), servers.new("b")
    servers.start_all(a, b)
    refused = 0
    for burst in range(6):
        session_id = f"s-burst-{burst}"
        body = run_body("triage", "Triage issue 9", session_id)
        responses = fire_together([(a.url, body)] * 8 + [(b.url, body)] * 8)
        with a.client() as client:
            runs = {r["run_id"] for r in session_runs(client, session_id)}
        winners = [r for r in responses if r.status_code == 200]
        assert winners and {ok(r)["run_id"] for r in winners} <= runs
        for response in responses:
            if response.status_code != 200:
                refused += 1
                named = assert_busy(response)["active_run_id"]
                assert named in runs, (named, sorted(runs))
    assert refused > 0


@POSTGRES_ONLY
def test_delete_on_another_replica_while_a_run_is_in_progress_names_the_run(
    servers: Servers, fake_model: FakeAnthropic
) -> None:
    """DELETE is refused while the session runs, on either replica, with the run's id."""
    a, b = servers.new("a"), servers.new("b")
    servers.start_all(a, b)
    session = "s-delete-busy"
    fake_model.set_delay(2)  # A's first model call keeps the session held
    on_a = Background(a.url, run_body("triage", "Triage issue 12", session))
    wait_for(lambda: len(fake_model.requests) == 1, timeout=15, what="A's model request")
    with b.client() as client:
        refused = client.delete(f"/v1/sessions/{session}")
    answer = on_a.join(30)
    assert isinstance(answer, httpx.Response), answer
    run = ok(answer)
    assert assert_busy(refused)["active_run_id"] == run["run_id"]
    with a.client() as client:  # the run went on, and the session is still there
        assert [r["run_id"] for r in session_runs(client, session)] == [run["run_id"]]


ACME, GLOBEX = {"Authorization": "Bearer key-acme"}, {"Authorization": "Bearer key-globex"}
TENANTS = {"API_KEYS": "key-acme:acme,key-globex:globex"}


def test_requests_that_run_no_turn_never_make_a_turn_busy(servers: Servers) -> None:
    """A 409 means a turn runs. Requests answered without one (another tenant's 404, the
    replay of a finished keyed turn) hold the session only while they are decided: a turn
    arriving meanwhile waits for that and runs, however many of them arrive."""
    server = servers.start("server", env=TENANTS)
    session = "s-not-busy"
    noise = [
        ({**ACME, "Idempotency-Key": "k"}, run_body("echo", "Hello", session), 200),  # a replay
        (GLOBEX, run_body("echo", "Hello", session), 404),  # another tenant's session
    ]
    assert_turns_never_busy(server, noise_at=server, noise=noise, session=session)


@POSTGRES_ONLY
def test_requests_that_run_no_turn_never_make_a_turn_on_another_replica_busy(
    servers: Servers,
) -> None:
    """Across replicas too: a request answered without a turn (a keyed turn's replay,
    another tenant's 404, keyed or not) is decided before it holds the session, so a turn
    that another replica is asked to run meanwhile is never refused: another tenant cannot
    keep a session's owner out."""
    a, b = servers.new("a", env=TENANTS), servers.new("b", env=TENANTS)
    servers.start_all(a, b)
    session = "s-not-busy-across"
    noise = [
        ({**ACME, "Idempotency-Key": "k"}, run_body("echo", "Hello", session), 200),  # a replay
        ({**GLOBEX, "Idempotency-Key": "k"}, run_body("echo", "Hello", session), 404),
        (GLOBEX, run_body("echo", "Hello", session), 404),
    ]
    assert_turns_never_busy(a, noise_at=b, noise=noise, session=session)


def assert_turns_never_busy(
    server: ServerProcess,
    *,
    noise_at: ServerProcess,
    noise: list[tuple[dict[str, str], Json, int]],
    session: str,
) -> None:
    """After a first keyed turn, 15 turns on `server` all run while two threads per `noise`
    request send it to `noise_at` again and again, each answered its status every time."""
    with server.client() as client:
        keyed = run_body("echo", "Hello", session)
        first = ok(client.post("/v1/runs", json=keyed, headers={**ACME, "Idempotency-Key": "k"}))
    stop = threading.Event()
    unexpected: list[str] = []

    def refused_again_and_again(headers: dict[str, str], body: Json, status: int) -> None:
        with httpx.Client(base_url=noise_at.url, timeout=30) as client:
            while not stop.is_set():
                response = client.post("/v1/runs", json=body, headers=headers)
                if response.status_code != status:
                    unexpected.append(response.text)

    threads = [
        threading.Thread(target=refused_again_and_again, args=args, daemon=True)
        for args in noise * 2
    ]
    for thread in threads:
        thread.start()
    try:
        with server.client() as client:
            answers = [
                client.post("/v1/runs", json=run_body("echo", f"Turn {i}", session), headers=ACME)
                for i in range(15)
            ]
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    assert [r.status_code for r in answers] == [200] * 15, [r.text for r in answers]
    assert not unexpected, unexpected[:3]
    with httpx.Client(base_url=server.url, headers=ACME) as client:
        runs = session_runs(client, session)
    assert len(runs) == 16 and runs[-1]["run_id"] == first["run_id"]


@POSTGRES_ONLY
def test_a_session_of_another_database_on_the_server_does_not_look_running(
    servers: Servers, another_pg_database_url: str, fake_model: FakeAnthropic, tmp_path: Path
) -> None:
    """Two deployments on one PostgreSQL server, each with a session "s-same": while one
    runs a turn, the other's session is still `idle` (advisory locks are per database)."""
    here = servers.start("here")
    (tmp_path / "other").mkdir()
    other_deployment = Servers(
        tmp_path / "other",
        database_url=another_pg_database_url,
        model_url=fake_model.url,
        tools_url=here.url,  # unused: echo calls no tool
    )
    try:
        there = other_deployment.start("there")
        session = "s-same"
        with there.client() as client:
            ok(client.post("/v1/runs", json=run_body("echo", "Hello", session)))
        fake_model.set_delay(3)
        running_here = Background(here.url, run_body("echo", "Hello", session))
        wait_for(lambda: len(fake_model.requests) == 2, timeout=15, what="the model call")
        with here.client() as client:
            assert session_status(client, session) == "running"
        with there.client() as client:
            assert session_status(client, session) == "idle"
            listed = ok(client.get("/v1/sessions"))["data"]
            assert [(s["id"], s["status"]) for s in listed] == [(session, "idle")]
        answer = running_here.join(30)
        assert isinstance(answer, httpx.Response), answer
        assert ok(answer)["status"] == "complete"
    finally:
        other_deployment.close()


@POSTGRES_ONLY
def test_many_readers_of_long_session_lists_leave_turns_their_connections(
    servers: Servers, tool_server: ToolServer
) -> None:
    """Forty clients listing 200 sessions again and again while a turn's side effect is in
    flight: the turn still stores its result (the listings' ownership lookups hold no
    database connection its write waits for), and every listing is answered."""
    server = servers.start("server")
    with server.client() as client:
        for i in range(200):
            ok(client.post("/v1/runs", json=run_body("echo", "Hello", f"s-many-{i}")))
    turn = Background(server.url, run_body("slow", "Triage issue 5", "s-many-turn"))
    assert tool_server.in_flight.wait(15), "the side effect never started"
    done = threading.Event()
    statuses: Counter[int] = Counter()

    def list_sessions() -> None:
        with server.client() as client:
            while not done.is_set():
                statuses[client.get("/v1/sessions", params={"limit": 200}).status_code] += 1

    readers = [threading.Thread(target=list_sessions, daemon=True) for _ in range(40)]
    for reader in readers:
        reader.start()
    time.sleep(2)
    tool_server.release()
    answer = turn.join(60)
    done.set()
    for reader in readers:
        reader.join(60)
    assert isinstance(answer, httpx.Response), answer
    run = ok(answer)
    assert run["status"] == "complete", run
    assert tool_server.count("slow_post") == 1, tool_server.invocations
    assert set(statuses) == {200}, statuses


@POSTGRES_ONLY
def test_a_refusal_never_names_a_run_that_is_not_stored(
    servers: Servers, database_url: str
) -> None:
    """While a turn's start write waits on its session row, a second request is refused
    naming no run (or a stored one): never the waiting turn's run, which may never be stored."""
    server = servers.start("server")
    session = "s-start-waits"
    with server.client() as client:
        ok(client.post("/v1/runs", json=run_body("echo", "first", session)))
    with SessionRowLock(database_url, session_id=session) as lock:
        waiting = Background(server.url, run_body("echo", "second", session))
        wait_for(lock.blocked, timeout=15, what="the start write waiting on the row")
        with server.client() as client:
            named = assert_busy(client.post("/v1/runs", json=run_body("echo", "third", session)))[
                "active_run_id"
            ]
            if named is not None:
                assert client.get(f"/v1/runs/{named}").status_code == 200, named
    answer = waiting.join(30)
    assert isinstance(answer, httpx.Response), answer
    assert ok(answer)["status"] == "complete"
