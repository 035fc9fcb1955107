"""Temporary changes to this process's environment variables."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager


@contextmanager
def patched_environ(set_: Mapping[str, str], remove: tuple[str, ...] = ()) -> Iterator[None]:
    """Set and remove environment variables for the block (children inherit them); each
    variable gets its earlier value back, or is removed again, when the block ends."""
    saved = {k: os.environ.get(k) for k in (*set_, *remove)}
    os.environ.update(set_)
    for key in remove:
        os.environ.pop(key, None)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
