"""HTTP tools: POST the validated input as JSON to a configured URL."""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Mapping
from http.cookiejar import CookieJar, DefaultCookiePolicy
from typing import Any

import httpx
from typing_extensions import override

from app.tools.base import (
    DEFAULT_MAX_RESULT_BYTES,
    ResultTooLarge,
    ToolContext,
    ToolFailed,
    ToolHandler,
)

log = logging.getLogger(__name__)

# How much of a response body an error message quotes; enough to diagnose, small enough for
# the model's context.
BODY_EXCERPT_CHARS = 500


# Failures that leave no doubt the request never reached the tool.
_NEVER_SENT = (httpx.ConnectError, httpx.UnsupportedProtocol, httpx.LocalProtocolError)


class SharedHttpClient:
    """One lazily created httpx.AsyncClient shared by every HTTP tool of a registry.

    Created on first use so that loading a registry (`serve` checks the agents file before
    it starts) opens no connection pool that nobody would close.
    """

    def __init__(self, *, max_body_bytes: int = DEFAULT_MAX_RESULT_BYTES) -> None:
        self._client: httpx.AsyncClient | None = None
        # How much of a response body is read: a result past it is kept truncated.
        self.max_body_bytes = max_body_bytes

    def get(self) -> httpx.AsyncClient:
        """The shared client, created on first call."""
        if self._client is None:
            # Redirects are not followed: a 3xx from a tool endpoint is a misconfiguration and
            # re-POSTing a side effect elsewhere is not ours to decide. No cap on connections:
            # a call waiting for one (httpx allows 100) spent its timeout_s in the queue and
            # was reported timed out, whether or not it was ever sent.
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=100)
            # Uncompressed answers only (a compressed one is not read: `_compressed`).
            self._client = httpx.AsyncClient(
                follow_redirects=False,
                limits=limits,
                headers={"Accept-Encoding": "identity"},
                # One client serves every tool, session and tenant: a cookie one call's answer
                # set would go with every later call to that host. The jar keeps none.
                cookies=CookieJar(policy=DefaultCookiePolicy(allowed_domains=[])),
            )
        return self._client

    async def aclose(self) -> None:
        """Close the client if it was ever created."""
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()


class HttpToolHandler(ToolHandler):
    """A ToolHandler that POSTs its arguments to `url` with the call's Idempotency-Key."""

    def __init__(
        self,
        url: str,
        *,
        client: SharedHttpClient,
        timeout_s: float,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.url = url
        # What error results name: its origin only. A URL's user:password, query and path
        # (a webhook's token) can be secrets, and error results reach the model and the store.
        parsed = httpx.URL(url)
        self.shown = f"{parsed.scheme}://{parsed.netloc.decode('ascii')}"
        self.timeout_s = timeout_s
        self.headers = dict(headers or {})
        self._client = client

    # Positional: the tool handler interface (README).
    @override
    async def __call__(self, arguments: dict[str, Any], ctx: ToolContext) -> Any:
        """POST `arguments`; return the 2xx JSON answer or raise ToolFailed."""
        headers = {**self.headers, "Idempotency-Key": ctx.idempotency_key}
        try:
            # httpx timeouts are per phase (connect, read, ...); asyncio.timeout bounds the
            # whole exchange so a slowly dripping server cannot hold the step for longer.
            async with (
                asyncio.timeout(self.timeout_s),
                self._client.get().stream(
                    "POST", self.url, json=arguments, headers=headers, timeout=self.timeout_s
                ) as response,
            ):
                encoding = response.headers.get("content-encoding", "").strip().lower()
                if encoding not in ("", "identity"):
                    raise self._compressed(response.status_code, encoding=encoding)
                body, whole = await _read(response, limit=self._client.max_body_bytes)
        except (TimeoutError, httpx.TimeoutException) as exc:
            raise ToolFailed(
                f"timed out after {self.timeout_s:g}s calling {self.shown}; it may or may not"
                " have taken effect"
            ) from exc
        except httpx.HTTPError as exc:
            detail = str(exc) or type(exc).__name__
            if not isinstance(exc, _NEVER_SENT):
                # Cut off after the request went out, in part or whole: the tool may have
                # acted on it, and the model must not take the error for "nothing happened".
                detail += "; it may or may not have taken effect"
            raise ToolFailed(f"request to {self.shown} failed: {detail}") from exc
        return self._result(response, body=body, whole=whole)

    def _compressed(self, status: int, *, encoding: str) -> ToolFailed:
        """An answer compressed though asked for identity: inflated, a small body could take
        far more memory than the result's limit, so it is not read."""
        accepted = 200 <= status < 300
        return ToolFailed(
            f"HTTP {status} from {self.shown} came compressed ({encoding[:40]}) though asked"
            " for identity, and was not read"
            + ("; the request was accepted, so it may have taken effect" if accepted else "")
        )

    def _result(self, response: httpx.Response, *, body: bytes, whole: bool) -> Any:
        status = response.status_code
        if not 200 <= status < 300:
            excerpt = _text(response, body=body)[:BODY_EXCERPT_CHARS]
            raise ToolFailed(f"HTTP {status} from {self.shown}: {excerpt}")
        if not whole:
            raise ResultTooLarge(_text(response, body=body))
        if not body.strip():
            # An empty 2xx (e.g. 204) means the call succeeded with nothing to say. Reporting it
            # as an error would invite the model to repeat a side effect that already happened.
            return None
        try:
            # Strict JSON only (no NaN or Infinity, nor a number past a float's range, which no
            # result can hold); a body nested too deep to parse is not JSON to us either.
            return json.loads(body, parse_constant=_not_json, parse_float=_finite)
        except (ValueError, RecursionError) as exc:
            excerpt = _text(response, body=body)[:BODY_EXCERPT_CHARS]
            raise ToolFailed(
                f"HTTP {status} from {self.shown} but the body is not JSON (the request was "
                f"accepted, so it may have taken effect): {excerpt}"
            ) from exc


def _text(response: httpx.Response, *, body: bytes) -> str:
    """The body as text, in its charset where that names a text encoding, else UTF-8."""
    try:
        return body.decode(response.encoding or "utf-8", errors="replace")
    except LookupError:  # e.g. `charset=rot13`: a codec, but not of bytes to text
        return body.decode("utf-8", errors="replace")


async def _read(response: httpx.Response, *, limit: int) -> tuple[bytes, bool]:
    """The body's first `limit` bytes, and whether that is all of it (the rest is not read:
    a tool answering a gigabyte takes no more of the runner's memory than the limit)."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.aiter_raw():  # as sent: never inflated (see `_compressed`)
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            return b"".join(chunks)[:limit], False
    return b"".join(chunks), True


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def _finite(number: str) -> float:
    """A JSON number as a float; one past a float's range (1e400) is refused, not inf."""
    value = float(number)
    if not math.isfinite(value):
        raise ValueError(f"{number[:40]} is out of range")
    return value
