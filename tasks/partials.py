"""Local files written whole: under a temporary name beside their place, then renamed.

Every writer of local storage (the webapi's ``LocalObjectStore``, the flows'
``LocalFileSystem`` block) writes through ``replacing``, so a reader sees the old file or
the new one, never part of one; retention deletes the temporary files (``partial_name``)
that a writer killed between its write and its rename left.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PARTIAL_SUFFIX = ".partial"
"""The end of a stored object's temporary name while it is written (``partial_name``)."""


def partial_name(name: str, tag: str) -> str:
    """The name under which the object ``name`` is written beside its place in local
    storage before the rename that makes it whole: hidden, ``tag`` unique per writer
    (retention deletes old ones: a writer killed between write and rename left them)."""
    return f".{name}.{tag}{PARTIAL_SUFFIX}"


def is_partial_name(name: str) -> bool:
    """Whether a file name is a ``partial_name``."""
    return name.startswith(".") and name.endswith(PARTIAL_SUFFIX)


@contextmanager
def replacing(target: Path) -> Iterator[Path]:
    """A temporary file beside ``target`` (a ``partial_name`` unique to this writer) that
    becomes ``target`` when the block ends; removed if the block raises."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(partial_name(target.name, uuid.uuid4().hex[:12]))
    try:
        yield partial
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)
