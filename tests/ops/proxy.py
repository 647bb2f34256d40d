"""A TCP relay the tests can cut and restore, to take a database away from a live server."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from types import TracebackType

from sqlalchemy.engine import make_url

_CHUNK = 65536


class TcpProxy:
    """Relays 127.0.0.1:<port> to `upstream`; `cut()` stops listening and drops every relay."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self._upstream = (upstream_host, upstream_port)
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self._stopping = threading.Event()
        self._stalled_until = 0.0
        self._end_late_s = 0.0
        self.port = 0

    def start(self) -> TcpProxy:
        """Listen (on the same port as before, after a cut) and relay every connection."""
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        listener.settimeout(0.05)  # so the accept loop notices a cut promptly
        self.port = listener.getsockname()[1]
        self._listener = listener
        self._stopping.clear()
        self._acceptor = threading.Thread(target=self._accept, name="tcp-proxy", daemon=True)
        self._acceptor.start()
        return self

    def cut(self) -> None:
        """Stop listening (new connections are refused) and close every relayed connection."""
        self._stopping.set()
        if self._acceptor is not None:
            self._acceptor.join(timeout=5)
            self._acceptor = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        with self._lock:
            dropped, self._sockets = self._sockets, set()
            threads, self._threads = self._threads, []
        for sock in dropped:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes the relay thread blocked in recv
            sock.close()
        for thread in threads:
            thread.join(timeout=5)

    def stall(self, seconds: float) -> None:
        """Hold what either side sends for `seconds`, then pass it on: a database that
        answers late, connections kept."""
        self._stalled_until = time.monotonic() + seconds

    def end_late(self, seconds: float) -> None:
        """From now on, pass a connection's end on to the other side `seconds` late: a client
        sees its server's end only after it has sent its next statement."""
        self._end_late_s = seconds

    def restore(self) -> None:
        """Listen again on the same port."""
        self.start()

    @property
    def connections(self) -> int:
        """Relayed connections open now (client and upstream side count as one)."""
        with self._lock:
            return len(self._sockets) // 2

    def _accept(self) -> None:
        listener = self._listener
        assert listener is not None
        while not self._stopping.is_set():
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            try:
                upstream = socket.create_connection(self._upstream, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                if self._stopping.is_set():
                    client.close()
                    upstream.close()
                    return
                self._sockets.update((client, upstream))
                for src, dst in ((client, upstream), (upstream, client)):
                    thread = threading.Thread(
                        target=self._relay, args=(src, dst), name="tcp-relay", daemon=True
                    )
                    self._threads.append(thread)
                    thread.start()

    def _relay(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(_CHUNK)
                if not data:
                    break
                if (held := self._stalled_until - time.monotonic()) > 0:
                    time.sleep(held)
                dst.sendall(data)
        except OSError:
            pass
        time.sleep(self._end_late_s)
        # One side ended: end both, like a dead network path would.
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        with self._lock:
            if src in self._sockets and dst in self._sockets:
                self._sockets.difference_update((src, dst))
                src.close()
                dst.close()

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cut()


@contextlib.contextmanager
def database_via_proxy(database_url: str) -> Iterator[tuple[TcpProxy, str]]:
    """A proxy to the database `database_url` names, and the URL that reaches it through it."""
    url = make_url(database_url)
    with TcpProxy(url.host or "127.0.0.1", url.port or 5432) as proxy:
        via_proxy = url.set(host="127.0.0.1", port=proxy.port)
        yield proxy, via_proxy.render_as_string(hide_password=False)
