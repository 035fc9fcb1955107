"""Start, watch, restart and stop the local stack's processes by PID (no orphans).

Each service runs in its own process group with its output in a log file. Stopping one
stops its whole family: its process group and every descendant, including those that left
the group for a session of their own (Prefect's runner starts each flow-run process with
``start_new_session``) and those orphaned meanwhile: SIGTERM, a grace period, then SIGKILL
to whatever is left. A supervisor that ``adopt_orphans`` (``faceflow up``) is the child
subreaper of its services' processes, so a grandchild whose parent died is re-parented to
it rather than to init, and is stopped with the rest. ``Supervisor.restart_exited``
starts a service that exited again (with a backoff; one that keeps failing is given up
on) and, when the supervisor has a ``records`` directory, counts every start there
(``webapi.services``: the API's ``/metrics`` exports them as restart counters).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from webapi import services

#: prctl option: orphaned descendants are re-parented to this process (Linux >= 3.4).
PR_SET_CHILD_SUBREAPER = 36
Identity = tuple[int, str]
"""A process: its pid and its start time (so a reused pid is never signalled)."""


def _stats() -> Iterator[tuple[int, list[bytes]]]:
    """(pid, the fields of ``/proc/<pid>/stat`` after the command name) of every process."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as stat:
                yield int(entry.name), stat.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue


def process_table() -> dict[int, tuple[int, int, str]]:
    """Every process: pid -> (parent pid, process group, start time); zombies left out."""
    return {
        pid: (int(fields[1]), int(fields[2]), fields[19].decode())
        for pid, fields in _stats()
        if fields[0] != b"Z"
    }


def family(
    leaders: set[int], table: dict[int, tuple[int, int, str]] | None = None
) -> set[Identity]:
    """``leaders`` (live ones), the members of their process groups and every descendant
    of any of them, wherever their session."""
    table = process_table() if table is None else table
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    todo = [pid for pid, (_, pgid, _) in table.items() if pid in leaders or pgid in leaders]
    found: set[int] = set()
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo += children.get(pid, [])
    return {(pid, table[pid][2]) for pid in found}


def _still_running(members: set[Identity]) -> set[Identity]:
    table = process_table()
    return {(pid, start) for pid, start in members if pid in table and table[pid][2] == start}


def _signal_all(members: set[Identity], sig: signal.Signals) -> None:
    for pid, _ in members:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def stop_family(
    leaders: set[int], grace: float, reap: Callable[[], object] = lambda: None
) -> set[Identity]:
    """SIGTERM the ``family`` of ``leaders``, wait up to ``grace`` seconds for all of it to
    exit (descendants found meanwhile join it), SIGKILL what is left and wait up to 5 s
    more; ``reap`` is called while waiting (to collect exited children). Returns what
    still ran at the end (nothing, unless SIGKILL could not be delivered)."""
    members = family(leaders)
    _signal_all(members, signal.SIGTERM)
    for sig, wait in ((signal.SIGKILL, grace), (None, 5.0)):
        deadline = time.monotonic() + wait
        while True:
            reap()
            members = _still_running(members) | family(leaders)
            if not members or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        if sig is None or not members:
            break
        _signal_all(members, sig)
    return members


class ServiceFailed(RuntimeError):
    """A service exited or did not become ready; names the service and its log."""

    def __init__(self, name: str, reason: str, log: Path) -> None:
        self.name, self.reason, self.log = name, reason, log
        super().__init__(f"{name} {reason}; see its log: {log}")


@dataclass
class Service:
    """One child process of the stack."""

    name: str
    argv: Sequence[str]
    log: Path
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def start(self) -> None:
        """Start the process in a new session, with default signal handlers."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.env}
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                list(self.argv),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=self.cwd,
                start_new_session=True,
                restore_signals=True,
            )

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def wait_ready(self, check: Callable[[], bool], timeout: float, interval: float = 0.25) -> None:
        """Poll ``check`` until it returns True; ``ServiceFailed`` if the process dies or times out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                code = self.process.returncode if self.process else None
                raise ServiceFailed(
                    self.name, f"exited with code {code} before it was ready", self.log
                )
            try:
                if check():
                    return
            except Exception:  # readiness probes fail while the service is starting
                pass
            time.sleep(interval)
        raise ServiceFailed(self.name, f"was not ready after {timeout:.0f} s", self.log)

    def stop(self, grace: float = 10.0) -> None:
        """Stop the process, its group and every descendant (``stop_family``), also when
        the process itself has already exited."""
        if self.process is None:
            return
        process = self.process
        stop_family({process.pid}, grace, reap=process.poll)

    def kill(self, sig: signal.Signals = signal.SIGKILL) -> None:
        """Send ``sig`` to the whole process group at once (fault injection); reap the leader."""
        if self.process is None or self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            return
        if sig == signal.SIGKILL:
            self.process.wait(timeout=10)

    def restart(self, grace: float = 10.0) -> None:
        """Stop the process (if it still runs) and start it again with the same command."""
        self.stop(grace)
        self.start()

    def exit_reason(self) -> str:
        """How the process ended: ``exited with code N`` or ``killed by SIGNAME``."""
        code = self.process.returncode if self.process else None
        if code is not None and code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exited with code {code}"


@dataclass(frozen=True)
class Restarted:
    """One automatic restart: which service, why it had stopped, and its restart count."""

    name: str
    reason: str
    restarts: int


@dataclass
class Supervisor:
    """The services of one stack, stopped in reverse start order.

    ``records``: a directory where every start is counted (``webapi.services``). A service
    that exits is started again by ``restart_exited`` after ``restart_backoff_s`` (doubling
    while it keeps exiting), unless it exited ``max_restarts`` times within
    ``restart_window_s``: then it is given up on (``ServiceFailed``)."""

    services: list[Service] = field(default_factory=list)
    records: Path | None = None
    adopted_orphans: bool = False
    max_restarts: int = 5
    restart_window_s: float = 300.0
    restart_backoff_s: float = 1.0
    _exits: dict[str, deque[float]] = field(default_factory=dict)
    _due: dict[str, float] = field(default_factory=dict)

    def start(self, service: Service) -> Service:
        self.services.append(service)
        self._start(service)
        return service

    def _start(self, service: Service) -> int:
        service.start()
        if self.records is None:
            return 0
        return services.record_start(self.records, service.name).restarts

    def restart_exited(self, now: float | None = None) -> list[Restarted]:
        """Start again every service that has exited and whose backoff is over; returns
        what was restarted. ``ServiceFailed`` for one that exited too often."""
        now = time.monotonic() if now is None else now
        done: list[Restarted] = []
        for service in self.services:
            if service.alive():
                continue
            due = self._due.get(service.name)
            if due is None:
                due = self._note_exit(service, now)
            if now < due:
                continue
            del self._due[service.name]
            reason = service.exit_reason()
            if self.records is not None:
                services.record_exit(self.records, service.name, reason)
            service.stop(grace=2.0)  # its group may hold children that outlived it
            restarts = self._start(service)
            done.append(Restarted(service.name, reason, restarts))
        return done

    def _note_exit(self, service: Service, now: float) -> float:
        exits = self._exits.setdefault(service.name, deque())
        exits.append(now)
        while exits and now - exits[0] > self.restart_window_s:
            exits.popleft()
        if len(exits) > self.max_restarts:
            raise ServiceFailed(
                service.name,
                f"{service.exit_reason()}, its {len(exits)}th exit within "
                f"{self.restart_window_s:.0f} s: not restarted again",
                service.log,
            )
        due = now + self.restart_backoff_s * 2 ** (len(exits) - 1)
        self._due[service.name] = due
        return due

    def get(self, name: str) -> Service:
        """The service called ``name``; ``KeyError`` if there is none."""
        for service in self.services:
            if service.name == name:
                return service
        raise KeyError(name)

    def check_alive(self) -> None:
        """``ServiceFailed`` for the first service that has exited."""
        for service in self.services:
            if not service.alive():
                code = service.process.returncode if service.process else None
                raise ServiceFailed(service.name, f"exited with code {code}", service.log)

    def adopt_orphans(self) -> bool:
        """Make this process the child subreaper of its descendants (Linux), so that
        ``stop_all`` also finds a service's grandchild whose parent died (it would be
        re-parented to init and outlive the stack). Only for a process that starts no
        other children (``faceflow up``): ``reap_orphans`` collects every exited child
        that is not a service. Returns whether it took effect."""
        if not sys.platform.startswith("linux"):
            return False
        libc = ctypes.CDLL(None, use_errno=True)
        self.adopted_orphans = libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
        return self.adopted_orphans

    def orphans(self) -> set[int]:
        """Adopted processes: this process's children that are not a service."""
        if not self.adopted_orphans:
            return set()
        own, services = os.getpid(), set(self.pids())
        return {pid for pid, (ppid, _, _) in process_table().items() if ppid == own} - services

    def reap_orphans(self) -> None:
        """Collect the exit status of adopted children that exited (never a service's)."""
        if not self.adopted_orphans:
            return
        own, services = str(os.getpid()).encode(), set(self.pids())
        for pid, fields in _stats():
            if fields[0] == b"Z" and fields[1] == own and pid not in services:
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass

    def stop_all(self, grace: float = 10.0) -> None:
        """Stop every service (in reverse start order), then any adopted orphan."""
        for service in reversed(self.services):
            service.stop(grace)
        orphans = self.orphans()
        if orphans:
            stop_family(orphans, grace, reap=self.reap_orphans)
        self.reap_orphans()

    def pids(self) -> list[int]:
        return [s.pid for s in self.services if s.pid is not None]
