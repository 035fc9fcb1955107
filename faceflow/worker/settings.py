"""Worker-level settings of the ``faceflow-gpu`` worker (``FACEFLOW_WORKER_*``).

``prefect worker start --type faceflow-gpu`` takes no custom options, so the pool of warm
children is configured from the environment (or by ``faceflow worker``'s options, which
set the same fields). Per-run settings (deadline grace, env, working dir) are job
variables in the work pool's base job template instead.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from faceflow.worker.memory import HEAP_KEEP_MB
from faceflow.worker.protocol import ChildSpec

DEFAULT_ENTRYPOINT = "flows/fuse.py:fuse_faces"
BATCH_ENTRYPOINT = "flows/batch.py:fuse_batch"


class WorkerSettings(BaseSettings):
    """How many warm children, what they load, when they are recycled, where status goes."""

    model_config = SettingsConfigDict(env_prefix="FACEFLOW_WORKER_", extra="ignore")

    children: int | None = Field(
        default=None,
        ge=1,
        description="Warm children; default one per visible GPU (1 without GPUs).",
    )
    gpus: str | None = Field(
        default=None,
        description="Comma-separated GPU indices to pin children to (default: every GPU seen).",
    )
    detector: str = Field(default="mtcnn", description="Detector the children warm up.")
    fuser: str = Field(default="classic", description="Fuser the children warm up.")
    model_dir: str | None = Field(
        default=None, description="Directory with operator-provided models."
    )
    preload: list[str] = Field(
        default_factory=lambda: [DEFAULT_ENTRYPOINT, BATCH_ENTRYPOINT],
        description="Flow entrypoints imported at warm-up (missing ones are skipped).",
    )
    working_dir: str | None = Field(
        default=None, description="Directory flow entrypoints are relative to (default: the cwd)."
    )
    max_runs_per_child: int = Field(
        default=500, ge=1, description="Recycle a child after this many runs."
    )
    max_rss_mb: float = Field(
        default=8192.0, gt=0, description="Recycle a child above this RSS (MiB)."
    )
    heap_keep_mb: float = Field(
        default=HEAP_KEEP_MB,
        ge=0,
        description="Freed memory a child's heap keeps for its next run (MiB); what it holds "
        "free above this goes back to the OS after a run. 0: all of it goes back after every "
        "run, and the next run touches fresh pages (page faults: 0.3-1 s of system time a "
        "batch run on a 2-core machine).",
    )
    ready_timeout_s: float = Field(default=300.0, gt=0, description="Warm-up time limit per child.")
    acquire_timeout_s: float = Field(
        default=60.0, gt=0, description="Wait for an idle child per run."
    )
    kill_grace_s: float = Field(
        default=0.5, ge=0, description="SIGTERM → SIGKILL grace for a child."
    )
    stop_grace_s: float = Field(
        default=5.0, ge=0, description="Wait for a child to exit when recycled."
    )
    drain_grace_s: float = Field(
        default=30.0, ge=0, description="On SIGTERM, wait this long for runs."
    )
    watch_interval_s: float = Field(
        default=0.5, gt=0, description="How often a running run's state is read (cancellation)."
    )
    prefetch_runs: int = Field(
        default=1,
        ge=0,
        description="Runs claimed ahead while every child is busy (started the moment one "
        "is free); 0 leaves queued runs to other workers.",
    )
    priority_queue: str = Field(
        default="priority",
        description="The pool's priority work queue: its runs start before runs claimed "
        "ahead from other queues, and one of them may be claimed while every prefetch place "
        "is taken (so a burst of normal runs delays it by one run at most).",
    )
    query_seconds: float = Field(
        default=1.0, gt=0, description="Polling interval for scheduled runs."
    )
    event_pickup: bool = Field(
        default=True, description="Poll at once on a Scheduled event of the pool."
    )
    flow_heartbeats: bool = Field(
        default=False,
        description="Keep Prefect's flow-run heartbeat thread in children (+≈0.8 s/run).",
    )
    shared_suspension_observer: bool = Field(
        default=True,
        description="One suspension observer per child instead of one per run (-0.2 s/run).",
    )
    lean_run_start: bool = Field(
        default=True,
        description="Take the engine's PATCH of a run and its re-read after Running off the "
        "run's path (faceflow.worker.run_start); false: Prefect's own requests.",
    )
    claim_on_start: bool = Field(
        default=True,
        description="Claim a run that an idle child takes at once with the child's Running "
        "proposal instead of a Pending state first (one orchestrated API call fewer per run; "
        "the run goes Scheduled → Running). Needs lean_run_start; runs claimed ahead and "
        "deployments with a concurrency limit are claimed with Pending as Prefect does. "
        "With several workers on one pool every claim of a run carries one transition id, "
        "and a child whose claim Prefect accepts after the run started or ended stops before "
        "the flow runs (docs/reliability.md, finding 13).",
    )
    rich_console: bool = Field(
        default=False,
        description="Keep Prefect's rich console handler in children (colours on a terminal; "
        "≈ 3-5 ms per log line here) instead of a plain one writing the same lines.",
    )
    health_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="Serve /health, /ready, /status on 127.0.0.1:PORT.",
    )
    status_file: Path | None = Field(
        default=None, description="Write the status JSON here on changes."
    )
    log_dir: Path | None = Field(
        default=None, description="Children's stdout/stderr logs (else inherit)."
    )
    state_dir: Path | None = Field(
        default=None,
        description="Where the worker journals the runs it has claimed, per pool and worker "
        "name (default: $PREFECT_HOME/faceflow-worker); a restart with the same name marks "
        "the runs its dead predecessor left as Crashed (faceflow.worker.claims).",
    )
    recover_claims: bool = Field(
        default=True,
        description="At start, end the runs a dead worker of the same pool and name left.",
    )

    def gpu_indices(self) -> list[str]:
        """GPU indices to pin children to; empty without GPUs."""
        if self.gpus is not None:
            return [g.strip() for g in self.gpus.split(",") if g.strip()]
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            return [g.strip() for g in visible.split(",") if g.strip() and g.strip() != "-1"]
        return [str(i) for i in range(_nvml_device_count())]

    def child_specs(self, extra_env: dict[str, str] | None = None) -> list[ChildSpec]:
        """One spec per child, each pinned to one GPU (round robin) when there are GPUs."""
        gpus = self.gpu_indices()
        count = self.children or max(1, len(gpus))
        specs = []
        for index in range(count):
            env = dict(extra_env or {})
            if gpus:
                env["CUDA_VISIBLE_DEVICES"] = gpus[index % len(gpus)]
            specs.append(
                ChildSpec(
                    index=index,
                    env=env,
                    detector=self.detector,
                    fuser=self.fuser,
                    model_dir=self.model_dir,
                    preload=tuple(self.preload),
                    working_dir=self.working_dir,
                    flow_heartbeats=self.flow_heartbeats,
                    shared_suspension_observer=self.shared_suspension_observer,
                    lean_run_start=self.lean_run_start,
                    rich_console=self.rich_console,
                    heap_keep_mb=self.heap_keep_mb,
                )
            )
        return specs


def _nvml_device_count() -> int:
    """GPUs pynvml sees (0 without a driver or pynvml)."""
    try:
        import pynvml
    except ImportError:
        return 0
    try:
        pynvml.nvmlInit()
    except Exception:
        return 0
    try:
        return int(pynvml.nvmlDeviceGetCount())
    except Exception:
        return 0
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
