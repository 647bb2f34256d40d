"""The HTTP/1.1 protocol `agent-runner serve` speaks: uvicorn's, on httptools, with a request's
line and headers held to MAX_HEAD_BYTES.

httptools takes headers of any size, before the API key is asked for: a client without a key
had a replica read a 200 MB header whole. h11, uvicorn's other parser, bounds them, but lets
through what httptools refuses and closes on (a request with both Content-Length and
Transfer-Encoding, bare-LF line ends, folded headers: ways to smuggle a request past a proxy).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from functools import partial
from typing import cast

from typing_extensions import override
from uvicorn._types import ASGI3Application
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from app.api.problems import problem_response
from app.errors import HeadersTooLarge
from app.settings import Settings

log = logging.getLogger(__name__)

# As h11 and most proxies bound them. A head is refused once more than this has arrived and it
# is still incomplete: the reads in which a request ended and in which a head ended are not
# counted (they may hold a body's bytes), so a head can be larger by up to two reads (asyncio
# reads 256 KiB at most). A chunked body's framing and trailers are held to it too, beyond the
# size of the body's data.
MAX_HEAD_BYTES = 16 * 1024


class BoundedHeadProtocol(HttpToolsProtocol):
    """A request whose head is still incomplete past MAX_HEAD_BYTES is answered 431
    `headers_too_large` (problem+json), once the responses to the requests before it on the
    connection are sent, and its connection closed; so is the parser's 400 for a request
    after them. A chunked body's trailers are dropped
    (ASGI has no place for them: httptools's protocol adds them to the headers the app
    already has), and a connection is closed once a request's chunk framing and trailers
    pass its body's data by MAX_HEAD_BYTES, or a head is not complete within `head_timeout_s`
    of the connection's opening or of its last answer."""

    # A client that trickled a head, or sent nothing, held its connection for good.
    head_timeout_s: float = Settings.model_fields["request_head_timeout_s"].default

    @classmethod
    def with_head_timeout(cls, head_timeout_s: float) -> type[BoundedHeadProtocol]:
        """The protocol with this head timeout (uvicorn takes a protocol as a class)."""
        return cast(
            "type[BoundedHeadProtocol]",
            type(cls.__name__, (cls,), {"head_timeout_s": head_timeout_s}),
        )

    # Positional, as uvicorn builds its protocols (the type's own signature).
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._in_head = True  # until a request's headers are complete, and after its end
        # Of the head being read, or after it of the reads that were not a body's data.
        self._head_bytes = 0
        self._read_body = 0  # body bytes in the data being read
        self._request_body = 0  # body bytes of the request being read
        self._ended = False  # a request's headers, or the request, in the data being read
        self._head_begun = False  # a request's first bytes came, its head's end not yet
        # A later request refused (its 431, the parser's 400): sent once the answers to
        # the requests before it are, reading stopped meanwhile.
        self._refusal: Callable[[], None] | None = None
        # The request whose app runs: uvicorn marks only the newest (a queued one) as
        # disconnected when the connection is lost, and the running one wrote on.
        self._running: RequestResponseCycle | None = None
        self._head_timer: asyncio.TimerHandle | None = None

    @override
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_head()

    @override
    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        running = self._running
        super().connection_lost(exc)
        if running is not None and running is not self.cycle and not running.response_complete:
            running.disconnected = True
            running.message_event.set()

    @override
    def data_received(self, data: bytes) -> None:
        if self._refusal is not None:  # read before reading paused
            return
        self._ended = False
        self._read_body = 0
        super().data_received(data)
        # Data in which headers or a request ended may hold the next request's start,
        # uncounted: the count never takes a body's bytes for a head's.
        if self._ended or self.transport.is_closing():
            return
        if self._in_head:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._refuse_head()
            return
        # A chunked body's framing or trailers (httptools holds a trailer whole).
        self._head_bytes += len(data) - self._read_body
        if self._head_bytes > MAX_HEAD_BYTES + self._request_body:
            log.warning(
                "a request's chunked framing or trailers passed its data by %d KiB:"
                " connection closed",
                MAX_HEAD_BYTES // 1024,
            )
            self.transport.close()

    @override
    def on_message_begin(self) -> None:
        self._head_begun = True
        super().on_message_begin()

    @override
    def on_header(self, name: bytes, value: bytes) -> None:
        if self._in_head:  # not a trailer: the app has the headers already
            super().on_header(name, value)

    @override
    def on_body(self, body: bytes) -> None:
        self._read_body += len(body)
        self._request_body += len(body)
        super().on_body(body)

    @override
    def on_headers_complete(self) -> None:
        self._stop_head_timer()
        self._head_begun = False
        self._in_head, self._head_bytes, self._request_body, self._ended = False, 0, 0, True
        super().on_headers_complete()

    @override
    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head, self._head_bytes, self._ended = True, 0, True

    @override
    def _start_asgi_task(self, cycle: RequestResponseCycle, app: ASGI3Application) -> None:
        self._running = cycle
        super()._start_asgi_task(cycle, app)

    @override
    def on_response_complete(self) -> None:
        last = not self.pipeline  # nothing queued: a head, or the refused one's answer, is next
        super().on_response_complete()  # which reads on, or starts a pipelined request
        if self.transport.is_closing():
            return
        if self._refusal is None:
            if last:
                self._await_head()
        elif last:
            self._refusal()
        else:
            self.flow.pause_reading()  # nothing more of the refused head

    @override
    def send_400_response(self, msg: str) -> None:
        queued = bool(self.pipeline) and self.pipeline[0][0] is self.cycle
        if not self._in_head and not queued:  # the request being answered: at once, as
            super().send_400_response(msg)  # uvicorn does
            return
        if queued:  # a pipelined request's body could not be read: it never runs
            self.pipeline.popleft()
        self._refuse(partial(super().send_400_response, msg))

    def _await_head(self) -> None:
        """A head is awaited: close the connection if none is complete in time."""
        self._stop_head_timer()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self._refusal is not None:
            return
        if self._head_begun:
            log.warning(
                "a request's head was not complete within %g s: connection closed",
                self.head_timeout_s,
            )
        self.transport.close()

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
