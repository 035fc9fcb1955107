"""A warm child's heap keeps what its runs free, up to a limit (``faceflow.worker.memory``):
the next run reuses those pages instead of faulting in fresh ones, and a large job's peak
still goes back to the OS."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from faceflow.worker.memory import keep_heap, release_memory, rss_mb

RUN_TWICE = textwrap.dedent(
    """
    import ctypes, resource, sys
    from faceflow.worker.memory import keep_heap, release_memory

    keep = float(sys.argv[1])

    def block(size):  # malloc'ed and written through, as a tensor's output is
        data = bytearray(size)
        ctypes.memset((ctypes.c_char * size).from_buffer(data), 1, size)
        return data

    def run():  # a run's two large blocks, then freed
        blocks = [block(64 << 20) for _ in range(2)]
        blocks.append(block(1 << 10))  # outlives them, as a run's results do
        del blocks[:2]
        return blocks

    print(keep_heap(keep))
    kept = run()
    release_memory(None if keep == 0 else 1e9)  # as the child does at a run's end
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    kept += run()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """
)


REPO = Path(__file__).resolve().parents[2]
CLEAN_ENV = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(REPO)}
"""A bare interpreter's environment: no site packages (``-S``), only the repository (the
memory module needs the standard library alone)."""


def _second_run_faults(keep_mb: float) -> tuple[bool, int]:
    """(whether ``keep_heap`` took the settings, page faults of the second run) in a fresh
    interpreter: ``mallopt`` changes the whole process."""
    out = subprocess.run(
        [sys.executable, "-S", "-s", "-c", RUN_TWICE, str(keep_mb)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        env=CLEAN_ENV,  # nothing the suite's other tests left in the environment
    ).stdout.split()
    return out[0] == "True", int(out[1])


def test_a_kept_heap_serves_the_next_run_without_fresh_pages() -> None:
    """128 MB in two 64 MB blocks a run: glibc's defaults map them anew each time (above
    its 32 MB mmap threshold: 32,768 pages to fault in), a heap that keeps 256 MB serves
    the second run from the pages the first one freed."""
    took, faults = _second_run_faults(256)
    assert took
    assert faults < 2_000, faults
    took, faults = _second_run_faults(0)
    assert not took  # 0: glibc's defaults stay
    assert faults > 30_000, faults


def test_release_memory_gives_back_only_above_the_rss_given() -> None:
    """200 MB freed under a pinned heap top: kept while the RSS is under the limit given
    (the child's: its warm size plus ``heap_keep_mb``), given back above it or with no
    limit."""
    release_memory()
    base = rss_mb()
    blocks = [bytes(10_000) for _ in range(20_000)]  # 200 MB of heap blocks
    pin = bytes(10_000)  # allocated after them: free() alone cannot shrink the heap
    peak = rss_mb()
    del blocks
    assert release_memory(above_mb=base + 1024) is False
    assert rss_mb() > peak - 50
    assert release_memory(above_mb=base + 100) is True
    assert rss_mb() < peak - 150
    assert release_memory() in (True, False)  # nothing left to return: still no error
    del pin


def test_keep_heap_zero_changes_nothing_and_a_large_keep_is_capped() -> None:
    """``heap_keep_mb`` 0 keeps glibc's defaults (and the trim after every run); one past
    what ``mallopt`` takes (a C int) keeps 2 GiB rather than wrapping around (in a fresh
    interpreter: ``mallopt`` changes the whole process)."""
    assert keep_heap(0) is False
    took, faults = _second_run_faults(8192)
    assert took and faults < 2_000, faults
