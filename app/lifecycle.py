"""The process's shutdown state, which the routes, `run` and the bench consult alike."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Lifecycle:
    """Process state the routes consult: `draining` once shutdown has begun (`drain`)."""

    draining: bool = False
    # Requests waiting for more of their body (BodySizeLimit): shutdown cancels the wait.
    _uploads: set[asyncio.Task[Any]] = field(default_factory=set, init=False, repr=False)
    # Set by a second signal: stop at once, steps in flight and all (`force`).
    _forced: asyncio.Event = field(default_factory=asyncio.Event, init=False, repr=False)

    def drain(self) -> None:
        """Shutdown begins. Called from a signal handler, on the event loop's thread: the
        waits are cancelled by the loop itself, as a signal handler must not touch tasks."""
        self.draining = True
        from_signal_handler(lambda: cancel_all(self._uploads))

    def force(self) -> None:
        """A second signal: shutdown no longer waits for the steps in flight (their calls'
        results are then lost, as at a crash). From a signal handler, as `drain`."""
        from_signal_handler(self._forced.set)

    async def unless_forced(self, wait: Callable[[], Awaitable[None]]) -> None:
        """Wait for `wait()`, or until a second signal."""
        waiting = asyncio.ensure_future(wait())
        forced = asyncio.ensure_future(self._forced.wait())
        try:
            await asyncio.wait({waiting, forced}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiting.cancel()
            forced.cancel()

    def cancelled_by_shutdown(self) -> bool:
        """Called on a CancelledError: whether shutdown caused it (uvicorn's cancel at the end
        of the grace, or `drain` cutting a wait for a body). If so the cancellation is taken
        back, so that the request can still be answered a 503 problem."""
        task = asyncio.current_task()
        if not self.draining or task is None:
            return False
        task.uncancel()
        return True

    @contextmanager
    def awaiting_body(self) -> Iterator[None]:
        """Around a wait for more of the request's body: shutdown cancels it."""
        task = asyncio.current_task()
        if task is None:
            yield
            return
        self._uploads.add(task)
        try:
            yield
        finally:
            self._uploads.discard(task)


def from_signal_handler(callback: Callable[[], object]) -> None:
    """Have the event loop run `callback` soon, as a signal handler must not touch tasks or
    events itself; nothing when no loop runs (then nothing waits)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return
    loop.call_soon_threadsafe(callback)


def cancel_all(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Cancel each of `tasks`."""
    for task in tasks:
        task.cancel()
