"""A small flow for the warm-worker tests: the real pipeline, plus a blocking C call.

It fuses the sample astronaut onto the sample Grace Hopper photo, writes the PNG and a
JSON report (pid, model loads, first-line time) under ``out_dir``, and can block in
``libc.usleep`` (a C call that Python cannot interrupt) before doing so.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import signal
import time
from datetime import datetime
from pathlib import Path

from prefect import flow
from prefect.runtime import flow_run

_PINNED: list[bytes] = []


def _hold_heap(mb: int) -> float:
    """Allocate ``mb`` MB in 10 KB blocks (malloc's heap, not mmap) and free them all
    but one allocated after them, which stays (pinning the top of the heap, as a large
    job's long-lived objects do, so ``free`` alone gives nothing back); the RSS (MiB) then."""
    from faceflow.worker.memory import rss_mb

    blocks = [bytes(10_000) for _ in range(mb * 100)]
    _PINNED.append(bytes(10_000))
    peak = rss_mb()
    del blocks
    return peak


@flow(name="warm-probe", persist_result=False)
def warm_probe(
    out_dir: str,
    deadline_at: datetime | None = None,
    c_sleep_s: float = 0.0,
    block_sigterm: bool = False,
    fuse: bool = True,
    heap_mb: int = 0,
    cancel_at_end: bool = False,
) -> str:
    """Fuse the sample photos (unless ``fuse`` is false), optionally blocking in C first
    (with SIGTERM blocked when ``block_sigterm``, so only SIGKILL can stop it); with
    ``heap_mb``, hold that much heap and free it (``_hold_heap``) before returning; with
    ``cancel_at_end``, the run is set ``Cancelling`` just before it returns (a cancel that
    arrives as the run ends: Prefect then refuses the engine's ``Completed``)."""
    first_line = time.time()
    run_id = str(flow_run.id)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "first_line": first_line,
        "pid": os.getpid(),
        "flow_run_id": run_id,
        "gc_frozen": gc.get_freeze_count(),
    }
    (out / f"{run_id}.started.json").write_text(json.dumps(report))
    if block_sigterm:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    if c_sleep_s > 0:
        ctypes.CDLL(None).usleep(int(c_sleep_s * 1e6))
    if fuse:
        from faceflow import samples
        from tasks.models import MODEL_CACHE
        from tasks.pipeline import PipelineContext
        from tasks.stages import fuse_images

        result = fuse_images(
            samples.astronaut_jpeg_bytes(),
            samples.grace_hopper_jpeg_bytes(),
            ctx=PipelineContext.for_this_machine(),
        )
        (out / f"{run_id}.png").write_bytes(result.data)
        report["model_loads"] = {k[0]: n for k, n in MODEL_CACHE.loads.items()}
        report["pipeline_ms"] = sum(result.timings_ms.values())
    if heap_mb > 0:
        report["heap_peak_rss_mb"] = _hold_heap(heap_mb)
    report["last_line"] = time.time()
    (out / f"{run_id}.json").write_text(json.dumps(report))
    if cancel_at_end:
        from prefect.client.orchestration import get_client
        from prefect.states import Cancelling

        with get_client(sync_client=True) as client:
            client.set_flow_run_state(flow_run.id, Cancelling(), force=True)
    return run_id
