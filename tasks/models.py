"""The lazy model cache: each model loads once per (model, device, providers) per process."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

T = TypeVar("T")

CacheKey = tuple[str, str, Hashable]
"""(model name, device, providers or other runtime options)."""


class ModelCache:
    """Process-wide cache of loaded models, with load counters and explicit ``clear()``."""

    def __init__(self) -> None:
        self._items: dict[CacheKey, Any] = {}
        self._lock = threading.RLock()
        self.loads: Counter[CacheKey] = Counter()

    def get(self, key: CacheKey, loader: Callable[[], T]) -> T:
        """The cached value for ``key``, calling ``loader`` once if it is not loaded yet."""
        with self._lock:
            if key not in self._items:
                self._items[key] = loader()
                self.loads[key] += 1
            return self._items[key]  # type: ignore[no-any-return]

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._items

    def keys(self) -> list[CacheKey]:
        """Keys of the models loaded now."""
        with self._lock:
            return list(self._items)

    def clear(self) -> None:
        """Drop every loaded model (load counters are kept)."""
        with self._lock:
            self._items.clear()

    def total_loads(self, model: str | None = None) -> int:
        """How many loads happened, for one model name or all."""
        with self._lock:
            return sum(n for k, n in self.loads.items() if model is None or k[0] == model)


MODEL_CACHE = ModelCache()
"""The cache every stage uses."""
