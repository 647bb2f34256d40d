"""SIGTERM: no new runs; runs in progress get SHUTDOWN_GRACE_S to finish; then the process exits.

What the grace period cuts off is resumable exactly as after a crash, with no call's result
lost: a tool-call step in flight finishes first.
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.ops.helpers import model_saw
from tests.support.agents import write_agents_file
from tests.support.fake_anthropic import FakeAnthropic
from tests.support.polling import wait_for
from tests.support.server import AgentsServer, ServerProcess
from tests.support.tool_server import ToolServer

SLOW_TURN = {"agent": "slow", "message": "post it slowly"}


def _post(server: ServerProcess, body: dict[str, str], headers: dict[str, str]) -> httpx.Response:
    with server.client(timeout=60) as client:
        return client.post("/v1/runs", json=body, headers=headers)


def _start_slow_run(
    pool: ThreadPoolExecutor,
    server: ServerProcess,
    tool_server: ToolServer,
    body: dict[str, str],
    headers: dict[str, str] | None = None,
) -> Future[httpx.Response]:
    """POST a run of the `slow` agent and return once its slow_post handler is in flight."""
    future = pool.submit(_post, server, body, headers or {})
    wait_for(tool_server.in_flight.is_set, timeout=20, what="slow_post in flight")
    return future


def _draining(server: ServerProcess) -> bool:
    """Whether the server has taken the SIGTERM in: /readyz says so, or nothing listens."""
    try:
        with server.client(timeout=5) as client:
            return client.get("/readyz").status_code == 503
    except httpx.TransportError:
        return True


def _sigterm(server: ServerProcess) -> float:
    assert server.process is not None
    server.process.send_signal(signal.SIGTERM)
    return time.monotonic()


@pytest.mark.parametrize(
    "backend", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)
# SIGHUP (the terminal of `make run` closed) stops the server as SIGTERM does: uvicorn
# alone died of it at once, the step in flight lost as at a crash.
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_sigterm_refuses_new_runs_and_lets_the_run_in_flight_finish(
    database_url: str,
    tmp_path: Path,
    fake_model: FakeAnthropic,
    tool_server: ToolServer,
    agents_server: AgentsServer,
    stop: signal.Signals,
) -> None:
    server = agents_server(database_url=database_url, env={"SHUTDOWN_GRACE_S": "10"}).start()
    try:
        with ThreadPoolExecutor(max_workers=1) as pool:
            in_flight = _start_slow_run(pool, server, tool_server, {**SLOW_TURN, "session_id": "s"})
            assert server.process is not None
            server.process.send_signal(stop)
            wait_for(lambda: _draining(server), timeout=20, what="the server draining")

            marker = "after-sigterm-7f3c"
            try:
                late = _post(server, {"agent": "echo", "message": marker, "session_id": "t"}, {})
            except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
                # Not listening any more: refused, or reset while still in the listen queue
                # as the socket closed; either way unanswered, as it should be.
                pass
            else:
                assert late.status_code == 503, late.text
                assert late.headers["content-type"].startswith("application/problem+json")
                assert late.json()["code"] == "shutting_down"
            assert not model_saw(fake_model.requests, marker), "a run started after SIGTERM"

            assert server.process is not None and server.process.poll() is None
            tool_server.release()
            answer = in_flight.result(timeout=20)
        assert answer.status_code == 200, answer.text
        assert answer.json()["status"] == "complete"
        assert tool_server.count("slow_post") == 1
        assert server.process.wait(timeout=10) == 0, server.logs()
    finally:
        server.kill()


def _resumed(
    database_url: str, tmp_path: Path, agents: Path, fake_model: FakeAnthropic, turn: dict[str, str]
) -> tuple[dict[str, object], list[dict[str, object]]]:
    """Resubmit the keyed turn on a new server: the session's status before, and its history
    after the resumed turn completed."""
    with (
        ServerProcess(
            database_url=database_url,
            log_path=tmp_path / "second.log",
            agents_file=agents,
            model_url=fake_model.url,
        ) as second,
        second.client() as client,
    ):
        session = client.get(f"/v1/sessions/{turn['session_id']}")
        assert session.status_code == 200, session.text
        resumed = client.post("/v1/runs", json=turn, headers={"Idempotency-Key": "turn-1"})
        assert resumed.status_code == 200, resumed.text
        assert resumed.json()["status"] == "complete", resumed.json()
        messages = client.get(f"/v1/sessions/{turn['session_id']}/messages").json()["data"]
    assert sum(1 for m in messages if m["role"] == "user") == 1
    return session.json(), messages


def _first_server(
    database_url: str, tmp_path: Path, agents: Path, fake_model: FakeAnthropic, *, grace_s: str
) -> ServerProcess:
    """The server a SIGTERM will stop, started, its SHUTDOWN_GRACE_S `grace_s`."""
    return ServerProcess(
        database_url=database_url,
        log_path=tmp_path / "first.log",
        agents_file=agents,
        model_url=fake_model.url,
        env={"SHUTDOWN_GRACE_S": grace_s},
    ).start()


def _assert_cut_off(answer: httpx.Response) -> None:
    """The client is told, as a problem, that the run was cut off and how to resume it."""
    assert answer.status_code == 503, answer.text
    assert answer.headers["content-type"].startswith("application/problem+json")
    assert answer.json()["code"] == "shutting_down"
    assert "resume" in answer.json()["detail"]
    assert answer.headers["retry-after"]


def test_sigterm_lets_a_step_in_flight_at_the_end_of_the_grace_finish_and_then_stops_the_run(
    database_url: str,
    tmp_path: Path,
    fake_model: FakeAnthropic,
    tool_server: ToolServer,
) -> None:
    # The grace ends while a side-effecting call runs. Cut off there, its result was lost:
    # the resumed turn got §2's durability error for a post that had been made. Now the
    # step finishes (its calls, then write #2) and the run stops after it, nothing lost.
    agents = write_agents_file(tmp_path, tool_server.url)
    turn = {**SLOW_TURN, "session_id": "cut-off"}
    first = _first_server(database_url, tmp_path, agents, fake_model, grace_s="1.5")
    try:
        with ThreadPoolExecutor(max_workers=1) as pool:
            cut_off = _start_slow_run(pool, first, tool_server, turn, {"Idempotency-Key": "turn-1"})
            _sigterm(first)
            assert first.process is not None
            wait_for(
                lambda: "waiting for its step" in first.logs(),
                timeout=20,
                what="the grace's end",
            )
            time.sleep(1)  # past the grace, the step's call still runs, and holds the exit
            assert first.process.poll() is None, first.logs()
            assert not cut_off.done()
            tool_server.release()
            _assert_cut_off(cut_off.result(timeout=10))
            assert first.process.wait(timeout=10) == 0, first.logs()
        assert "turn cut off: waiting for its step" in first.logs()
        # Its session given back before the lock connection closed, not lost with it.
        assert "ownership connection lost" not in first.logs()
        # A planned stop: no ERROR line (uvicorn's "Cancel 1 running task(s)" is a WARNING).
        assert '"level": "ERROR"' not in first.logs(), first.logs()
        assert "Cancel 1 running task(s)" in first.logs()
    finally:
        first.kill()
        tool_server.release()

    session, messages = _resumed(database_url, tmp_path, agents, fake_model, turn)
    assert session["status"] == "idle"  # every call has its result
    assert tool_server.count("slow_post") == 1
    (result,) = [m for m in messages if m["role"] == "tool" and m["tool_name"] == "slow_post"]
    assert "tool-durability-error" not in str(result["content"])
    assert not result["is_error"]


# The second signal comes while the grace still runs (uvicorn is waiting for the requests in
# flight), or after it (the turn was cancelled and waits for its step).
@pytest.mark.parametrize("when", ["in-the-grace", "after-the-grace"])
def test_a_second_sigterm_stops_at_once_though_a_step_is_in_flight(
    database_url: str,
    tmp_path: Path,
    fake_model: FakeAnthropic,
    tool_server: ToolServer,
    when: str,
) -> None:
    # The operator's way out of a step that takes long (the first SIGTERM waits for it): its
    # call in flight is then cut off, as at a crash, and gets §2's error on resume.
    agents = write_agents_file(tmp_path, tool_server.url)
    turn = {**SLOW_TURN, "session_id": "forced"}
    grace_s = "60" if when == "in-the-grace" else "1"
    first = _first_server(database_url, tmp_path, agents, fake_model, grace_s=grace_s)
    try:
        with ThreadPoolExecutor(max_workers=1) as pool:
            cut_off = _start_slow_run(pool, first, tool_server, turn, {"Idempotency-Key": "turn-1"})
            _sigterm(first)
            assert first.process is not None
            if when == "in-the-grace":
                wait_for(lambda: _draining(first), timeout=20, what="the server draining")
            else:
                wait_for(
                    lambda: "waiting for its step" in first.logs(),
                    timeout=20,
                    what="the grace's end",
                )
            again = _sigterm(first)
            assert first.process.wait(timeout=10) == 0, first.logs()
            assert time.monotonic() - again < 5
            assert "second signal: stopping now" in first.logs()
            assert '"level": "ERROR"' not in first.logs()
            with contextlib.suppress(httpx.TransportError):
                cut_off.result(timeout=10)  # answered 503, or its connection closed
    finally:
        first.kill()
        tool_server.release()  # the held handler answers nobody now

    session, messages = _resumed(database_url, tmp_path, agents, fake_model, turn)
    assert session["status"] == "needs_resume"
    assert tool_server.count("slow_post") == 1
    (result,) = [m for m in messages if m["role"] == "tool" and m["tool_name"] == "slow_post"]
    assert "tool-durability-error" in str(result["content"])


@pytest.mark.parametrize("stop", ["grace-end", "second-signal-in-the-grace"])
def test_a_run_in_a_model_call_is_cut_off_at_the_grace_end_or_a_second_signal(
    database_url: str,
    tmp_path: Path,
    fake_model: FakeAnthropic,
    tool_server: ToolServer,
    stop: str,
) -> None:
    # A model call has no side effect: the run stops there at once, and the resumed turn
    # goes on from what was stored. Not waited for, the call must not fail as its client
    # closes: that would end the run `failed` (a second signal in the grace made it a 500).
    agents = write_agents_file(tmp_path, tool_server.url)
    turn = {"agent": "echo", "message": "say it slowly", "session_id": "cut-in-model"}
    grace_s = "1.5" if stop == "grace-end" else "60"
    first = _first_server(database_url, tmp_path, agents, fake_model, grace_s=grace_s)
    fake_model.set_delay(30)
    try:
        with ThreadPoolExecutor(max_workers=1) as pool:
            cut_off = pool.submit(_post, first, turn, {"Idempotency-Key": "turn-1"})
            wait_for(lambda: len(fake_model.requests) >= 1, timeout=20, what="the model call")
            sent = _sigterm(first)
            if stop != "grace-end":
                wait_for(lambda: _draining(first), timeout=20, what="the server draining")
                sent = _sigterm(first)
            assert first.process is not None
            assert first.process.wait(timeout=10) == 0, first.logs()
            took = time.monotonic() - sent
            if stop == "grace-end":
                # The whole grace, fraction included (it was cut to whole seconds).
                assert 1.5 <= took < 5.5, f"the process took {took:.1f}s with SHUTDOWN_GRACE_S=1.5"
            else:
                assert took < 5, f"the process took {took:.1f}s after the second signal"
            _assert_cut_off(cut_off.result(timeout=10))
            assert '"level": "ERROR"' not in first.logs()
    finally:
        first.kill()
        fake_model.set_delay(0)

    session, messages = _resumed(database_url, tmp_path, agents, fake_model, turn)
    assert session["status"] == "idle"
    assert [m["role"] for m in messages] == ["user", "assistant"]


def test_signals_that_keep_coming_still_end_in_a_clean_exit(
    database_url: str, agents_server: AgentsServer
) -> None:
    # A supervisor that sends SIGTERM again and again: one that landed after the shutdown
    # had finished (uvicorn had put the default handler back) ended the exiting process as
    # "killed by SIGTERM" (-15).
    server = agents_server(database_url=database_url).start()
    assert server.process is not None
    try:
        _sigterm(server)
        deadline = time.monotonic() + 30
        while server.process.poll() is None and time.monotonic() < deadline:
            server.process.send_signal(signal.SIGTERM)
            time.sleep(0.002)
        assert server.process.wait(timeout=5) == 0, server.logs()
    finally:
        server.kill()


def test_sigterm_answers_a_body_still_arriving_at_once(
    tmp_path: Path, agents_server: AgentsServer
) -> None:
    # A client sending its body slowly held the shutdown for all of SHUTDOWN_GRACE_S, and was
    # then cut off with a 500 and a traceback in the log; its request had reached nothing.
    server = agents_server(
        database_url=f"sqlite:///{tmp_path / 'slow-body.db'}", env={"SHUTDOWN_GRACE_S": "30"}
    ).start()
    uploads: list[socket.socket] = []
    try:
        # Any route, any method: a body is a body.
        for request_line in (b"POST /v1/runs", b"GET /healthz", b"DELETE /v1/sessions/s"):
            upload = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            upload.sendall(
                request_line + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 100\r\n\r\n{"ag'
            )
            uploads.append(upload)
        # A connection made after these is answered only once the server has read their
        # heads: each connection's bytes are parsed as they arrive, in order.
        with server.client() as client:
            assert client.get("/healthz").status_code == 200
        sent = _sigterm(server)
        answers = [_read_until_closed(upload) for upload in uploads]
        assert server.process is not None and server.process.wait(timeout=15) == 0, server.logs()
        took = time.monotonic() - sent
    finally:
        for upload in uploads:
            upload.close()
        server.kill()

    assert took < 10, f"the shutdown took {took:.1f}s for uploads that reached nothing"
    for answer in answers:
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503"), answer
        problem = json.loads(body)
        assert problem["code"] == "shutting_down"
        assert "read no more of this request" in problem["detail"], problem
    assert "Traceback" not in server.logs(), server.logs()


def _read_until_closed(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)
