"""``Recent``: the one time-to-live cache for values that are costly to look up and may be a
few seconds old (loaded block documents, the job store's service-time estimates).

A value is looked up (``get(key, look_up)``) when none is kept for its key or the one kept
is older than the TTL; a lookup that raises is not kept. Thread-safe: two threads that miss
at once may both look up (the later one's value is kept), which these lookups allow.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Recent(Generic[K, V]):
    """Values by key, each kept ``ttl_s()`` seconds after it was looked up (0: none kept)."""

    def __init__(
        self, ttl_s: Callable[[], float], *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.ttl_s, self.clock = ttl_s, clock
        self._values: dict[K, tuple[float, V]] = {}
        self._lock = threading.Lock()

    def get(self, key: K, look_up: Callable[[], V]) -> V:
        """The value kept for ``key`` while it is fresh, else ``look_up()`` (then kept)."""
        ttl, now = self.ttl_s(), self.clock()
        with self._lock:
            kept = self._values.get(key)
        if kept is not None and ttl > 0 and now - kept[0] < ttl:
            return kept[1]
        value = look_up()
        if ttl > 0:
            with self._lock:
                self._values[key] = (now, value)
        return value

    def clear(self) -> None:
        """Forget every value (the next ``get`` of each key looks it up)."""
        with self._lock:
            self._values.clear()
