"""The ``faceflow-gpu`` Prefect worker: warm children, hard deadlines, sub-second dispatch.

Prefect imports ``faceflow.worker.worker`` (the ``prefect.collections`` entry point
``faceflow``), which registers the worker type, so ``prefect worker start`` finds it:

    prefect work-pool create gpu --type faceflow-gpu \\
        --base-job-template work_pools/faceflow-gpu.json
    prefect worker start --pool gpu --type faceflow-gpu     # or: faceflow worker start

The worker keeps one warm child per GPU (``CUDA_VISIBLE_DEVICES`` pinned; one unpinned
child without GPUs), each with the pipeline imported and its models loaded, and runs each
flow run inside an idle child through Prefect's engine. Worker settings come from
``FACEFLOW_WORKER_*`` variables (``faceflow.worker.settings``: children, gpus,
max_runs_per_child, max_rss_mb, kill_grace_s, drain_grace_s, prefetch_runs, health_port,
...); per-run settings (``deadline_grace_seconds``, ``working_dir``, ``env``, ...) are job
variables of the pool. ``FACEFLOW_WORKER_HEALTH_PORT`` serves ``/health`` (liveness),
``/ready`` (a child has loaded its models and passed warm-up) and ``/status`` on 127.0.0.1.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from faceflow.worker.job import FaceFlowJobConfiguration, FaceFlowVariables
    from faceflow.worker.worker import WORKER_TYPE, FaceFlowGpuWorker

__all__ = ["WORKER_TYPE", "FaceFlowGpuWorker", "FaceFlowJobConfiguration", "FaceFlowVariables"]

_LAZY = {
    "WORKER_TYPE": "faceflow.worker.worker",
    "FaceFlowGpuWorker": "faceflow.worker.worker",
    "FaceFlowJobConfiguration": "faceflow.worker.job",
    "FaceFlowVariables": "faceflow.worker.job",
}


def __getattr__(name: str) -> Any:
    """Import Prefect only when the worker is used (``faceflow worker --help`` stays fast)."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_LAZY[name]), name)
