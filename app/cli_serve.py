"""How `agent-runner serve` serves: uvicorn, drained on the first stop signal."""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Iterator
from types import FrameType

import uvicorn
from typing_extensions import override

from app.errors import ConfigError
from app.lifecycle import Lifecycle, cancel_all, from_signal_handler

log = logging.getLogger(__name__)


def refuse_an_address_in_use(host: str, *, port: int) -> None:
    """ConfigError, in one line, if `serve` could not listen on host:port (taken by another
    process, not an address of this machine, a port below 1024 without the right). uvicorn
    binds only once the schema is upgraded and the services have started, and then exits 3
    with a log line. Each address the host names is bound here as asyncio will bind it,
    then let go."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        addresses = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        raise ConfigError(f"cannot serve on {where}: {exc.strerror or exc}") from None
    except UnicodeError as exc:  # a host name no lookup can take
        raise ConfigError(f"cannot serve on {where}: {exc}") from None
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                raise ConfigError(f"cannot serve on {where}: {exc.strerror or exc}") from None


class DrainingServer(uvicorn.Server):
    """uvicorn, but the first SIGTERM/SIGINT also tells the app to refuse new runs, and
    SIGHUP (the terminal went away) stops it as they do, unless it is ignored (nohup).

    uvicorn then stops listening, waits up to `timeout_graceful_shutdown` for requests in
    flight (runs finishing), and cancels what is left: a cancelled run finishes the tool-call
    step it is in (AgentRunner._step; the lifespan waits for it) and is resumable exactly as
    after a crash, because every step it finished is already committed. A second signal,
    in the grace or after it, cancels the requests and the steps in flight and exits.
    """

    def __init__(self, config: uvicorn.Config, *, lifecycle: Lifecycle) -> None:
        super().__init__(config)
        self._lifecycle = lifecycle

    @contextlib.contextmanager
    @override
    def capture_signals(self) -> Iterator[None]:
        # uvicorn puts the handlers it found back once it has shut down: ignored, so that a
        # signal arriving then (a supervisor's second SIGTERM) does not end the clean exit
        # as "killed by SIGTERM".
        main_thread = threading.current_thread() is threading.main_thread()
        hangup = main_thread and signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN
        if main_thread:
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_IGN)
        with super().capture_signals():
            if hangup:  # uvicorn itself handles only SIGINT and SIGTERM
                signal.signal(signal.SIGHUP, self.handle_exit)
            try:
                yield
            finally:
                if hangup:
                    signal.signal(signal.SIGHUP, signal.SIG_IGN)

    @override
    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await super().shutdown(sockets)
        # Forced in the grace, uvicorn leaves the app's shutdown out, and the app's resources
        # would close only as asyncio.run cancels it. Forced, that shutdown waits for nothing.
        # (`lifespan` is a LifespanOn: the config keeps uvicorn's lifespan="auto".)
        if self.force_exit and not self.lifespan.shutdown_event.is_set():
            await self.lifespan.shutdown()

    # Positional: uvicorn calls it so.
    @override
    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self._lifecycle.draining:
            log.info("shutting down: no new runs; waiting for runs in progress")
        else:
            log.warning("second signal: stopping now, tool calls in flight and all")
            self._lifecycle.force()
            # uvicorn's handle_exit (0.55) forces the exit so on a second SIGINT only: a
            # second SIGTERM in the grace would wait it out.
            self.force_exit = True
            # The requests in flight are cancelled, as at the grace's end (a run answers
            # 503), before the app's shutdown closes what they use. They are not waited for:
            # what they still do (a PostgreSQL unlock) races the closing, and asyncio.run
            # cancels what is left, as the process's end would.
            from_signal_handler(lambda: cancel_all(self.server_state.tasks))
        self._lifecycle.drain()
        super().handle_exit(sig, frame)
        # uvicorn re-raises caught signals after shutting down; a drained exit is a clean one (0).
        self._captured_signals.clear()
