"""Start, watch, restart and stop the local stack's processes by PID (no orphans).

Each service runs in its own process group with its output in a log file; stopping sends
SIGTERM to the group, waits for a grace period, then SIGKILL. ``Supervisor.restart_exited``
starts a service that exited again (with a backoff; one that keeps failing is given up
on) and, when the supervisor has a ``records`` directory, counts every start there
(``webapi.services``: the API's ``/metrics`` exports them as restart counters).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from webapi import services


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
        """SIGTERM the process group, then SIGKILL after ``grace`` seconds."""
        if self.process is None or self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        try:  # the group may hold children (flow-run processes) that outlived the leader
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass

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

    def stop_all(self, grace: float = 10.0) -> None:
        for service in reversed(self.services):
            service.stop(grace)

    def pids(self) -> list[int]:
        return [s.pid for s in self.services if s.pid is not None]
