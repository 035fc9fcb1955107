"""A warm child: imports the pipeline, loads the models once, then runs flow runs.

Started by the worker as ``python -m faceflow.worker.child --fd N`` in its own session,
with ``CUDA_VISIBLE_DEVICES`` pinned in its environment. Fd ``N`` is one end of a socket
pair wrapped as a ``multiprocessing`` connection; the first message is the ``ChildSpec``.

The child runs each flow run through ``prefect.flow_engine.run_flow`` inside one
long-lived Prefect client context, so the run is a normal Prefect flow run. Prefect's
flow-run heartbeat thread is disabled here by default (the parent supervises liveness);
it would otherwise add ≈ 0.8 s to every ``run_flow`` return. Its console logging is
plain (``plain_console``) unless the spec keeps Prefect's rich handler.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any
from uuid import UUID

from faceflow.environ import patched_environ
from faceflow.worker.memory import keep_heap, release_memory, rss_mb
from faceflow.worker.protocol import (
    ChildSpec,
    Ready,
    RunClaim,
    RunFinished,
    RunRequest,
    RunStarted,
    Shutdown,
    Telemetry,
    WarmupFailed,
)

FlowCacheKey = tuple[str, str]

STORAGE_TTL_S = 30.0
"""How long the child uses the default result storage it resolved while idle (s)."""


def model_loads() -> dict[str, int]:
    """Loads per model name so far in this process (``tasks.models.MODEL_CACHE``)."""
    from tasks.models import MODEL_CACHE

    loads: dict[str, int] = {}
    for (name, _device, _providers), count in MODEL_CACHE.loads.items():
        loads[name] = loads.get(name, 0) + count
    return loads


def gpu_info() -> dict[str, Any]:
    """``tasks.gpu.gpu_stats()`` of the GPU this child is pinned to, plus the GPU memory
    this process holds on it (``process_memory_mb``, None without NVML)."""
    from tasks.gpu import gpu_stats

    info = gpu_stats().as_dict()
    info["process_memory_mb"] = process_gpu_memory_mb() if info.get("available") else None
    return info


def process_gpu_memory_mb() -> float | None:
    """GPU memory used by this process on its (first visible) GPU, from pynvml."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
        handle = pynvml.nvmlDeviceGetHandleByIndex(int(visible) if visible.isdigit() else 0)
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == os.getpid() and proc.usedGpuMemory is not None:
                return float(proc.usedGpuMemory) / 2**20
        return 0.0
    except Exception:
        return None
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def plain_console() -> int:
    """Replace Prefect's rich console handler (``PrefectConsoleHandler``, on the root logger
    and wherever Prefect's logging config put it) by a plain ``logging.StreamHandler`` with
    the same stream, level, formatter and filters: the same lines, without rich's rendering
    (≈ 3-5 ms of the run's thread per log line on this machine, ≈ 40 ms per run). Colours
    on a terminal are lost; logs sent to the API are untouched. Returns how many loggers
    had one."""
    from prefect.logging.handlers import PrefectConsoleHandler

    plain: dict[int, logging.StreamHandler[Any]] = {}
    replaced = 0
    manager = logging.Logger.manager
    loggers = [logging.getLogger()] + [
        logger for logger in list(manager.loggerDict.values()) if isinstance(logger, logging.Logger)
    ]
    for logger in loggers:
        for i, handler in enumerate(list(logger.handlers)):
            if not isinstance(handler, PrefectConsoleHandler):
                continue
            if id(handler) not in plain:
                new = logging.StreamHandler(handler.stream)
                new.setLevel(handler.level)
                new.setFormatter(handler.formatter)
                new.filters = list(handler.filters)
                plain[id(handler)] = new
            logger.handlers[i] = plain[id(handler)]
            replaced += 1
    return replaced


@contextlib.contextmanager
def run_environment(env: dict[str, str], working_dir: str | None) -> Iterator[None]:
    """Apply a run's environment variables and working directory, restored afterwards."""
    cwd = os.getcwd()
    with patched_environ(env):
        if working_dir:
            os.chdir(working_dir)
            if working_dir not in sys.path:
                sys.path.insert(0, working_dir)
        try:
            yield
        finally:
            os.chdir(cwd)


class WarmChild:
    """The child's state: its spec, loaded flows and run counter."""

    def __init__(self, conn: Connection, spec: ChildSpec) -> None:
        self.conn = conn
        self.spec = spec
        self.flows: dict[FlowCacheKey, Any] = {}
        self.variants: dict[tuple[int, tuple[str, ...]], tuple[Any, Any]] = {}
        self.default_storage: tuple[float, Any] | None = None
        self.runs_done = 0
        self.trim_above_mb: float | None = None  # set once warm (``release_memory``)

    def telemetry(self) -> Telemetry:
        return Telemetry(
            pid=os.getpid(),
            runs_done=self.runs_done,
            model_loads=model_loads(),
            rss_mb=rss_mb(),
            gpu=gpu_info(),
        )

    def warm_up(self) -> tuple[str, float]:
        """Load the models and run the tiny warm-up inference; returns (device, ms)."""
        from tasks.pipeline import PipelineContext, warm_up

        ctx = PipelineContext.for_this_machine(model_dir=self.spec.model_dir)
        ms = warm_up(ctx, self.spec.detector, self.spec.fuser)  # type: ignore[arg-type]
        return ctx.device, ms

    def load_flow(self, entrypoint: str, working_dir: str | None) -> Any:
        """The flow object of ``entrypoint`` (loaded once per entrypoint and directory)."""
        key = (entrypoint, working_dir or os.getcwd())
        if key not in self.flows:
            from prefect.flows import load_flow_from_entrypoint

            with run_environment({}, working_dir):
                self.flows[key] = load_flow_from_entrypoint(entrypoint, use_placeholder_flow=False)
        return self.flows[key]

    def named_already(self, flow: Any, flow_run: Any) -> Any:
        """``flow``, or a copy of it that does not rename ``flow_run`` when the run already
        has the name the flow's ``flow_run_name`` template gives (the relay names every run
        by its job id): Prefect's engine would otherwise send one rename request per run."""
        template = getattr(flow, "flow_run_name", None)
        if not isinstance(template, str):
            return flow
        try:
            wanted = template.format(**(flow_run.parameters or {}))
        except (KeyError, IndexError, ValueError, AttributeError):
            return flow
        if wanted != flow_run.name:
            return flow
        return self.variant(flow, flow_run_name=None)

    def variant(self, flow: Any, **changes: Any) -> Any:
        """A copy of ``flow`` with the attributes ``changes`` set, made once and kept while
        ``flow`` and the values stay the same objects (one copy per flow and attributes:
        a new value replaces the copy, so nothing accumulates)."""
        key = (id(flow), tuple(sorted(changes)))
        kept = self.variants.get(key)
        if (
            kept is None
            or kept[0] is not flow
            or any(getattr(kept[1], name) is not value for name, value in changes.items())
        ):
            copied = copy.copy(flow)
            for name, value in changes.items():
                setattr(copied, name, value)
            kept = self.variants[key] = (flow, copied)
        return kept[1]

    def resolve_default_storage(self) -> None:
        """Resolve Prefect's default result storage now, while the child is idle: the
        storage Prefect's engine looks up at the start of every run (the server's default
        result storage block, read over ``GET /api/admin/storage``, else the local
        result path). A failed read leaves the lookup to the engine."""
        try:
            from prefect.results import get_default_result_storage

            storage = get_default_result_storage(_sync=True)  # type: ignore[call-arg]
        except Exception:
            self.default_storage = None
            return
        self.default_storage = (time.monotonic(), storage)

    def with_default_storage(self, flow: Any) -> Any:
        """``flow``, or a copy of it whose ``result_storage`` is the default result storage
        resolved while idle (``resolve_default_storage``, at most ``STORAGE_TTL_S`` old), so
        that the engine need not look it up between ``Running`` and the flow's first line.
        The run's result store is the one the engine would have made: same storage, same
        persistence (``persist_result`` is the flow's, not derived from the storage). A
        flow with a storage of its own, or no fresh resolution, is left as it is."""
        if getattr(flow, "result_storage", None) is not None or self.default_storage is None:
            return flow
        at, storage = self.default_storage
        if time.monotonic() - at > STORAGE_TTL_S:
            return flow
        return self.variant(flow, result_storage=storage)

    def next_message(self) -> Any:
        """The worker's next message, with the default result storage kept resolved: every
        ``STORAGE_TTL_S`` / 2 s while the child is idle, and before a run when the last
        resolution is too old to use (a child that is never idle pays one read per
        ``STORAGE_TTL_S``, not one per run)."""
        while True:
            at = self.default_storage[0] if self.default_storage is not None else None
            age = float("inf") if at is None else time.monotonic() - at
            if age >= STORAGE_TTL_S or (age >= STORAGE_TTL_S / 2 and not self.conn.poll(0)):
                self.resolve_default_storage()
                if self.default_storage is None:  # Prefect unreachable: the engine's lookup
                    return self.conn.recv()
                continue
            if self.conn.poll(max(0.0, STORAGE_TTL_S / 2 - age)):
                return self.conn.recv()

    def preload(self) -> None:
        """Import the configured flows now so the first run does not pay for it."""
        base = Path(self.spec.working_dir or os.getcwd())
        for entrypoint in self.spec.preload:
            if not (base / entrypoint.rsplit(":", 1)[0]).is_file():
                continue  # not deployed here
            try:
                self.load_flow(entrypoint, self.spec.working_dir)
            except Exception as exc:  # a broken flow fails its runs, not the child
                msg = f"faceflow-gpu child: preload of {entrypoint} failed: {exc!r}"
                print(msg, file=sys.stderr)

    @staticmethod
    def flow_run_of(request: RunRequest, client: Any) -> Any:
        """The request's flow run: the one the worker sent, else read from the API."""
        if request.flow_run_json is not None:
            from prefect.client.schemas.objects import FlowRun

            flow_run = FlowRun.model_validate_json(request.flow_run_json)
            if str(flow_run.id) == request.flow_run_id:
                return flow_run
        return client.read_flow_run(UUID(request.flow_run_id))

    def run_start(
        self, client: Any, flow_run: Any, claim: RunClaim | None
    ) -> contextlib.AbstractContextManager[Any]:
        """The engine's PATCH and re-read of ``flow_run`` off its path, and its ``Running``
        as the run's ``claim`` (``run_start``), unless the spec keeps Prefect's own start
        (the worker sends no claim then)."""
        if not self.spec.lean_run_start:
            return contextlib.nullcontext()
        from faceflow.worker.run_start import RunStart

        return RunStart(client, flow_run, claim).installed()

    def run(self, request: RunRequest, client: Any) -> RunFinished:
        """Run one flow run through Prefect's engine; never raises."""
        from prefect.exceptions import Abort
        from prefect.flow_engine import run_flow

        start = time.perf_counter()
        state_type = state_message = error = not_started = None
        try:
            working_dir = request.working_dir or self.spec.working_dir
            flow = self.load_flow(request.entrypoint, working_dir)
            flow_run = self.flow_run_of(request, client)
            flow = self.with_default_storage(self.named_already(flow, flow_run))
            self.conn.send(RunStarted(request.flow_run_id, (time.perf_counter() - start) * 1e3))
            starting = self.run_start(client, flow_run, request.claim)
            with run_environment(request.env, working_dir), starting:
                state = run_flow(flow, flow_run=flow_run, return_type="state")
            state_type = str(state.type.value)  # type: ignore[union-attr]
            state_message = state.message  # type: ignore[union-attr]
        except Abort as exc:  # Prefect refused the run's start (its claim: another has it)
            not_started = str(exc)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        self.runs_done += 1
        release_memory(self.trim_above_mb)  # a large job's peak goes back to the OS
        return RunFinished(
            flow_run_id=request.flow_run_id,
            state_type=state_type,
            state_message=state_message,
            run_ms=(time.perf_counter() - start) * 1e3,
            telemetry=self.telemetry(),
            error=error,
            not_started=not_started,
        )

    def serve(self, ready: Ready) -> None:
        """Report ``ready``, then answer run requests until ``Shutdown`` or EOF."""
        from prefect.context import SyncClientContext

        with SyncClientContext.get_or_create() as client_ctx:
            client_ctx.client.api_healthcheck()  # opens the connection before the first run
            if not self.spec.rich_console:
                plain_console()
            if self.spec.shared_suspension_observer:
                from faceflow.worker.suspension import install_shared_observer

                install_shared_observer()
            self.preload()
            self.resolve_default_storage()
            freeze_heap()
            if self.spec.heap_keep_mb > 0:  # the heap keeps that much above the warm size
                self.trim_above_mb = rss_mb() + self.spec.heap_keep_mb
            self.conn.send(ready)
            while True:
                try:
                    message = self.next_message()
                except EOFError:
                    return
                if isinstance(message, Shutdown):
                    return
                if isinstance(message, RunRequest):
                    self.conn.send(self.run(message, client_ctx.client))

    def start(self, started_at: float) -> None:
        """Warm up, report ``Ready``, then serve."""
        try:
            device, warmup_ms = self.warm_up()
        except Exception as exc:
            self.conn.send(WarmupFailed(f"{type(exc).__name__}: {exc}"))
            raise SystemExit(3) from exc
        ready = Ready(
            device=device,
            warmup_ms=warmup_ms,
            startup_ms=(time.perf_counter() - started_at) * 1e3,
            telemetry=self.telemetry(),
        )
        if self.spec.flow_heartbeats:
            self.serve(ready)
            return
        from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

        with temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
            self.serve(ready)


def freeze_heap() -> None:
    """Collect the warm-up's garbage, then move every object left (modules, models, Prefect's
    client) to the permanent generation: a full collection later scans only what the runs
    allocated (26 ms in a burst's first batch run on a 2-core machine) instead of the whole
    warm heap (100-190 ms). Frozen objects are left to reference counting alone: a model
    dropped later whose objects form cycles keeps its memory until the child is recycled."""
    gc.collect()
    gc.freeze()


def flush_and_exit(code: int = 0) -> None:
    """Send the logs and events still queued, then exit without Prefect's slow teardown."""
    with contextlib.suppress(Exception):
        from prefect.logging.handlers import APILogWorker

        APILogWorker.drain_all(timeout=2)
    with contextlib.suppress(Exception):
        from prefect.events.worker import EventsWorker

        EventsWorker.drain_all(timeout=2)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this child when the worker dies (no orphans after a kill -9)."""
    with contextlib.suppress(Exception):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGKILL)


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m faceflow.worker.child``."""
    started_at = time.perf_counter()
    die_with_parent()
    parser = argparse.ArgumentParser(description="faceflow-gpu warm child (started by the worker)")
    parser.add_argument("--fd", type=int, required=True, help="inherited socket fd")
    args = parser.parse_args(argv)
    conn = Connection(args.fd)
    spec = conn.recv()
    if not isinstance(spec, ChildSpec):
        raise SystemExit(2)
    keep_heap(spec.heap_keep_mb)  # before warm-up: the models' blocks come from the heap too
    os.environ.update(spec.env)
    if spec.working_dir:
        os.chdir(spec.working_dir)
        sys.path.insert(0, spec.working_dir)
    WarmChild(conn, spec).start(started_at)
    flush_and_exit(0)


if __name__ == "__main__":
    main()
