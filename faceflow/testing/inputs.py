"""Inputs stored as the webapi stores them, for flows run by tests and benchmarks."""

from __future__ import annotations

import hashlib
from pathlib import Path


def put_input(storage: Path, data: bytes, ext: str = "jpg") -> str:
    """Store ``data`` under local result storage ``storage`` at the key the webapi gives
    it (``flows.params.input_key``: by content); the key."""
    from flows.params import input_key

    key = input_key(hashlib.sha256(data).hexdigest(), ext)
    path = storage / key
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return key
