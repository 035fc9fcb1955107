"""CPU and memory figures from Linux /proc, for the benchmarks' per-component figures."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")


def _stat(pid: int | str) -> tuple[str, list[str]]:
    """(command name, fields after it) of ``/proc/<pid>/stat``; OSError when it is gone."""
    head, tail = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)
    return head.split("(", 1)[1], tail.split()


def _cpu_s(fields: list[str]) -> float:
    """utime + stime + cutime + cstime: the process and its children it already reaped."""
    return sum(int(v) for v in fields[11:15]) / TICKS


def process_tree(pid: int | Sequence[int]) -> list[int]:
    """``pid`` (or several) and all its living descendants."""
    found, todo = [], [pid] if isinstance(pid, int) else list(pid)
    while todo:
        one = todo.pop()
        try:
            for task in Path(f"/proc/{one}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
        found.append(one)
    return found


def process_tree_cpu_s(pid: int | Sequence[int] | None) -> float:
    """CPU seconds of ``pid`` (or of several) and all its descendants so far, including
    descendants that already exited (counted in their parents' ``cutime``/``cstime``)."""
    if pid is None:
        return 0.0
    total = 0.0
    for one in process_tree(pid):
        try:
            total += _cpu_s(_stat(one)[1])
        except OSError:
            continue
    return total


def _tcp_address(hex_address: str) -> tuple[str, int]:
    """``(ip, port)`` of an IPv4 ``/proc/net/tcp`` address (``0100007F:1F90``)."""
    host, port = hex_address.split(":")
    return ".".join(str(b) for b in reversed(bytes.fromhex(host))), int(port, 16)


def _tcp_table() -> list[tuple[tuple[str, int], tuple[str, int], str]]:
    """This machine's IPv4 TCP sockets: (local address, remote address, ``socket:[inode]``)."""
    rows = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        rows.append((_tcp_address(fields[1]), _tcp_address(fields[2]), f"socket:[{fields[9]}]"))
    return rows


def _sockets(pid: int) -> set[str]:
    """The ``socket:[inode]`` links of ``pid``'s open files (empty when it is gone)."""
    found: set[str] = set()
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return found
    for fd in fds:
        try:
            found.add(os.readlink(fd))
        except OSError:
            continue
    return found


def tcp_peer_pid(client: tuple[str, int], server: tuple[str, int], pids: Sequence[int]) -> int:
    """Which of ``pids`` holds the server's end of the loopback TCP connection from
    ``client`` to ``server`` (both ``(ip, port)``); ``LookupError`` when none does."""
    ends = {inode for local, remote, inode in _tcp_table() if (local, remote) == (server, client)}
    for pid in pids:
        if ends & _sockets(pid):
            return pid
    raise LookupError(f"no process of {list(pids)} serves {client} -> {server}")


def tcp_clients(pid: int, server: tuple[str, int]) -> list[tuple[str, int]]:
    """The local addresses of ``pid``'s TCP connections to ``server`` (``(ip, port)``)."""
    mine = _sockets(pid)
    return [local for local, remote, inode in _tcp_table() if remote == server and inode in mine]


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
    start = time.monotonic()
    before = process_tree_cpu_s(pid)
    while time.monotonic() - start < timeout_s:
        time.sleep(window_s)
        now = process_tree_cpu_s(pid)
        if now - before < share * window_s:
            break
        before = now
    return time.monotonic() - start


class CpuMeter:
    """CPU seconds per component over one phase: each named process tree, PostgreSQL
    (``postgres``), this process (``bench``), and how busy the whole machine was."""

    def __init__(
        self, pids: Mapping[str, int | Sequence[int] | None], *, postgres: bool = True
    ) -> None:
        self.pids = dict(pids)
        self.postgres = postgres
        self.start = self._read()

    def _read(self) -> dict[str, float]:
        out = {name: process_tree_cpu_s(pid) for name, pid in self.pids.items()}
        if self.postgres:
            out["postgres"] = postgres_cpu_s()
        out["bench"] = sum(os.times()[:2])
        out["machine_busy"], out["machine_total"] = machine_busy_s()
        return out

    def per_job_ms(self, jobs: int) -> dict[str, float]:
        """CPU ms per job by component, ``other`` (the rest of the machine's busy time)
        and ``machine_busy_share`` (the machine's busy share of all cores)."""
        end = self._read()
        delta = {k: end[k] - self.start[k] for k in end}
        total = delta.pop("machine_total")
        busy = delta.pop("machine_busy")
        out = {name: round(v * 1e3 / jobs, 1) for name, v in delta.items()}
        out["other"] = round((busy - sum(delta.values())) * 1e3 / jobs, 1)
        out["machine_busy_share"] = round(busy / total, 3) if total else 0.0
        return out


def memory_kb(pid: int) -> dict[str, int]:
    """``VmRSS`` (resident now) and ``VmHWM`` (peak resident so far) of ``pid`` in KiB."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return {k: int(fields[k].split()[0]) for k in ("VmRSS", "VmHWM")}


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident set size so far (``VmHWM``), MiB."""
    return memory_kb(pid)["VmHWM"] / 1024.0
