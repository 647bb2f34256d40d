"""Read request bodies before anything parses them: over 1 MiB is refused, and so is one
still arriving when shutdown begins."""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.problems import problem_response
from app.errors import PayloadTooLarge, ShuttingDown
from app.lifecycle import Lifecycle

MAX_BODY_BYTES = 1024 * 1024


class BodySizeLimit:
    """Buffers at most MAX_BODY_BYTES of a request body; more answers 413 payload_too_large.

    A body still arriving when shutdown begins is answered 503 shutting_down at once: its
    request has reached nothing yet, and a slow client would otherwise hold the shutdown
    for all of SHUTDOWN_GRACE_S, to be cut off then. A request whose body has arrived (every
    GET) is served as before."""

    def __init__(self, app: ASGIApp, *, lifecycle: Lifecycle, limit: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.lifecycle = lifecycle
        self.limit = limit

    # Positional: ASGI calls it so.
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:  # noqa: PLR0917
        """Read the whole body within the limit, then pass the request on with it."""
        if scope["type"] != "http":  # every method: a body is a body, even on GET or DELETE
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await problem_response(self._too_large())(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            try:
                with self.lifecycle.awaiting_body():
                    message = await receive()
            except asyncio.CancelledError:
                if not self.lifecycle.cancelled_by_shutdown():
                    raise
                cut_off = ShuttingDown(
                    "This replica is shutting down and read no more of this request (it"
                    " reached nothing); send it again, elsewhere."
                )
                await problem_response(cut_off)(scope, receive, send)
                return
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                await problem_response(self._too_large())(scope, receive, send)
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _too_large(self) -> PayloadTooLarge:
        return PayloadTooLarge(f"The request body is over {self.limit} bytes.")
