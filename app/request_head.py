"""The HTTP/1.1 protocol `agent-runner serve` speaks: uvicorn's, on httptools, with a request's
line and headers held to MAX_HEAD_BYTES.

httptools takes headers of any size, before the API key is asked for: a client without a key
had a replica read a 200 MB header whole. h11, uvicorn's other parser, bounds them, but lets
through what httptools refuses and closes on (a request with both Content-Length and
Transfer-Encoding, bare-LF line ends, folded headers: ways to smuggle a request past a proxy).
"""

from __future__ import annotations

from typing_extensions import override
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from app.api.problems import problem_response
from app.errors import HeadersTooLarge

# As h11 and most proxies bound them. A head is refused once more than this has arrived and it
# is still incomplete: one that ends in the read that passes the limit is taken, so a head can
# be larger by up to a read (asyncio reads 256 KiB at most).
MAX_HEAD_BYTES = 16 * 1024


class BoundedHeadProtocol(HttpToolsProtocol):
    """A request whose head is still incomplete past MAX_HEAD_BYTES is answered 431
    `headers_too_large` (problem+json), and its connection closed."""

    # Positional, as uvicorn builds its protocols (the type's own signature).
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._in_head = True  # until a request's headers are complete, and after its end
        self._head_bytes = 0
        self._ended = False  # a request's headers, or the request, in the data being read

    @override
    def data_received(self, data: bytes) -> None:
        self._ended = False
        super().data_received(data)
        # Data in which headers or a request ended may hold the next request's start,
        # uncounted: the count never takes a body's bytes for a head's.
        if not self._in_head or self._ended or self.transport.is_closing():
            return
        self._head_bytes += len(data)
        if self._head_bytes > MAX_HEAD_BYTES:
            self._refuse_head()

    @override
    def on_headers_complete(self) -> None:
        self._in_head, self._ended = False, True
        super().on_headers_complete()

    @override
    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head, self._head_bytes, self._ended = True, 0, True

    def _refuse_head(self) -> None:
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
