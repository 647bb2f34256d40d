"""Logging: one JSON object per line (or text), with the ids of the run being served.

The run service sets `run_id`, `session_id` and `agent`, and the runner `tool_call_id`, in
context variables; a filter copies them onto every record made while they are set, whichever
module logs.
Message contents and API keys are never put in log records, at any level (the traceback of
an unexpected error carries the exception's own text, which its code may have built from
its input).
"""

from __future__ import annotations

import asyncio
import logging
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from pythonjsonlogger.json import JsonFormatter
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from typing_extensions import override

CONTEXT_FIELDS = ("run_id", "session_id", "agent", "tool_call_id")
_context: dict[str, ContextVar[str | None]] = {
    name: ContextVar(name, default=None) for name in CONTEXT_FIELDS
}
access_log = logging.getLogger("app.access")


def bind(**values: str | None) -> None:
    """Set context fields for the rest of this task (and the tasks it starts)."""
    for name, value in values.items():
        _context[name].set(value)


@contextmanager
def bound(**values: str | None) -> Iterator[None]:
    """Set context fields for the block only."""
    tokens = [(_context[name], _context[name].set(value)) for name, value in values.items()]
    try:
        yield
    finally:
        for var, token in reversed(tokens):
            var.reset(token)


class ContextFilter(logging.Filter):
    """Adds the bound context fields to each record (and drops uvicorn's `color_message`,
    its message again with terminal colour codes, which a JSON line would carry)."""

    @override
    def filter(self, record: logging.LogRecord) -> bool:
        for name, var in _context.items():
            value = var.get()
            if value is not None and not hasattr(record, name):
                setattr(record, name, value)
        record.__dict__.pop("color_message", None)
        return True


# Characters that would start a line of their own, or reach the terminal as a command.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def _escaped(text: str) -> str:
    """`text` with control characters written as escapes (`\\n`, `\\x1b`)."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode(), text)


class TextFormatter(logging.Formatter):
    """`time level logger: message key=value ...` with the context fields, one line per
    record but for a traceback: what a client sent (a path, an agent name) cannot forge a
    line or colour the terminal."""

    @override
    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        extras = " ".join(
            f"{name}={getattr(record, name)}" for name in CONTEXT_FIELDS if hasattr(record, name)
        )
        return _escaped(f"{line} {extras}" if extras else line)


class GraceEndFilter(logging.Filter):
    """uvicorn logs the end of the shutdown grace with turns still running ("Cancel N running
    task(s), timeout graceful shutdown exceeded") as an ERROR. Here that is a planned stop
    (each turn finishes its step and is resumable), so a WARNING: alerts on ERROR lines
    would otherwise fire on a routine deploy."""

    @override
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.ERROR and str(record.msg).startswith("Cancel %s running"):
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def configure_logging(level: str, *, fmt: str) -> None:
    """Configure the root logger once, for the CLI."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(ContextFilter())
    if fmt == "json":
        handler.setFormatter(
            JsonFormatter(
                "{levelname}{name}{message}",
                style="{",
                timestamp="time",
                rename_fields={"levelname": "level", "name": "logger"},
            )
        )
    else:
        handler.setFormatter(TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Per-request lines of the HTTP clients would repeat every tool and model call at INFO;
    # uvicorn's access log is replaced by AccessLog below.
    for name in ("httpx", "httpx2", "uvicorn.access"):
        logging.getLogger(name).setLevel(logging.WARNING)
    uvicorn_errors = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, GraceEndFilter) for f in uvicorn_errors.filters):
        uvicorn_errors.addFilter(GraceEndFilter())
    # The anthropic SDK logs each request's options, messages included, at DEBUG: never
    # below INFO, so that no level logs what users wrote.
    logging.getLogger("anthropic").setLevel(max(root.level, logging.INFO))


CLIENT_CLOSED_REQUEST = 499
# A path is logged up to this many characters: any client may send one of 64 KiB, logged
# twice per line (message and field), with no key at all.
MAX_LOGGED_PATH = 512


def _logged_path(path: str) -> str:
    if len(path) <= MAX_LOGGED_PATH:
        return path
    return f"{path[:MAX_LOGGED_PATH]}…(+{len(path) - MAX_LOGGED_PATH} characters)"


class AccessLog:
    """One INFO line per request: method, path, status, duration. A request whose client
    went away before its answer started is logged 499 (nginx's "client closed request"),
    whatever the app answered into the closed connection."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    # Positional: ASGI calls it so.
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:  # noqa: PLR0917
        """Pass the request on and log its line when the answer has gone (or the client has)."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status: int | None = None
        gone = False  # before an answer started
        listener: asyncio.Task[None] | None = None

        async def capture(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        def note(message: Message) -> None:
            nonlocal gone
            gone = gone or (message["type"] == "http.disconnect" and status is None)

        async def listen() -> None:
            note(await receive())

        async def watch() -> Message:
            nonlocal listener
            message = await receive()
            note(message)
            if message["type"] == "http.request" and not message.get("more_body"):
                # The body is all in: what comes next is the client going away, which no
                # one else listens for while a turn runs.
                listener = asyncio.create_task(listen())
            return message

        try:
            await self.app(scope, watch, capture)
        finally:
            if listener is not None:
                listener.cancel()
            if gone:
                status = CLIENT_CLOSED_REQUEST
            elif status is None:
                status = 500  # no answer was started, and the client is there: ours to send
            _log_request(scope, status=status, start=start)


def _log_request(scope: Scope, *, status: int, start: float) -> None:
    path = _logged_path(scope["path"])
    extra: dict[str, Any] = {
        "method": scope["method"],
        "path": path,
        "status": status,
        "duration_ms": round((time.perf_counter() - start) * 1000, 2),
    }
    access_log.info(
        "%s %s %s %.1fms", scope["method"], path, status, extra["duration_ms"], extra=extra
    )
