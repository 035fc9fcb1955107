"""Start, watch and stop the local stack's processes by PID (no orphans).

Each service runs in its own process group with its output in a log file; stopping sends
SIGTERM to the group, waits for a grace period, then SIGKILL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path


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


@dataclass
class Supervisor:
    """The services of one stack, stopped in reverse start order."""

    services: list[Service] = field(default_factory=list)

    def start(self, service: Service) -> Service:
        self.services.append(service)
        service.start()
        return service

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
