"""The HTTP/1.1 protocol `agent-runner serve` speaks: uvicorn's, on httptools, with a request's
line and headers held to MAX_HEAD_BYTES.

httptools takes headers of any size, before the API key is asked for: a client without a key
had a replica read a 200 MB header whole. h11, uvicorn's other parser, bounds them, but lets
through what httptools refuses and closes on (a request with both Content-Length and
Transfer-Encoding, bare-LF line ends, folded headers: ways to smuggle a request past a proxy).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

from typing_extensions import override
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from app.api.problems import problem_response
from app.errors import HeadersTooLarge

log = logging.getLogger(__name__)

# As h11 and most proxies bound them. A head is refused once more than this has arrived and it
# is still incomplete: one that ends in the read that passes the limit is taken, so a head can
# be larger by up to a read (asyncio reads 256 KiB at most). A chunked body's framing and
# trailers, in reads without a body's bytes, are held to it too.
MAX_HEAD_BYTES = 16 * 1024


class BoundedHeadProtocol(HttpToolsProtocol):
    """A request whose head is still incomplete past MAX_HEAD_BYTES is answered 431
    `headers_too_large` (problem+json), once the responses to the requests before it on the
    connection are sent, and its connection closed; so is the parser's 400 for a request
    after them. A chunked body's trailers are dropped
    (ASGI has no place for them: httptools's protocol adds them to the headers the app
    already has), and a connection is closed once reads past MAX_HEAD_BYTES after a head brought
    none of a body's bytes (a chunked body's framing or trailers)."""

    # Positional, as uvicorn builds its protocols (the type's own signature).
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._in_head = True  # until a request's headers are complete, and after its end
        # Of the head being read, or after it of the reads without a body's bytes.
        self._head_bytes = 0
        self._body_read = False  # body bytes in the data being read
        self._ended = False  # a request's headers, or the request, in the data being read
        # A later request refused (its 431, the parser's 400): sent once the answers to
        # the requests before it are, reading stopped meanwhile.
        self._refusal: Callable[[], None] | None = None

    @override
    def data_received(self, data: bytes) -> None:
        if self._refusal is not None:  # read before reading paused
            return
        self._ended = self._body_read = False
        super().data_received(data)
        # Data in which headers or a request ended may hold the next request's start,
        # uncounted: the count never takes a body's bytes for a head's.
        if self._ended or self.transport.is_closing():
            return
        if self._in_head:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._refuse_head()
        elif self._body_read:
            self._head_bytes = 0
        else:  # a chunked body's framing or trailers (httptools holds a trailer whole)
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                log.warning(
                    "a request's chunked framing or trailers passed %d KiB: connection closed",
                    MAX_HEAD_BYTES // 1024,
                )
                self.transport.close()

    @override
    def on_header(self, name: bytes, value: bytes) -> None:
        if self._in_head:  # not a trailer: the app has the headers already
            super().on_header(name, value)

    @override
    def on_body(self, body: bytes) -> None:
        self._body_read = True
        super().on_body(body)

    @override
    def on_headers_complete(self) -> None:
        self._in_head, self._head_bytes, self._ended = False, 0, True
        super().on_headers_complete()

    @override
    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head, self._head_bytes, self._ended = True, 0, True

    @override
    def on_response_complete(self) -> None:
        last = not self.pipeline  # the response just before the refused head's
        super().on_response_complete()  # which reads on, or starts a pipelined request
        if self._refusal is None or self.transport.is_closing():
            return
        if last:
            self._refusal()
        else:
            self.flow.pause_reading()  # nothing more of the refused head

    @override
    def send_400_response(self, msg: str) -> None:
        if not self._in_head:  # within the request being answered: at once, as uvicorn does
            super().send_400_response(msg)
            return
        self._refuse(partial(super().send_400_response, msg))

    def _refuse_head(self) -> None:
        log.warning("a request's head passed %d KiB: answered 431", MAX_HEAD_BYTES // 1024)
        self._refuse(self._send_refusal)

    def _refuse(self, send: Callable[[], None]) -> None:
        """Read no more of the connection, and `send` the refusal of the request being read
        at once or, while an earlier request's response is not all sent, once it is (a
        pipelining client reads answers in order)."""
        self._refusal = send
        self.flow.pause_reading()
        if self.cycle is None or self.cycle.response_complete:
            send()

    def _send_refusal(self) -> None:
        response = problem_response(
            HeadersTooLarge(
                f"The request line and headers are over {MAX_HEAD_BYTES // 1024} KiB together."
            )
        )
        head = [
            b"HTTP/1.1 431 Request Header Fields Too Large",
            f"content-type: {response.media_type}".encode(),
            f"content-length: {len(response.body)}".encode(),
            b"connection: close",
        ]
        self.transport.write(b"\r\n".join(head) + b"\r\n\r\n" + bytes(response.body))
        self.transport.close()
