"""Loopback networking for tests and benchmarks: free ports, waiting for HTTP endpoints."""

from __future__ import annotations

import socket
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
