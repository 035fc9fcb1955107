"""Temporary names of stored objects while they are written (local storage).

Every writer of local storage (the webapi's ``LocalObjectStore``, the flows'
``LocalFileSystem`` block) writes an object under ``partial_name`` beside its place and
renames it when whole; retention deletes the old ones that a killed writer left.
"""

from __future__ import annotations

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
