"""A real HTTP tool server for tests: counts every invocation, can hold one in flight.

Routes (all POST, JSON body = the tool input, as agent-runner's HTTP tools send it):
- `/get_issue`: a pure read, `safe_to_retry` in the test agents file.
- `/post_slack`: the side effect whose at-most-once execution the tests check.
- `/slow_post`: a side effect that blocks until `release()` (or its timeout), so a test can
  kill the runner while the handler is in flight.
- `/big_read`: a pure read answering BIG_READ_ROWS rows (about 1.3 MB of JSON).
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tests.support.threaded import ThreadedServer

BIG_READ_ROWS = [f"row {i:06d} of the big read" for i in range(50_000)]


@dataclass(frozen=True)
class Invocation:
    tool: str
    idempotency_key: str | None
    body: Any

    @property
    def tool_call_id(self) -> str:
        """The call id at the end of `<session or run>:<tool_call_id>`. The runner always sends
        the key: an invocation without one fails the test that counts calls by id, rather
        than being counted under an id of its own."""
        assert self.idempotency_key, f"{self.tool} was invoked without an Idempotency-Key"
        return self.idempotency_key.rsplit(":", 1)[-1]


class ToolServer(ThreadedServer):
    """Records invocations; `with ToolServer() as tools: tools.url + "/post_slack"`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._invocations: list[Invocation] = []
        self._released = threading.Event()
        self.in_flight = threading.Event()
        super().__init__(self._build(), name="tool-server")

    @property
    def invocations(self) -> list[Invocation]:
        """Every invocation so far, in arrival order (a snapshot)."""
        with self._lock:
            return list(self._invocations)

    def count(self, tool: str) -> int:
        """How many times `tool` was invoked."""
        return sum(1 for i in self.invocations if i.tool == tool)

    def per_call(self, tool: str) -> Counter[str]:
        """How many times each tool call id of `tool` was invoked."""
        return Counter(i.tool_call_id for i in self.invocations if i.tool == tool)

    def release(self) -> None:
        """Let held `/slow_post` handlers answer."""
        self._released.set()

    def reset(self) -> None:
        """Forget invocations and hold `/slow_post` again."""
        with self._lock:
            self._invocations.clear()
        self._released.clear()
        self.in_flight.clear()

    def stop(self) -> None:
        """Release held handlers, then stop serving."""
        self._released.set()
        super().stop()

    def _record(self, tool: str, request: Request, body: Any) -> int:
        with self._lock:
            self._invocations.append(Invocation(tool, request.headers.get("idempotency-key"), body))
            return sum(1 for i in self._invocations if i.tool == tool)

    def _build(self) -> Starlette:
        async def get_issue(request: Request) -> JSONResponse:
            body = await request.json()
            self._record("get_issue", request, body)
            return JSONResponse({"id": body.get("id"), "title": "Printer on fire", "state": "open"})

        async def post_slack(request: Request) -> JSONResponse:
            body = await request.json()
            n = self._record("post_slack", request, body)
            return JSONResponse({"ok": True, "ts": f"1700000000.{n:06d}"})

        async def slow_post(request: Request) -> JSONResponse:
            body = await request.json()
            self._record("slow_post", request, body)
            self.in_flight.set()
            await asyncio.to_thread(self._released.wait, 30)
            return JSONResponse({"ok": True})

        async def big_read(request: Request) -> JSONResponse:
            self._record("big_read", request, await request.json())
            return JSONResponse({"rows": BIG_READ_ROWS})

        return Starlette(
            routes=[
                Route("/big_read", big_read, methods=["POST"]),
                Route("/get_issue", get_issue, methods=["POST"]),
                Route("/post_slack", post_slack, methods=["POST"]),
                Route("/slow_post", slow_post, methods=["POST"]),
            ]
        )
