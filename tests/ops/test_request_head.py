"""A request's line and headers are held to 16 KiB (h11's limit): a client, with or without
a key, cannot have the server take in more of them (a 200 MB header had been read whole)."""

from __future__ import annotations

import socket

from tests.support.server import AgentsServer

CHUNK = b"a" * 65_536


def _send_until_refused(port: int, *, head: bytes, most: int) -> tuple[int, bytes]:
    """Send `head`, then header bytes in chunks, up to `most` bytes: how many were sent
    before the server stopped taking them, and what it answered."""
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        try:
            sock.sendall(head)
            while sent < most:
                sock.sendall(CHUNK)
                sent += len(CHUNK)
            sock.sendall(b"\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = b""
        try:
            while chunk := sock.recv(65_536):
                answer += chunk
        except ConnectionResetError:
            pass
    return sent, answer


def test_a_request_head_past_16_kib_is_refused_before_it_is_all_sent(
    agents_server: AgentsServer,
) -> None:
    server = agents_server(database_url="memory://", env={"API_KEYS": "key-a:acme"})
    with server, server.client() as client:
        port = int(server.url.rsplit(":", 1)[1])
        head = b"GET /v1/agents HTTP/1.1\r\nHost: x\r\nX-Big: "
        sent, answer = _send_until_refused(port, head=head, most=64 * 2**20)
        assert sent < 4 * 2**20, f"{sent} bytes of one header taken"
        assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
        # Under the limit, headers are the app's: the key is asked for.
        assert client.get("/v1/agents", headers={"X-Big": "a" * 8_000}).status_code == 401
        ok = client.get("/v1/agents", headers={"Authorization": "Bearer key-a"})
        assert ok.status_code == 200, ok.text
