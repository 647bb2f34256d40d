"""A local fake of the Anthropic Messages API; tests point the real SDK at it.

Behaviour is picked by the request's `model` and derived only from the conversation, so a
crashed-and-resumed run gets consistent answers:

* `echo` (or any unknown name): final text `echo: <current user text>`.
* `plan:a,b;c`: step 1 calls tools a and b, step 2 calls c, then a final summary.
* `steps:<n>:<tool>`: n steps each calling <tool> once, then a final summary.
* `fail:<status>`: always that error (529 overloaded_error, 429 rate_limit_error, ...).
* `cutoff:<tool>`: a call of <tool> cut off by max_tokens (`stop_reason: "max_tokens"`);
  `cutoff:<tool>:<stop_reason>` with that stop reason instead.
* `stopped:<stop_reason>`: a text-only answer (no tool call) with that stop reason, its text
  `echo: <current user text>` cut short (`stopped:max_tokens`: an answer cut off midway).
* `unstorable:<plan>`: as `plan:<plan>`, with a NUL and a lone surrogate (neither storable
  as text) ending every text and every string of the tool inputs.
* `outsized:<plan>`: as `plan:<plan>`, with tool_use ids of 300 characters, one more call of
  a tool named with 100 characters (which no agent has), and 3,000,000,000 input tokens.
* `badid:<plan>`: as `plan:<plan>`, with tool_use ids the API would refuse back (`call:…`).
* `reuse:<plan>`: as `plan:<plan>`, with tool_use ids that depend only on the step and the
  call's place in it, so every turn of a session reuses the ids of the turn before.
* A request with `tool_choice: {"type": "none"}` is answered as `echo` is, whatever its model.

The summary is `done after N steps; errors: <names>; durability errors: <call ids>` (lists
joined by ","): N counts this turn's assistant messages; `errors` names the tools whose results
seen in this turn had `is_error`, `durability errors` the ids whose result is a
`tool-durability-error`. "This turn" starts at the last user message holding text, and includes
results merged into that message ahead of its text (repairs the model sees for the first time).

Run `python -m tests.support.fake_anthropic --port N` to serve from another process; drive it
with `GET /_requests`, `POST /_reset`, `POST /_fail_next` {count, status, error_type},
`POST /_delay` {seconds}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import socket
import threading
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app.serving import ThreadedServer
from tests.support.fake_anthropic_replies import scenario_reply
from tests.support.fake_anthropic_validation import InvalidRequest, validate

ERROR_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}
_ERROR_TEXT = {
    "overloaded_error": "Overloaded",
    "rate_limit_error": "Number of request tokens has exceeded your per-minute rate limit",
    "api_error": "Internal server error",
    "authentication_error": "invalid x-api-key",
}


class FakeState:
    """What the fake recorded and what it was told to do; shared with the server thread."""

    def __init__(self, *, retry_after_ms: int | None = 10) -> None:
        self.retry_after_ms = retry_after_ms
        self.closing = threading.Event()
        self._lock = threading.Lock()
        self._requests: list[Any] = []
        self._failures: list[tuple[int, str]] = []
        self._delay = 0.0
        self._generation = 0  # bumped by reset(): a request in flight across it gets no failure

    @property
    def requests(self) -> list[Any]:
        """A snapshot of every `POST /v1/messages` body received, oldest first."""
        with self._lock:
            return list(self._requests)

    @property
    def delay(self) -> float:
        """Seconds to wait before answering."""
        with self._lock:
            return self._delay

    def record(self, body: Any) -> int:
        """Keep one request body; returns the generation to pass to `take_failure`."""
        with self._lock:
            self._requests.append(body)
            return self._generation

    def reset(self) -> None:
        """Forget requests, pending failures and the delay."""
        with self._lock:
            self._requests.clear()
            self._failures.clear()
            self._delay = 0.0
            self._generation += 1

    def fail_next(self, count: int, status: int, error_type: str | None = None) -> None:
        """Answer the next `count` requests with this error (type derived from the status)."""
        kind = error_type or ERROR_TYPE_BY_STATUS.get(status, "api_error")
        with self._lock:
            self._failures.extend([(status, kind)] * count)

    def set_delay(self, seconds: float) -> None:
        """Sleep this long before each answer."""
        with self._lock:
            self._delay = seconds

    def take_failure(self, generation: int) -> tuple[int, str] | None:
        """The next scheduled failure, if any, for a request recorded in `generation`."""
        with self._lock:
            if generation != self._generation or not self._failures:
                return None
            return self._failures.pop(0)


def error_response(
    status: int, error_type: str, message: str, *, retry_after_ms: int | None = None
) -> JSONResponse:
    """An error in the real API's shape."""
    request_id = "req_" + secrets.token_hex(12)
    headers = {"request-id": request_id}
    # A short retry-after keeps SDK retries in tests fast; the SDK honours it over its backoff.
    if retry_after_ms and (status == 429 or status >= 500):
        headers["retry-after-ms"] = str(retry_after_ms)
    body = {"type": "error", "error": {"type": error_type, "message": message}}
    return JSONResponse({**body, "request_id": request_id}, status_code=status, headers=headers)


def build_app(state: FakeState) -> Starlette:
    """The Starlette app: `POST /v1/messages` plus the `/_...` control endpoints."""

    async def create_message(request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            body = None
        generation = state.record(body)
        await _wait(state)
        failure = state.take_failure(generation)
        if failure is not None:
            status, kind = failure
            text = _ERROR_TEXT.get(kind, f"fake {kind}")
            return error_response(status, kind, text, retry_after_ms=state.retry_after_ms)
        try:
            validate(body)
        except InvalidRequest as err:
            return error_response(400, "invalid_request_error", str(err))
        model: str = body["model"]
        if model.startswith("fail:"):
            status = int(model[5:]) if model[5:].isdigit() else 500
            kind = ERROR_TYPE_BY_STATUS.get(status, "api_error")
            text = _ERROR_TEXT.get(kind, f"fake {kind}")
            return error_response(status, kind, text, retry_after_ms=state.retry_after_ms)
        headers = {"request-id": "req_" + secrets.token_hex(12)}
        # JSON with \u escapes: a lone surrogate has no UTF-8 form, but the API may send one.
        reply = json.dumps(scenario_reply(body)).encode()
        return Response(reply, media_type="application/json", headers=headers)

    async def list_requests(request: Request) -> JSONResponse:
        return JSONResponse(state.requests)

    async def reset(request: Request) -> JSONResponse:
        state.reset()
        return JSONResponse({"ok": True})

    async def fail_next(request: Request) -> JSONResponse:
        spec = await request.json()
        state.fail_next(int(spec["count"]), int(spec["status"]), spec.get("error_type"))
        return JSONResponse({"ok": True})

    async def set_delay(request: Request) -> JSONResponse:
        state.set_delay(float((await request.json())["seconds"]))
        return JSONResponse({"ok": True})

    return Starlette(
        routes=[
            Route("/v1/messages", create_message, methods=["POST"]),
            Route("/_requests", list_requests, methods=["GET"]),
            Route("/_reset", reset, methods=["POST"]),
            Route("/_fail_next", fail_next, methods=["POST"]),
            Route("/_delay", set_delay, methods=["POST"]),
        ]
    )


async def _wait(state: FakeState) -> None:
    # Waiting on the `closing` event, not sleeping, so stopping never waits out a long delay.
    if state.delay > 0:
        await asyncio.to_thread(state.closing.wait, state.delay)


class FakeAnthropic(ThreadedServer):
    """The fake served from a background thread; `with FakeAnthropic() as fake: ... fake.url`."""

    def __init__(self, *, port: int = 0, retry_after_ms: int | None = 10) -> None:
        self._state = FakeState(retry_after_ms=retry_after_ms)
        super().__init__(build_app(self._state), name="fake-anthropic", port=port)

    @property
    def requests(self) -> list[Any]:
        """Every `POST /v1/messages` body received so far (a snapshot)."""
        return self._state.requests

    def reset(self) -> None:
        """Forget requests, pending failures and the delay."""
        self._state.reset()

    def fail_next(self, count: int, status: int, error_type: str | None = None) -> None:
        """Answer the next `count` requests with `status` (type derived from it if omitted)."""
        self._state.fail_next(count, status, error_type)

    def set_delay(self, seconds: float) -> None:
        """Sleep this long before answering each request."""
        self._state.set_delay(seconds)

    def stop(self) -> None:
        """Stop serving (a request waiting out a delay answers at once); safe to call twice."""
        self._state.closing.set()
        super().stop()


def main(argv: list[str] | None = None) -> None:
    """Serve the fake in this process until killed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--retry-after-ms", type=int, default=10)
    args = parser.parse_args(argv)
    sock = socket.socket()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # see app/serving.py
    sock.bind((args.host, args.port))  # --port 0: the kernel picks; the first line tells
    sock.listen(128)  # listening before the URL is printed: an early client queues, not fails
    print(f"fake anthropic on http://{args.host}:{sock.getsockname()[1]}", flush=True)
    config = uvicorn.Config(
        build_app(FakeState(retry_after_ms=args.retry_after_ms)),
        log_config=None,
        log_level="warning",
        access_log=False,
        lifespan="off",
    )
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()


if __name__ == "__main__":
    main()
