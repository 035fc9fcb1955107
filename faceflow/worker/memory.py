"""How a warm child's heap keeps and gives back the memory its runs free.

A run's images and tensors are freed when it ends. glibc's defaults do two costly things
with them: blocks above a dynamic threshold (at most 32 MB) are ``mmap``-ed and unmapped
on every ``free``, and ``malloc_trim`` after a run hands every free page back. Either way
the next run touches fresh pages again, one page fault each (a batch of 8 real jobs in a
scratch loop here: 87,000 faults and 0.31 s of system time; 1,300 and 0.04 s with the heap
kept). ``keep_heap`` has the child's heap keep up to ``keep_mb`` of freed memory instead
(blocks up to that size come from the heap, and its top is not trimmed below it), and the
child calls ``release_memory`` only when its RSS is more than that above its size after
warm-up: a large job's peak (3.66 GB after the amplification job) still goes back to the
OS. Elsewhere (musl, macOS, Windows) both are no-ops.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import resource
from typing import Any

HEAP_KEEP_MB = 1024.0
"""Freed memory a warm child keeps by default (``WorkerSettings.heap_keep_mb``)."""
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
C_INT_MAX = 2**31 - 1
"""The most ``mallopt`` takes (an ``int``): a larger ``keep_mb`` keeps 2 GiB."""
TOP_PAD_MB = 64
"""Extra memory the heap asks for at a time when it grows (fewer ``brk`` calls)."""
MMAP_THRESHOLD_MAX_MB = 1024
"""Blocks above this are ``mmap``-ed whatever ``keep_mb`` says (one image never needs it)."""


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library, or None where there is none to load."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def _function(name: str) -> Any:
    """``name`` from the C library, or None where it has none (not glibc)."""
    libc = _libc()
    return getattr(libc, name, None) if libc is not None else None


def rss_mb() -> float:
    """Resident set size of this process now (MiB); peak RSS where /proc is missing."""
    try:
        with open("/proc/self/statm") as fh:
            pages = int(fh.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def keep_heap(keep_mb: float) -> bool:
    """Let the heap keep up to ``keep_mb`` MiB of freed memory for the next run: blocks
    up to that size (at most ``MMAP_THRESHOLD_MAX_MB``) come from the heap rather than from
    ``mmap``, and the heap's top is trimmed on ``free`` only above it. Whether glibc took
    the settings (False where ``mallopt`` is missing, or with ``keep_mb`` 0: the defaults
    stay)."""
    mallopt = _function("mallopt")
    if mallopt is None or keep_mb <= 0:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    keep = min(int(keep_mb * (1 << 20)), C_INT_MAX)  # mallopt takes a C int
    threshold = min(keep, MMAP_THRESHOLD_MAX_MB << 20)
    return all(
        mallopt(option, value) == 1
        for option, value in (
            (M_MMAP_THRESHOLD, threshold),
            (M_TRIM_THRESHOLD, keep),
            (M_TOP_PAD, TOP_PAD_MB << 20),
        )
    )


def release_memory(above_mb: float | None = None) -> bool:
    """Return the free heap pages of every arena to the OS (``malloc_trim(0)``) when the
    process's RSS is above ``above_mb`` (always with None); whether any were returned (False
    where ``malloc_trim`` is missing or the RSS was not above). Under a millisecond after a
    job here; no ``gc.collect``: with Prefect and torch loaded a full collection takes
    ≈ 0.3 s."""
    trim = _function("malloc_trim")
    if trim is None or (above_mb is not None and rss_mb() <= above_mb):
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return bool(trim(0))
