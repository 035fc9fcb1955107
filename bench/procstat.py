"""CPU seconds from Linux /proc, for the benchmarks' per-component CPU figures."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")


def _stat(pid: int | str) -> tuple[str, list[str]]:
    """(command name, fields after it) of ``/proc/<pid>/stat``; OSError when it is gone."""
    head, tail = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)
    return head.split("(", 1)[1], tail.split()


def _cpu_s(fields: list[str]) -> float:
    """utime + stime + cutime + cstime: the process and its children it already reaped."""
    return sum(int(v) for v in fields[11:15]) / TICKS


def process_tree_cpu_s(pid: int | Sequence[int] | None) -> float:
    """CPU seconds of ``pid`` (or of several) and all its descendants so far, including
    descendants that already exited (counted in their parents' ``cutime``/``cstime``)."""
    if pid is None:
        return 0.0
    total, todo = 0.0, [pid] if isinstance(pid, int) else list(pid)
    while todo:
        one = todo.pop()
        try:
            _, fields = _stat(one)
            for task in Path(f"/proc/{one}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
        total += _cpu_s(fields)
    return total


def postgres_cpu_s() -> float:
    """CPU seconds of every ``postgres`` process on this machine so far, exited backends
    included (the postmaster reaps them); the job store and the Prefect server's database
    share the local cluster."""
    total = 0.0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            name, fields = _stat(proc.name)
        except (OSError, IndexError):
            continue
        if name.startswith("postgres"):
            total += _cpu_s(fields)
    return total


def machine_busy_s() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, all cores (/proc/stat)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields) - idle) / TICKS, sum(fields) / TICKS


def wait_until_quiet(
    pid: int | Sequence[int] | None,
    *,
    share: float = 0.1,
    window_s: float = 1.0,
    timeout_s: float = 60.0,
) -> float:
    """Wait until ``pid``'s process tree uses under ``share`` of a core over ``window_s``
    (a Prefect server still working through an earlier mode's events would otherwise take
    CPU from the next one); returns the seconds waited (``timeout_s`` at most)."""
    import time

    start = time.monotonic()
    before = process_tree_cpu_s(pid)
    while time.monotonic() - start < timeout_s:
        time.sleep(window_s)
        now = process_tree_cpu_s(pid)
        if now - before < share * window_s:
            break
        before = now
    return time.monotonic() - start
