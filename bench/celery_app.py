"""The Celery app of ``bench/celery_queue.py``: a classic GPU queue on Redis (issue 12).

One worker, one pool process, one task at a time: acks late, prefetch 1, a hard time
limit, and a task whose pool process dies goes back to the queue. In modes ``real`` and
``gpu`` the pool process loads the pipeline's models once, as it starts
(``worker_process_init``); the worker's parent process never imports torch (it forks the
pool process). Mode ``gpu`` makes the pipeline GPU-shaped there (``bench/gpu_shaped.py``,
as ``bench/warm_worker.py --gpu-ms`` does for Prefect's workers); mode ``sleep`` runs no
pipeline at all.

Inputs travel as storage keys, as most GPU queues do, never the image bytes. With
``BENCH_CELERY_HOME`` set (a FaceFlow home whose local storage holds the inputs), a task
does a FaceFlow job's whole work (``bench.job_work``: inputs read from storage, the
pipeline with the worker's settings, the result marked with the development chain there,
result and ``ResultRef`` sidecar written), so that Celery and FaceFlow run the same work;
without it (the definition before issue 24) the message carries the paths of the input
files, the task runs ``fuse_images`` unmarked and writes its result beside them.

The worker reads its settings from the environment, which the bench sets:
``BENCH_CELERY_REDIS_URL``, ``BENCH_CELERY_MODE`` (``real`` | ``gpu`` | ``sleep``),
``BENCH_CELERY_TIME_LIMIT_S``, ``BENCH_TORCH_THREADS`` (unset: torch's default),
``BENCH_CELERY_HOME`` and, in mode ``gpu``, ``FACEFLOW_BENCH_GPU_MS`` (compute ms per job).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from celery import Celery, Task
from celery.signals import worker_process_init

REDIS_URL_ENV = "BENCH_CELERY_REDIS_URL"
MODE_ENV = "BENCH_CELERY_MODE"
TIME_LIMIT_ENV = "BENCH_CELERY_TIME_LIMIT_S"
THREADS_ENV = "BENCH_TORCH_THREADS"
GPU_MS_ENV = "FACEFLOW_BENCH_GPU_MS"  # bench.gpu_shaped.ENV (that module imports numpy)
HOME_ENV = "BENCH_CELERY_HOME"
PIPELINE_MODES = ("real", "gpu")
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/15"
DEFAULT_TIME_LIMIT_S = 120.0
QUEUE = "faceflow-bench-gpu"
TASK_NAME = "bench.celery_app.fuse"

log = logging.getLogger(__name__)


def make_app(redis_url: str, time_limit_s: float = DEFAULT_TIME_LIMIT_S) -> Celery:
    """A Celery app on ``redis_url`` (broker and result backend), configured as a
    classic GPU queue."""
    app = Celery("faceflow-bench", broker=redis_url, backend=redis_url)
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        task_default_queue=QUEUE,
        task_acks_late=True,  # acked after the task ran: a lost worker's job is redelivered
        task_reject_on_worker_lost=True,  # ... and so is the job of a killed pool process
        worker_prefetch_multiplier=1,  # one reserved message per pool process
        worker_concurrency=1,  # one GPU, one job at a time
        task_time_limit=time_limit_s,  # hard: the pool process is killed past it
        worker_proc_alive_timeout=300.0,  # the pool process loads the models before it is up
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
    )
    return app


app = make_app(
    os.environ.get(REDIS_URL_ENV, DEFAULT_REDIS_URL),
    float(os.environ.get(TIME_LIMIT_ENV, DEFAULT_TIME_LIMIT_S)),
)

_state: dict[str, Any] = {"ctx": None, "job_work": None, "warm_up_ms": 0.0, "torch_threads": 0}


def _pipeline_context() -> Any:
    """The pipeline context of this process, its models loaded on the first call (torch
    threads as the context sets them, or as ``BENCH_TORCH_THREADS`` says; the pipeline
    made GPU-shaped first in mode ``gpu``): with ``BENCH_CELERY_HOME``, that of the
    process's ``JobWork`` (``_state["job_work"]``)."""
    if _state["ctx"] is None:
        start = time.perf_counter()
        gpu = os.environ.get(MODE_ENV) == "gpu"
        if gpu:
            from bench.gpu_shaped import install

            install(float(os.environ[GPU_MS_ENV]))
        import torch

        from tasks.pipeline import PipelineContext, warm_up

        home = os.environ.get(HOME_ENV)
        if home:
            from bench.job_work import JobWork, bench_settings

            _state["job_work"] = JobWork.local(Path(home), bench_settings(gpu_shaped=gpu))
            ctx = _state["job_work"].ctx
        else:
            ctx = PipelineContext.for_this_machine()
        threads = os.environ.get(THREADS_ENV)
        if threads:
            torch.set_num_threads(int(threads))
        warm_up(ctx)
        _state["warm_up_ms"] = (time.perf_counter() - start) * 1e3
        _state["torch_threads"] = torch.get_num_threads()
        _state["ctx"] = ctx
    return _state["ctx"]


@worker_process_init.connect
def _load_models(**_: Any) -> None:
    """Load the models as the pool process starts (modes ``real``, ``gpu``); a failure is
    logged and the first task tries again, so that the bench sees it as a failed task."""
    if os.environ.get(MODE_ENV, "real") not in PIPELINE_MODES:
        return
    try:
        _pipeline_context()
    except Exception:
        log.exception("model warm-up failed in the pool process")


@app.task(bind=True, name=TASK_NAME)
def fuse(self: Task, job: dict[str, Any]) -> dict[str, Any]:
    """One job: read the inputs at their keys, fuse (or sleep), write the result; returns
    wall-clock start/end (epoch s) and the compute and whole-task times (ms). In mode
    ``gpu`` the first job on given inputs runs the real stages (the untimed one)."""
    started = time.time()
    t0 = time.perf_counter()
    if job.get("source_key") and job["mode"] in PIPELINE_MODES:  # a FaceFlow job's work
        _pipeline_context()
        c0 = time.perf_counter()
        ref = _state["job_work"].run(job["source_key"], job["target_key"])
        compute_ms = (time.perf_counter() - c0) * 1e3  # all of it: reads, marks, writes
        faces, output = ref.faces_replaced, ref.key
    else:
        source = Path(job["source"]).read_bytes()
        target = Path(job["target"]).read_bytes()
        c0 = time.perf_counter()
        if job["mode"] in PIPELINE_MODES:
            from tasks.stages import fuse_images

            result = fuse_images(source, target, ctx=_pipeline_context())
            data, faces = result.data, result.faces_replaced
        else:
            time.sleep(float(job["sleep_ms"]) / 1e3)  # releases the GIL, as a GPU kernel would
            data, faces = target, 0
        compute_ms = (time.perf_counter() - c0) * 1e3
        out = Path(job["out_dir"]) / f"{self.request.id}.out"
        out.write_bytes(data)
        output = str(out)
    return {
        "started": started,
        "ended": time.time(),
        "compute_ms": compute_ms,
        "task_ms": (time.perf_counter() - t0) * 1e3,
        "warm_up_ms": _state["warm_up_ms"],
        "torch_threads": _state["torch_threads"],
        "pid": os.getpid(),
        "faces_replaced": faces,
        "output": output,
    }
