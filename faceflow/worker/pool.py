"""The worker's warm children: start, warm, hand out, kill and replace them (by PID).

Each ``Slot`` owns at most one child process at a time and a supervisor task that keeps a
warm child in it: start → wait for ``Ready`` → idle → (busy → idle)* → replaced when it
dies, is killed after a deadline or cancellation, or is recycled. Messages from a child
arrive through ``loop.add_reader`` on its socket; run messages go to the slot's run queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from faceflow.worker.protocol import (
    ChildSpec,
    Ready,
    RunFinished,
    RunRequest,
    RunStarted,
    Shutdown,
    Telemetry,
    WarmupFailed,
)

log = logging.getLogger("prefect.faceflow_gpu")


class SlotState(enum.StrEnum):
    """Where a slot's child is in its life."""

    STARTING = "starting"
    IDLE = "idle"
    BUSY = "busy"
    STOPPING = "stopping"
    DOWN = "down"


SLOT_MOVES: dict[SlotState, frozenset[SlotState]] = {
    SlotState.DOWN: frozenset({SlotState.STARTING, SlotState.STOPPING}),
    SlotState.STARTING: frozenset({SlotState.IDLE, SlotState.DOWN, SlotState.STOPPING}),
    SlotState.IDLE: frozenset({SlotState.BUSY, SlotState.STOPPING}),
    SlotState.BUSY: frozenset({SlotState.IDLE, SlotState.STOPPING}),
    SlotState.STOPPING: frozenset({SlotState.STOPPING, SlotState.DOWN, SlotState.STARTING}),
}
"""The moves a slot may make (``Slot.move``): a stopping slot never becomes idle or busy
again, a busy one is freed or stopped, only an idle one takes a run."""


@dataclass(frozen=True)
class ChildGone:
    """The child's pipe closed: the process exited or was killed."""

    pid: int
    returncode: int | None


@dataclass(frozen=True)
class CheckState:
    """Read the run's state now (its ``Cancelling`` event arrived): the worker's own nudge."""

    flow_run_id: str


RunMessage = RunStarted | RunFinished | ChildGone | CheckState


class NoChildReady(RuntimeError):
    """No warm child became idle in time."""


class ChildProcess:
    """One ``python -m faceflow.worker.child`` process in its own session."""

    def __init__(self, spec: ChildSpec, on_message: Any, log_path: Path | None = None) -> None:
        self.spec = spec
        self._on_message = on_message
        self._log_path = log_path
        self.popen: subprocess.Popen[bytes] | None = None
        self.conn: Connection | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.gone = False

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def start(self) -> None:
        """Start the process and send it its spec; messages flow to ``on_message``."""
        parent_sock, child_sock = socket.socketpair()
        env = {**os.environ, **self.spec.env}
        out = self._log_path.open("ab") if self._log_path else None
        try:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "faceflow.worker.child", "--fd", str(child_sock.fileno())],
                pass_fds=(child_sock.fileno(),),
                env=env,
                cwd=self.spec.working_dir,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT if out else None,
                start_new_session=True,
                restore_signals=True,
            )
        finally:
            child_sock.close()
            if out:
                out.close()
        self.conn = Connection(parent_sock.detach())
        self.conn.send(self.spec)
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self.conn.fileno(), self._readable)

    def _readable(self) -> None:
        assert self.conn is not None
        try:
            while self.conn.poll():
                self._on_message(self.conn.recv())
        except (EOFError, OSError):
            self._closed()

    def _closed(self) -> None:
        if self.gone:
            return
        self.gone = True
        if self._loop is not None and self.conn is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self.conn.fileno())
        returncode = self.popen.poll() if self.popen else None
        self._on_message(ChildGone(self.pid, returncode))

    def send(self, message: RunRequest | Shutdown) -> None:
        assert self.conn is not None
        self.conn.send(message)

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    async def wait_exit(self, timeout: float) -> int | None:
        """Wait up to ``timeout`` s for the process to exit; its return code or None."""
        assert self.popen is not None
        end = time.monotonic() + timeout
        while self.popen.poll() is None and time.monotonic() < end:
            await asyncio.sleep(0.01)
        return self.popen.poll()

    def signal_group(self, signum: int) -> None:
        """Send ``signum`` to the child's process group (falls back to the PID)."""
        if not self.alive():
            return
        try:
            os.killpg(self.pid, signum)
        except (ProcessLookupError, PermissionError):
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    async def kill(self, grace: float, sigterm_first: bool = True) -> int | None:
        """SIGTERM the group, SIGKILL after ``grace`` s (at once without ``sigterm_first``);
        returns the exit code."""
        if self.popen is None:
            return None
        code = None
        if sigterm_first:
            self.signal_group(signal.SIGTERM)
            code = await self.wait_exit(grace)
        if code is None:
            self.signal_group(signal.SIGKILL)
            code = await self.wait_exit(5.0)
        self.close()
        return code

    async def stop(self, grace: float, kill_grace: float) -> int | None:
        """Ask the child to exit (between runs); kill it if it does not within ``grace``."""
        if self.alive():
            with contextlib.suppress(OSError):
                self.send(Shutdown())
            code = await self.wait_exit(grace)
            if code is not None:
                self.close()
                return code
        return await self.kill(kill_grace)

    def close(self) -> None:
        """Drop the pipe (after the process is gone)."""
        if self.conn is not None:
            if self._loop is not None and not self.gone:
                with contextlib.suppress(Exception):
                    self._loop.remove_reader(self.conn.fileno())
            self.gone = True
            with contextlib.suppress(OSError):
                self.conn.close()


@dataclass
class Slot:
    """One place for a warm child (one per GPU by default)."""

    spec: ChildSpec
    state: SlotState = SlotState.DOWN
    child: ChildProcess | None = None
    ready: Ready | None = None
    telemetry: Telemetry | None = None
    runs_done: int = 0
    starts: int = 0
    last_error: str | None = None
    flow_run_id: str | None = None
    run_queue: asyncio.Queue[RunMessage] = field(default_factory=asyncio.Queue)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    replace_reason: str | None = None

    @property
    def index(self) -> int:
        return self.spec.index

    def move(self, to: SlotState, flow_run_id: str | None = None) -> bool:
        """Change the slot's state to ``to`` (with the run it serves when ``BUSY``) if
        ``SLOT_MOVES`` allows it; an illegal move is logged and refused."""
        if to not in SLOT_MOVES[self.state]:
            log.error("slot %s: refused move %s -> %s", self.index, self.state, to)
            return False
        self.state = to
        self.flow_run_id = flow_run_id if to is SlotState.BUSY else None
        return True

    def status(self) -> dict[str, Any]:
        """Readiness, liveness and telemetry of this slot, for the health endpoint."""
        alive = self.child is not None and self.child.alive()
        tel = self.telemetry
        return {
            "index": self.index,
            "state": self.state.value,
            "ready": self.state in (SlotState.IDLE, SlotState.BUSY) and alive,
            "alive": alive,
            "pid": self.child.pid if self.child and self.child.popen else None,
            "cuda_visible_devices": self.spec.env.get("CUDA_VISIBLE_DEVICES"),
            "device": self.ready.device if self.ready else None,
            "warmup_ms": round(self.ready.warmup_ms, 1) if self.ready else None,
            "startup_ms": round(self.ready.startup_ms, 1) if self.ready else None,
            "runs_done": self.runs_done,
            "starts": self.starts,
            "flow_run_id": self.flow_run_id,
            "model_loads": tel.model_loads if tel else {},
            "rss_mb": round(tel.rss_mb, 1) if tel else None,
            "gpu": tel.gpu if tel else None,
            "last_error": self.last_error,
        }


@dataclass(frozen=True)
class PoolLimits:
    """Timing and recycling limits of the pool."""

    ready_timeout: float = 300.0
    max_runs: int = 500
    max_rss_mb: float = 8192.0
    stop_grace: float = 5.0
    kill_grace: float = 0.5
    restart_backoff_max: float = 30.0


class ChildPool:
    """Keeps one warm child per slot; hands idle ones to runs."""

    def __init__(
        self, specs: list[ChildSpec], limits: PoolLimits, log_dir: Path | None = None
    ) -> None:
        self.slots = [Slot(spec) for spec in specs]
        self.limits = limits
        self.log_dir = log_dir
        self._supervisors: list[asyncio.Task[None]] = []
        self._stopping: set[asyncio.Task[int | None]] = set()
        self._idle = asyncio.Condition()
        self.closing = False
        self.waiting = 0
        """Runs claimed ahead, waiting in ``acquire`` for a child."""
        self.priority_waiting = 0
        """Of those, runs of the priority lane: they take the next free child first."""
        self.on_idle: Callable[[], None] | None = None
        """Called whenever a child becomes idle (the worker polls for runs at once)."""

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Start every slot's supervisor (children warm up in the background)."""
        for slot in self.slots:
            self._supervisors.append(asyncio.create_task(self._supervise(slot)))

    async def wait_ready(self, count: int | None = None, timeout: float | None = None) -> None:
        """Wait until ``count`` (default: all) slots are idle or busy."""
        wanted = len(self.slots) if count is None else count
        end = time.monotonic() + (self.limits.ready_timeout if timeout is None else timeout)
        while sum(s.status()["ready"] for s in self.slots) < wanted:
            if time.monotonic() > end:
                errors = "; ".join(s.last_error or s.state.value for s in self.slots)
                raise NoChildReady(f"{wanted} warm children not ready in time: {errors}")
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        """Stop every child by PID (graceful when idle) and the supervisors."""
        self.closing = True
        for task in self._supervisors:
            task.cancel()
        for task in self._supervisors:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await asyncio.gather(*(self._stop_child(slot) for slot in self.slots))
        await asyncio.gather(*self._stopping, return_exceptions=True)

    async def _stop_child(self, slot: Slot) -> None:
        child = slot.child
        if child is None:
            return
        running = slot.flow_run_id is not None
        slot.move(SlotState.STOPPING)
        if not running:
            await child.stop(self.limits.stop_grace, self.limits.kill_grace)
        else:
            await child.kill(self.limits.kill_grace)
        slot.move(SlotState.DOWN)

    # ------------------------------------------------------------------ supervision

    def _message(self, slot: Slot, child: ChildProcess, message: Any) -> None:
        if slot.child is not child:
            return  # a message from a replaced child
        if isinstance(message, Ready):
            slot.ready, slot.telemetry = message, message.telemetry
            slot.last_error = None
        elif isinstance(message, WarmupFailed):
            slot.last_error = f"warm-up failed: {message.error}"
        elif isinstance(message, RunFinished):
            slot.telemetry = message.telemetry
            slot.run_queue.put_nowait(message)
        elif isinstance(message, RunStarted | ChildGone):
            slot.run_queue.put_nowait(message)
        slot.changed.set()

    async def _supervise(self, slot: Slot) -> None:
        backoff = 1.0
        while not self.closing:
            healthy = await self._start_and_warm(slot)
            if not healthy:
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.limits.restart_backoff_max)
                continue
            backoff = 1.0
            await self._serve_until_replaced(slot)

    async def _start_and_warm(self, slot: Slot) -> bool:
        log_path = self.log_dir / f"child-{slot.index}.log" if self.log_dir else None
        child = ChildProcess(slot.spec, lambda m: None, log_path)
        child._on_message = lambda m: self._message(slot, child, m)
        slot.child, slot.ready, slot.replace_reason = child, None, None
        slot.move(SlotState.STARTING)
        slot.starts += 1
        slot.run_queue = asyncio.Queue()
        slot.changed.clear()
        child.start()
        end = time.monotonic() + self.limits.ready_timeout
        while slot.ready is None and not child.gone and time.monotonic() < end:
            slot.changed.clear()
            with contextlib.suppress(TimeoutError):
                left = max(0.0, end - time.monotonic())
                await asyncio.wait_for(slot.changed.wait(), timeout=left)
        if slot.ready is None:
            slot.last_error = slot.last_error or (
                "child exited during warm-up" if child.gone else "warm-up timed out"
            )
            log.error("child %s not ready: %s", slot.index, slot.last_error)
            await child.kill(self.limits.kill_grace)
            slot.move(SlotState.DOWN)
            return False
        log.info(
            "child %s ready (pid %s, %s, warm-up %.0f ms, start %.0f ms)",
            slot.index,
            child.pid,
            slot.ready.device,
            slot.ready.warmup_ms,
            slot.ready.startup_ms,
        )
        slot.runs_done = 0
        await self._set_idle(slot)
        return True

    async def _serve_until_replaced(self, slot: Slot) -> None:
        """Wait while the child serves; return once it must be replaced."""
        child = slot.child
        assert child is not None
        while slot.replace_reason is None:
            if child.gone and slot.state is SlotState.IDLE:
                slot.replace_reason = "child died while idle"
                slot.last_error = slot.replace_reason
                log.error("child %s (pid %s) died while idle", slot.index, child.pid)
                break
            slot.changed.clear()
            await slot.changed.wait()
        slot.move(SlotState.STOPPING)
        log.info("child %s replaced: %s", slot.index, slot.replace_reason)
        # The old child exits while the new one starts (its models load meanwhile).
        stopping = asyncio.create_task(child.stop(self.limits.stop_grace, self.limits.kill_grace))
        self._stopping.add(stopping)
        stopping.add_done_callback(self._stopping.discard)

    async def _set_idle(self, slot: Slot) -> None:
        if not slot.move(SlotState.IDLE):
            return
        async with self._idle:
            self._idle.notify_all()
        if self.on_idle is not None:
            self.on_idle()

    # ------------------------------------------------------------------ runs

    def busy_count(self) -> int:
        return sum(1 for s in self.slots if s.state is SlotState.BUSY)

    def idle_count(self) -> int:
        return sum(
            1 for s in self.slots if s.state is SlotState.IDLE and s.child and not s.child.gone
        )

    async def acquire(self, flow_run_id: str, timeout: float, *, priority: bool = False) -> Slot:
        """An idle warm slot, marked busy for ``flow_run_id``; a ``priority`` run gets the
        next free child before any other waiting run."""
        end = time.monotonic() + timeout
        self.waiting += 1
        self.priority_waiting += priority
        try:
            return await self._acquire(flow_run_id, end, priority)
        finally:
            self.waiting -= 1
            self.priority_waiting -= priority

    async def _acquire(self, flow_run_id: str, end: float, priority: bool) -> Slot:
        async with self._idle:
            while True:
                for slot in self.slots:
                    if not priority and self.priority_waiting:
                        break  # a priority run is waiting: it goes first
                    if slot.state is SlotState.IDLE and slot.child and not slot.child.gone:
                        slot.move(SlotState.BUSY, flow_run_id)
                        slot.run_queue = asyncio.Queue()
                        return slot
                left = end - time.monotonic()
                if left <= 0 or self.closing:
                    raise NoChildReady("no warm child became idle in time")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._idle.wait(), timeout=min(left, 0.5))

    async def release(self, slot: Slot) -> None:
        """The run on ``slot`` is over and its child is healthy: recycle it or make it idle."""
        slot.runs_done += 1
        tel = slot.telemetry
        if slot.runs_done >= self.limits.max_runs:
            self.replace(slot, f"recycled after {slot.runs_done} runs")
        elif tel is not None and tel.rss_mb > self.limits.max_rss_mb:
            self.replace(slot, f"recycled: RSS {tel.rss_mb:.0f} MB > {self.limits.max_rss_mb:.0f}")
        else:
            await self._set_idle(slot)

    async def release_unused(self, slot: Slot) -> None:
        """Give back a slot acquired for a run that was not sent to its child after all."""
        await self._set_idle(slot)

    def replace(self, slot: Slot, reason: str) -> None:
        """Have the supervisor stop this slot's child and start a fresh one."""
        slot.move(SlotState.STOPPING)
        slot.replace_reason = reason
        slot.changed.set()

    async def kill_child(self, slot: Slot, reason: str, sigterm_first: bool = True) -> int | None:
        """Kill the slot's child now (SIGTERM, SIGKILL after the kill grace, or SIGKILL at
        once without ``sigterm_first``); then replace it."""
        child = slot.child
        code = await child.kill(self.limits.kill_grace, sigterm_first) if child else None
        slot.last_error = reason
        self.replace(slot, reason)
        return code

    def status(self) -> list[dict[str, Any]]:
        return [slot.status() for slot in self.slots]
