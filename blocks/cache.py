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
from typing import cast

from prefect.blocks.core import Block
from prefect.settings import get_current_settings

from tasks.recent import Recent

TTL_ENV = "FACEFLOW_BLOCK_CACHE_TTL_S"
DEFAULT_TTL_S = 30.0


def ttl_from_env() -> float:
    """``$FACEFLOW_BLOCK_CACHE_TTL_S`` (seconds, >= 0), else ``DEFAULT_TTL_S``."""
    raw = os.environ.get(TTL_ENV, "").strip()
    try:
        return max(float(raw), 0.0) if raw else DEFAULT_TTL_S
    except ValueError:
        return DEFAULT_TTL_S


BLOCK_CACHE: Recent[tuple[str, str], Block] = Recent(ttl_from_env)
"""Loaded block documents by (Prefect API URL, name)."""


def load_block(name: str) -> Block:
    """The block document ``name``: the one this process loaded less than a TTL ago (from
    ``BLOCK_CACHE``), else loaded now."""
    key = (str(get_current_settings().api.url or ""), name)
    return BLOCK_CACHE.get(key, lambda: cast(Block, Block.load(name)))  # sync: the document
