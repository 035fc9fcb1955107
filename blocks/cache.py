"""A per-process cache of loaded block documents, so a warm worker does not reload them per run.

Every ``fuse-faces`` run needs its settings block and its storage block (twice: load and
store). Loading one is a Prefect API round trip plus validation (≈ 15-35 ms each on a
2-core machine), paid on every run by a warm child that runs many. ``load_block`` keeps
each document, keyed by its name (``"<block-type-slug>/<name>"``), for
``FACEFLOW_BLOCK_CACHE_TTL_S`` seconds (default 30; 0 turns caching off). Entries are
per Prefect API URL, so one process talking to two servers never mixes their blocks.

The TTL is the invalidation: an operator who saves a changed block sees it used by every
run that starts more than one TTL later, in every worker process, with no signal to send.
Blocks change rarely and by hand, so 30 s is a small wait for saving three API calls per
run. A failed load is never cached. A cached block is shared by the runs of one process:
callers treat it as read-only.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

from prefect.blocks.core import Block
from prefect.settings import get_current_settings

TTL_ENV = "FACEFLOW_BLOCK_CACHE_TTL_S"
DEFAULT_TTL_S = 30.0


def ttl_from_env() -> float:
    """``$FACEFLOW_BLOCK_CACHE_TTL_S`` (seconds, >= 0), else ``DEFAULT_TTL_S``."""
    raw = os.environ.get(TTL_ENV, "").strip()
    try:
        return max(float(raw), 0.0) if raw else DEFAULT_TTL_S
    except ValueError:
        return DEFAULT_TTL_S


@dataclass
class BlockCache:
    """Loaded block documents by name, each kept for ``ttl_s`` seconds."""

    ttl_s: Callable[[], float] = ttl_from_env
    clock: Callable[[], float] = time.monotonic
    _entries: dict[tuple[str, str], tuple[float, Block]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def load(self, name: str) -> Block:
        """The block document ``name``: cached if loaded less than a TTL ago, else loaded."""
        ttl = self.ttl_s()
        now = self.clock()
        key = (str(get_current_settings().api.url or ""), name)
        with self._lock:
            entry = self._entries.get(key)
        if entry is not None and ttl > 0 and now - entry[0] < ttl:
            return entry[1]
        block = cast(Block, Block.load(name))  # sync call: the document itself
        if ttl > 0:
            with self._lock:
                self._entries[key] = (now, block)
        return block

    def clear(self) -> None:
        """Forget every cached block (the next load of each goes to the API)."""
        with self._lock:
            self._entries.clear()


BLOCK_CACHE = BlockCache()


def load_block(name: str) -> Block:
    """The block document ``name`` through this process's ``BLOCK_CACHE``."""
    return BLOCK_CACHE.load(name)
