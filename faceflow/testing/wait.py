"""Polling a condition until it holds, for tests and benchmarks."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def poll(
    check: Callable[[], bool],
    timeout_s: float,
    *,
    step_s: float = 0.05,
    ignore: tuple[type[Exception], ...] = (),
) -> bool:
    """Call ``check`` every ``step_s`` until it returns True (then True) or ``timeout_s``
    has passed (then False). An exception of a type in ``ignore`` counts as "not yet"
    (a service that is still starting refuses connections)."""
    started = time.monotonic()
    while True:
        try:
            if check():
                return True
        except ignore:
            pass
        if time.monotonic() - started >= timeout_s:
            return False
        time.sleep(step_s)


def poll_value(
    get: Callable[[], T | None],
    timeout_s: float,
    *,
    step_s: float = 0.05,
    ignore: tuple[type[Exception], ...] = (),
) -> T | None:
    """``poll`` of a value: the first ``get()`` that is not None, or None once ``timeout_s``
    has passed."""
    found: list[T] = []

    def check() -> bool:
        value = get()
        if value is None:
            return False
        found.append(value)
        return True

    return found[0] if poll(check, timeout_s, step_s=step_s, ignore=ignore) else None


def wait_for(
    check: Callable[[], bool],
    timeout_s: float = 10.0,
    *,
    step_s: float = 0.05,
    what: str = "condition",
    ignore: tuple[type[Exception], ...] = (),
) -> float:
    """``poll`` that must succeed: the seconds waited, or ``TimeoutError`` naming ``what``."""
    started = time.monotonic()
    if not poll(check, timeout_s, step_s=step_s, ignore=ignore):
        raise TimeoutError(f"{what} not met within {timeout_s} s")
    return time.monotonic() - started
