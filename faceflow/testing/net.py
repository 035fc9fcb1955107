"""Loopback networking for tests and benchmarks: free ports, waiting for HTTP endpoints, a
TCP forwarder that can be cut and restored."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

import httpx

from faceflow.testing.wait import wait_for


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the caller binds it soon after)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def http_ok(url: str, timeout_s: float = 2.0) -> Callable[[], bool]:
    """A check: does a GET of ``url`` answer 200 now?"""

    def check() -> bool:
        return httpx.get(url, timeout=timeout_s).status_code == 200

    return check


def wait_http(
    url: str,
    timeout_s: float = 120.0,
    *,
    step_s: float = 0.25,
    alive: Callable[[], bool] | None = None,
) -> float:
    """Wait until a GET of ``url`` answers 200; the seconds waited. ``TimeoutError`` after
    ``timeout_s``; ``RuntimeError`` as soon as ``alive`` (the server's process still runs?)
    says False."""

    def check() -> bool:
        if alive is not None and not alive():
            raise RuntimeError(f"the server of {url} exited before it answered")
        return http_ok(url)()

    return wait_for(
        check, timeout_s, step_s=step_s, what=f"{url} answering 200", ignore=(httpx.HTTPError,)
    )


class TcpForwarder:
    """A loopback TCP forwarder that a test can cut and restore: it listens on
    127.0.0.1 (a free port, or ``port``) and relays every connection's bytes, both ways,
    to ``target``. ``cut()`` stops listening and closes every open connection (the peer
    sees a reset or an end, new connections are refused); ``restore()`` listens again on
    the same port. ``lose_next_answer(marker)``: the answer to the next request whose bytes
    hold ``marker`` never reaches its client (the request was served; the connection closes
    as its answer arrives). Use it as a context manager, or ``close()`` it in a ``finally``."""

    def __init__(self, target: tuple[str, int], port: int = 0) -> None:
        self.target = target
        self.port = port
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._lose: bytes | None = None  # marker of the request whose answer is lost
        self._losing: set[socket.socket] = set()  # upstream ends whose next answer is lost
        self._listener: socket.socket | None = None
        self._accepting: threading.Thread | None = None
        self.restore()

    @property
    def address(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)

    def restore(self) -> None:
        """Listen (again) on the forwarder's port."""
        if self._listener is not None:
            return
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        listener.settimeout(0.05)
        self.port = int(listener.getsockname()[1])
        self._listener = listener
        self._accepting = threading.Thread(
            target=self._accept, args=(listener,), name="tcp-forwarder", daemon=True
        )
        self._accepting.start()

    def cut(self) -> None:
        """Stop listening and close every open connection, both of its ends."""
        listener, self._listener = self._listener, None
        if self._accepting is not None:
            self._accepting.join(timeout=10)  # it sees the change within its accept timeout
            self._accepting = None
        if listener is not None:
            listener.close()
        with self._lock:
            open_sockets, self._open = self._open, set()
        for sock in open_sockets:
            _hang_up(sock)

    close = cut

    def lose_next_answer(self, marker: bytes) -> None:
        """Drop the answer to the next request whose bytes hold ``marker`` (once)."""
        with self._lock:
            self._lose = marker

    def __enter__(self) -> TcpForwarder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self, listener: socket.socket) -> None:
        while self._listener is listener:
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                _hang_up(client)
                continue
            upstream.settimeout(None)
            with self._lock:
                if self._listener is not listener:
                    _hang_up(client)
                    _hang_up(upstream)
                    return
                self._open.update((client, upstream))
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(
                    target=self._pipe, args=(source, sink), name="tcp-forwarder-pipe", daemon=True
                ).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        """Copy ``source`` to ``sink`` until either ends (or an answer is to be lost); then
        close both."""
        try:
            while data := source.recv(65536):
                with self._lock:
                    if source in self._losing:  # the answer arrived: the request was served
                        break
                    if self._lose is not None and self._lose in data:
                        self._lose = None
                        self._losing.add(sink)
                sink.sendall(data)
        except OSError:
            pass
        with self._lock:
            self._open.difference_update((source, sink))
            self._losing.difference_update((source, sink))
        _hang_up(source)
        _hang_up(sink)


def _hang_up(sock: socket.socket) -> None:
    """Shut ``sock`` down both ways (waking a thread blocked on it) and close it."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
