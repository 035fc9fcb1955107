"""Hostile JSON request bodies: large, and costly to parse in ways a size limit alone
does not stop (many keys, deep nesting). Used by the webapi's hostile-client tests and
``bench/hostile_body.py``."""

from __future__ import annotations


def many_keys(size: int) -> bytes:
    """A JSON object of short unknown keys, ``size`` bytes long (≈ 12 bytes a key)."""
    parts, total, i = [], 2, 0
    while total < size:
        item = f'"k{i}":0'
        parts.append(item)
        total += len(item) + 1
        i += 1
    return ("{" + ",".join(parts) + "}").encode()


def deep(size: int) -> bytes:
    """``options`` nested ``size / 2`` arrays deep."""
    depth = (size - 20) // 2
    return b'{"options":' + b"[" * depth + b"]" * depth + b"}"
