"""The worker's own record of the flow runs it has claimed, so a restart can end them.

A ``faceflow-gpu`` worker that dies (SIGKILL, OOM, host reboot) leaves its runs
``Pending``/``Running`` in Prefect: its children die with it (``PR_SET_PDEATHSIG``), but
nothing tells Prefect, and each such run holds a slot of the pool's concurrency limit.
The worker therefore keeps a small journal per identity (work pool + worker name) under
its state directory: a run is added when the worker claims it and removed once its final
state is recorded. At start, a new incarnation with the same identity reads what the last
one left and marks those runs ``Crashed`` (``[worker_lost] ...``) if they are still not
final; the relay then re-dispatches the job (attempt n+1) while attempts and the deadline
allow, and the pool's slot is free at once.

Only a dead worker's runs are touched: the journal is guarded by an exclusive ``flock``
that its worker holds for its whole life (the kernel releases it when the process dies,
however it dies). A second live worker started with the same identity cannot take the
lock; it then neither recovers nor journals (and says so), so it can never crash runs that
a live worker holds. Workers without a stable ``--name`` get a fresh identity each start
and so recover nothing: give each worker a stable name (``faceflow up`` does).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
CHILD_MODULE = b"faceflow.worker.child"


def identity_slug(pool: str, worker: str) -> str:
    """A file-name-safe identity of a worker on a pool."""
    return _UNSAFE.sub("_", f"{pool}--{worker}")[:200]


@dataclass(frozen=True)
class Claim:
    """A run a worker claimed: its id, and the child running it (0: none yet)."""

    flow_run_id: str
    child_pid: int = 0
    child_started: str = ""  # /proc start time of the child, so a reused PID is not killed


class ClaimJournal:
    """``<state_dir>/<identity>.json`` guarded by ``<identity>.lock`` (held while alive)."""

    def __init__(self, state_dir: Path, identity: str) -> None:
        self.state_dir = state_dir
        self.path = state_dir / f"{identity}.json"
        self.lock_path = state_dir / f"{identity}.lock"
        self._lock_file: IO[bytes] | None = None
        self._claims: dict[str, Claim] = {}
        self.owner = os.getpid()

    @property
    def held(self) -> bool:
        """Whether this process holds the identity (journals and may recover)."""
        return self._lock_file is not None

    def acquire(self) -> list[Claim] | None:
        """Take the identity's lock; the claims a dead previous holder left (None when a
        live process holds the lock: this worker must not recover or journal)."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        lock_file = self.lock_path.open("ab")
        try:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock_file.close()
            return None
        self._lock_file = lock_file
        left = self._read()
        self._claims = {}
        return left

    def release(self) -> None:
        """Drop the lock (clean stop: the journal stays with whatever is still claimed)."""
        if self._lock_file is not None:
            if not self._claims:
                with contextlib.suppress(OSError):
                    self.path.unlink()
            with contextlib.suppress(OSError):
                fcntl.flock(self._lock_file.fileno(), fcntl.LOCK_UN)
            self._lock_file.close()
            self._lock_file = None

    def add(self, flow_run_id: str, child_pid: int = 0) -> None:
        """Record a claimed run (again with its child's PID once it has one)."""
        if not self.held:
            return
        started = proc_start_time(child_pid) if child_pid else ""
        self._claims[flow_run_id] = Claim(flow_run_id, child_pid, started or "")
        self._write()

    def keep(self, claim: Claim) -> None:
        """Carry over a claim a dead predecessor left, until it is handled."""
        if self.held:
            self._claims[claim.flow_run_id] = claim
            self._write()

    def remove(self, flow_run_id: str) -> None:
        """The run's final state is recorded (or it went back to Scheduled)."""
        if not self.held or self._claims.pop(flow_run_id, None) is None:
            return
        self._write()

    def claims(self) -> list[Claim]:
        return list(self._claims.values())

    def _read(self) -> list[Claim]:
        try:
            data: Any = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return []
        claims = []
        for item in data.get("claims", []) if isinstance(data, dict) else []:
            with contextlib.suppress(KeyError, TypeError, ValueError):
                claims.append(
                    Claim(
                        str(item["flow_run_id"]),
                        int(item.get("child_pid") or 0),
                        str(item.get("child_started") or ""),
                    )
                )
        return claims

    def _write(self) -> None:
        body = {
            "worker_pid": self.owner,
            "updated": time.time(),
            "claims": [c.__dict__ for c in self._claims.values()],
        }
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(body))
        os.replace(tmp, self.path)


def proc_start_time(pid: int) -> str | None:
    """Field 22 of ``/proc/<pid>/stat`` (start time in clock ticks), None if not running."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[19] if len(fields) > 19 else None


def kill_stray_child(claim: Claim) -> bool:
    """SIGKILL the claim's child if that very process (same PID and start time, running
    ``faceflow.worker.child``) still exists; whether one was killed."""
    if not claim.child_pid or not claim.child_started:
        return False
    if proc_start_time(claim.child_pid) != claim.child_started:
        return False
    try:
        cmdline = Path(f"/proc/{claim.child_pid}/cmdline").read_bytes()
    except OSError:
        return False
    if CHILD_MODULE not in cmdline:
        return False
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(claim.child_pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(claim.child_pid, signal.SIGKILL)
    return True
