"""Storage blocks for tests, typed as the flows take them."""

from __future__ import annotations

from pathlib import Path
from typing import cast

from prefect.filesystems import LocalFileSystem

from blocks.storage import ByteStore


def local_store(basepath: str | Path) -> ByteStore:
    """A ``LocalFileSystem`` block rooted at ``basepath``. Its methods are sync-compatible
    (typed ``bytes | Coroutine``); called outside an event loop, as here, they return
    bytes, which is what ``ByteStore`` says (as ``blocks.storage.load_storage`` casts)."""
    return cast(ByteStore, LocalFileSystem(basepath=str(basepath)))
