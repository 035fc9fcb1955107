"""HTTP byte ranges (RFC 9110 §14): the one ``Range`` form a result download answers."""

from __future__ import annotations

import re

from webapi.errors import RangeNotSatisfiable

_RANGE = re.compile(r"^\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*$", re.IGNORECASE)


def byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """The inclusive ``(first, last)`` bytes that ``Range: header`` asks of an object of
    ``size`` bytes, or None to send it whole (no header, several ranges, or a form this
    does not read: RFC 9110 lets a server ignore Range). ``bytes=a-``, ``bytes=a-b`` and
    the suffix ``bytes=-n`` are read; a range that starts past the end, or an empty
    object, raises ``RangeNotSatisfiable`` (416)."""
    if header is None:
        return None
    match = _RANGE.match(header)
    if match is None:
        return None
    first, last = match.group(1), match.group(2)
    if not first and not last:
        return None
    if not first:  # the last n bytes
        suffix = int(last)
        if suffix == 0 or size == 0:
            raise RangeNotSatisfiable(size)
        return max(0, size - suffix), size - 1
    start = int(first)
    end = size - 1 if not last else min(int(last), size - 1)
    if start >= size or (last and int(last) < start):
        raise RangeNotSatisfiable(size)
    return start, end
