"""HEAD answers as GET would, without the body (RFC 9110 §9.3.2): load balancers probe
/healthz that way, and every GET route has a HEAD."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class HeadAsGet:
    """Serve a HEAD request as its GET, and send the headers only."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    # Positional: ASGI calls it so.
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:  # noqa: PLR0917
        """Pass a HEAD on as a GET, keeping the response's headers and dropping its body."""
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def headers_only(message: Message) -> None:
            if message["type"] == "http.response.body":
                if message.get("more_body", False):
                    return  # the rest of the body follows; only the last part ends the answer
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, headers_only)
