"""Running one function in many threads at once, for race tests."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")


def run_threads(
    target: Callable[[T], object], args: Iterable[T], *, timeout_s: float | None = None
) -> None:
    """``target(arg)`` for each of ``args``, each in its own thread, all started before any
    is joined; returns when every thread has ended (or ``timeout_s`` passed for each)."""
    threads = [threading.Thread(target=target, args=(arg,)) for arg in args]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
