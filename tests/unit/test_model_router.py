"""The router's API client built aside (`_BuiltAside`): built once on a worker thread, a
call cancelled while it waits leaves the build to the next, and a client never built is
never built to be closed."""

from __future__ import annotations

import asyncio
import threading

import pytest

from app.domain import Message
from app.llm.base import ModelRequest, ModelResponse
from app.llm.router import _BuiltAside

REQUEST = ModelRequest("claude-x", None, [Message.user("hi")], [], 100)


class _Client:
    """An LLMClient that answers at once, and says on which thread it was made."""

    def __init__(self) -> None:
        self.thread = threading.current_thread()
        self.closed = False

    async def complete(self, request: ModelRequest) -> ModelResponse:
        return ModelResponse(text=f"to {request.model}")

    async def aclose(self) -> None:
        self.closed = True


class _Builds:
    """A build that waits for `go`, counting its runs."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.made: list[_Client] = []

    def __call__(self) -> _Client:
        assert self.go.wait(10)
        self.made.append(_Client())
        return self.made[-1]


async def test_the_client_is_built_once_on_a_worker_thread_while_calls_wait() -> None:
    build = _Builds()
    aside = _BuiltAside(build, now=True)
    calls = [asyncio.create_task(aside.complete(REQUEST)) for _ in range(3)]
    await asyncio.sleep(0.05)
    assert not any(c.done() for c in calls)  # waiting for the build
    build.go.set()
    assert [(await c).text for c in calls] == ["to claude-x"] * 3
    assert len(build.made) == 1
    assert build.made[0].thread is not threading.current_thread()
    await aside.aclose()
    assert build.made[0].closed


async def test_a_call_cancelled_while_it_waits_leaves_the_build_to_the_next() -> None:
    build = _Builds()
    aside = _BuiltAside(build, now=True)
    first = asyncio.create_task(aside.complete(REQUEST))
    await asyncio.sleep(0.05)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    build.go.set()
    assert (await aside.complete(REQUEST)).text == "to claude-x"
    assert len(build.made) == 1


async def test_a_client_not_asked_for_is_built_at_its_first_call_and_only_then() -> None:
    build = _Builds()
    build.go.set()
    aside = _BuiltAside(build, now=False)
    await asyncio.sleep(0.05)
    assert build.made == []
    await aside.aclose()  # closing builds nothing
    assert build.made == []
    assert (await aside.complete(REQUEST)).text == "to claude-x"
    assert len(build.made) == 1
