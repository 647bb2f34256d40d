"""`agent-runner serve`'s HTTP parser: a request's line and headers are held to 16 KiB (a
200 MB header had been read whole, with or without a key), and a request that could smuggle
another past a proxy is refused and its connection closed."""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tests.support.fake_anthropic import FakeAnthropic
from tests.support.polling import wait_for
from tests.support.server import AgentsServer, ServerProcess

KEY = "Bearer key-a"


@pytest.fixture
def server(agents_server: AgentsServer) -> Iterator[ServerProcess]:
    served = agents_server(database_url="memory://", env={"API_KEYS": "key-a:acme"})
    with served:
        yield served


@contextmanager
def _connection(server: ServerProcess) -> Iterator[socket.socket]:
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        yield sock


def _send_in_pieces(sock: socket.socket, data: bytes, *, piece: int) -> int:
    """Send `data` a piece at a time, each its own read for the server; how much was sent
    before the server stopped taking it."""
    sent = 0
    try:
        while sent < len(data):
            sock.sendall(data[sent : sent + piece])
            sent += min(piece, len(data) - sent)
            time.sleep(0.002)
    except (BrokenPipeError, ConnectionResetError):
        pass
    return sent


def _answers(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    answer = b""
    try:
        while chunk := sock.recv(65_536):
            answer += chunk
    except ConnectionResetError:
        pass
    return answer


def _post_head(*framing: str) -> bytes:
    """A keyed POST /v1/runs's head of JSON, with these header lines for its framing."""
    lines = ["POST /v1/runs HTTP/1.1", "Host: x", "Content-Type: application/json"]
    lines += [f"Authorization: {KEY}", *framing]
    return "\r\n".join(lines).encode() + b"\r\n\r\n"


def _request(header_bytes: int) -> bytes:
    return (
        b"GET /v1/agents HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        + f"Authorization: {KEY}\r\n".encode()
        + b"X-Big: "
        + b"a" * header_bytes
        + b"\r\n\r\n"
    )


def test_a_head_past_16_kib_is_refused_before_it_is_all_sent(server: ServerProcess) -> None:
    with _connection(server) as sock:
        sent = _send_in_pieces(sock, _request(64 * 2**20), piece=65_536)
        answer = _answers(sock)
    assert sent < 4 * 2**20, f"{sent} bytes of one header taken"
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 "), answer[:300]
    assert b"content-type: application/problem+json" in head.lower()
    assert json.loads(body)["code"] == "headers_too_large"
    assert "a request's head passed 16 KiB: answered 431" in server.logs()


@pytest.mark.parametrize(("header_bytes", "status"), [(15_000, b"200"), (20_000, b"431")])
def test_the_limit_is_16_kib_of_line_and_headers(
    server: ServerProcess, header_bytes: int, status: bytes
) -> None:
    # In pieces of 1 KiB, each read on its own: the limit applies, not the size of a read.
    with _connection(server) as sock:
        _send_in_pieces(sock, _request(header_bytes), piece=1024)
        answer = _answers(sock)
    assert answer.startswith(b"HTTP/1.1 " + status), answer[:300]


def test_a_request_with_both_content_length_and_transfer_encoding_is_refused(
    server: ServerProcess,
) -> None:
    # RFC 9112 §6.1: such a request may smuggle another past a proxy that reads its length
    # the other way; the server must close the connection after answering it.
    hidden = f"GET /v1/agents HTTP/1.1\r\nHost: x\r\nAuthorization: {KEY}\r\n\r\n".encode()
    body = b"0\r\n\r\n" + hidden
    request = (
        b"POST /healthz HTTP/1.1\r\nHost: x\r\n"
        + f"Content-Length: {len(body)}\r\n".encode()
        + b"Transfer-Encoding: chunked\r\n\r\n"
        + body
    )
    with _connection(server) as sock:
        sock.sendall(request)
        answer = _answers(sock)
    assert answer.startswith(b"HTTP/1.1 400 "), answer[:300]
    assert answer.count(b"HTTP/1.1 ") == 1, answer  # the hidden request was not served


def test_headers_under_the_limit_are_the_apps(server: ServerProcess) -> None:
    with server.client() as client:
        assert client.get("/v1/agents", headers={"X-Big": "a" * 8_000}).status_code == 401
        ok = client.get("/v1/agents", headers={"Authorization": KEY, "X-Big": "a" * 8_000})
        assert ok.status_code == 200, ok.text


def test_a_body_is_never_counted_as_a_head(server: ServerProcess) -> None:
    # The head, then a body of six 32 KiB reads: the bytes of the read in which the body
    # ended had been counted as the next head's, and the turn was answered 431 (it ran).
    size = 6 * 32_768
    frame = json.dumps({"agent": "echo", "message": ""}).encode()
    body = json.dumps({"agent": "echo", "message": "x" * (size - len(frame))}).encode()
    assert len(body) == size
    head = _post_head(f"Content-Length: {size}", "Connection: close")
    with _connection(server) as sock:
        sock.sendall(head)
        time.sleep(0.05)
        _send_in_pieces(sock, body, piece=32_768)
        answer = _answers(sock)
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]


def _turn(message: str) -> bytes:
    body = json.dumps({"agent": "echo", "message": message}).encode()
    return _post_head(f"Content-Length: {len(body)}") + body


AGENTS = f"GET /v1/agents HTTP/1.1\r\nHost: x\r\nAuthorization: {KEY}\r\n\r\n".encode()
BAD_CHUNK = _post_head("Transfer-Encoding: chunked") + b"zz\r\n"


@pytest.mark.parametrize(
    ("refused", "status"),
    [
        (_request(32 * 1024), b"431"),
        (b"GET /v1/agents HTTP/1.1\r\nHost: x\r\nNo colon here\r\n\r\n", b"400"),
        (AGENTS + BAD_CHUNK, b"400"),
    ],
    ids=["head-too-large", "unparsable", "unparsable-body-after-another"],
)
def test_a_request_refused_after_a_pipelined_one_is_answered_after_it(
    server: ServerProcess, fake_model: FakeAnthropic, refused: bytes, status: bytes
) -> None:
    # The refusal had been written while the turn before it ran, and the client took it for
    # that turn's answer (a body's, even after the head-refusals' fix). Now the answers come
    # in order, the refusal last, and the turn's answer is written to an open connection.
    fake_model.set_delay(1.5)
    with _connection(server) as sock:
        sock.sendall(_turn("first"))
        time.sleep(0.2)  # the turn runs
        _send_in_pieces(sock, refused, piece=1024)
        answer = _answers(sock)
    statuses = re.findall(rb"HTTP/1\.1 (\d{3}) ", answer)
    assert statuses == [b"200"] * refused.count(b"HTTP/1.1\r\n") + [status], answer
    assert answer.index(b"echo: first") < answer.index(b"HTTP/1.1 " + status + b" "), answer
    assert "Exception in ASGI application" not in server.logs()


def test_a_pipelining_client_that_goes_away_is_not_written_to(
    server: ServerProcess, fake_model: FakeAnthropic
) -> None:
    # uvicorn marked only the queued request as gone, and the running turn's answer was
    # written to the closed connection: an ERROR and a traceback per such client.
    fake_model.set_delay(1.0)
    with _connection(server) as sock:
        sock.sendall(_turn("gone") + AGENTS)
        time.sleep(0.2)  # the turn runs, the GET waits behind it
    wait_for(lambda: "/v1/runs" in server.logs(), timeout=15, what="the turn's access line")
    logs = server.logs()
    assert "Exception in ASGI application" not in logs, logs
    assert "unhandled error" not in logs, logs


def _chunked(trailer: bytes) -> bytes:
    body = json.dumps({"agent": "echo", "message": "chunked"}).encode()
    return (
        _post_head("Transfer-Encoding: chunked", "Connection: close")
        + f"{len(body):x}\r\n".encode()
        + body
        + b"\r\n0\r\n"
        + trailer
        + b"\r\n"
    )


def test_a_chunked_body_with_a_trailer_is_served(server: ServerProcess) -> None:
    with _connection(server) as sock:
        sock.sendall(_chunked(b"X-Checksum: 1234\r\n"))
        answer = _answers(sock)
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
    assert b"echo: chunked" in answer


def test_trailers_past_16_kib_close_the_connection(server: ServerProcess) -> None:
    # Trailers had been added to the request's headers without bound: 200 MB of them grew a
    # replica by as much, with or without a key.
    request = _chunked(b"X-Pad: " + b"a" * (64 * 2**20) + b"\r\n")
    with _connection(server) as sock:
        sent = _send_in_pieces(sock, request, piece=65_536)
    assert sent < 4 * 2**20, f"{sent} bytes of trailers taken"
    assert "chunked framing or trailers passed its data by 16 KiB" in server.logs()
    with server.client() as client:  # the server serves on
        assert client.get("/healthz").status_code == 200


def test_chunk_framing_past_the_data_by_16_kib_closes_the_connection(
    server: ServerProcess,
) -> None:
    # Each read brought a byte of data with 8 KiB of chunk extension, and the count of
    # framing began again at each: 171 MB of it was taken on one request.
    chunk = b"1;e=" + b"a" * 8192 + b"\r\n{\r\n"
    head = _post_head("Transfer-Encoding: chunked")
    with _connection(server) as sock:
        sock.sendall(head)
        time.sleep(0.05)
        sent = _send_in_pieces(sock, chunk * 2048, piece=len(chunk))
    assert sent < 2**20, f"{sent} bytes of chunk framing taken"
    assert "chunked framing or trailers passed its data by 16 KiB" in server.logs()


def test_a_body_in_small_chunks_is_served(server: ServerProcess) -> None:
    body = json.dumps({"agent": "echo", "message": "x" * 60_000}).encode()
    chunks = b"".join(
        f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
        for piece in (body[i : i + 64] for i in range(0, len(body), 64))
    )
    head = _post_head("Transfer-Encoding: chunked", "Connection: close")
    with _connection(server) as sock:
        sock.sendall(head)
        _send_in_pieces(sock, chunks + b"0\r\n\r\n", piece=4096)
        answer = _answers(sock)
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]


@pytest.fixture
def impatient(agents_server: AgentsServer) -> Iterator[ServerProcess]:
    env = {"API_KEYS": "key-a:acme", "REQUEST_HEAD_TIMEOUT_S": "1"}
    with agents_server(database_url="memory://", env=env) as served:
        yield served


def _closed_within(sock: socket.socket, *, seconds: float) -> bool:
    """Whether the server closes the connection within `seconds` (reading what it still
    sends of an answer)."""
    deadline = time.monotonic() + seconds
    try:
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            if sock.recv(65_536) == b"":
                return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True
    return False


def test_a_connection_that_sends_no_head_in_time_is_closed(impatient: ServerProcess) -> None:
    # Neither uvicorn nor the protocol had a head timeout: a client that sent nothing, or a
    # line of its head every few seconds, held its connection for as long as it liked.
    with _connection(impatient) as idle:
        assert _closed_within(idle, seconds=5)
    with _connection(impatient) as slow:
        started = time.monotonic()
        slow.sendall(b"GET /v1/agents HTTP/1.1\r\n")
        try:
            while time.monotonic() - started < 5:
                slow.sendall(b"X-Slow: 1\r\n")
                time.sleep(0.25)
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert _closed_within(slow, seconds=1)
    assert time.monotonic() - started < 4
    assert "a request's head was not complete within 1 s: connection closed" in impatient.logs()


def test_a_turn_longer_than_the_head_timeout_is_answered_and_the_connection_kept(
    impatient: ServerProcess, fake_model: FakeAnthropic
) -> None:
    # The timeout runs while a head is awaited, not while a request is answered.
    fake_model.set_delay(2.0)
    with _connection(impatient) as sock:
        sock.sendall(_turn("slow"))
        sock.settimeout(10)
        answer = b""
        while b"echo: slow" not in answer:
            answer += sock.recv(65_536)
        assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
        sock.sendall(AGENTS)
        assert sock.recv(65_536).startswith(b"HTTP/1.1 200 ")
        assert _closed_within(sock, seconds=5)  # and then, idle, it is closed
