"""A job's work without the orchestration: what a flow run does for each of its jobs.

The benches compare FaceFlow's throughput with a loop (``bench/warm_worker.py``'s bare
loop) and with Celery (``bench/celery_app.py``) on the same work. ``tasks.stages.fuse_images``
alone is less than a job: a run also reads the job's inputs from the storage block, marks
the result (watermark and signed C2PA manifest: ``FusionSettings.marking`` is
``required`` by default), and writes the result and its ``ResultRef`` sidecar. ``JobWork``
does exactly that, with the pieces a run uses (``flows.run.pipeline_context``,
``flows.run.StoredJob``, ``tasks.stages.run_stages``), on the local stack's storage and
development signing chain under a FaceFlow home (the credentials the stack's signing
block holds): only the Prefect run around it is missing.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from blocks.settings import FusionSettings
    from blocks.storage import ByteStore
    from flows.params import ResultRef
    from tasks.pipeline import PipelineContext


def bench_settings(*, gpu_shaped: bool, stage_task_runs: str | None = None) -> FusionSettings:
    """The fusion settings the benches save as the stack's default block: the defaults, or
    with ``gpu_shaped`` those of a GPU host (one model call in flight:
    ``tasks.batch.model_threads``), although the shaped worker's device is the CPU;
    ``stage_task_runs`` overrides ``FusionSettings.stage_task_runs``."""
    from blocks.settings import FusionSettings

    fields: dict[str, Any] = {"model_threads": 1} if gpu_shaped else {}
    if stage_task_runs:
        fields["stage_task_runs"] = stage_task_runs
    return FusionSettings(**fields)


@dataclass
class JobWork:
    """Runs jobs as a flow run's driver does, in this process (imports torch)."""

    store: ByteStore
    ctx: PipelineContext
    settings: FusionSettings

    @classmethod
    def local(cls, home: Path, settings: FusionSettings) -> JobWork:
        """The worker's pipeline context for ``settings``, marked (when the settings
        require it) with the development chain under ``home``, on its local storage."""
        from blocks.signing import dev_chain
        from blocks.storage import local_storage
        from flows.run import pipeline_context
        from tasks.provenance import Marker

        ctx = pipeline_context(settings)  # no signing block: unmarked, marked below
        if settings.marking == "required":
            ctx = replace(ctx, marker=Marker(dev_chain(home).credentials))
        return cls(cast("ByteStore", local_storage(home)), ctx, settings)

    def run(self, source_key: str, target_key: str) -> ResultRef:
        """One job on the stored inputs: read, every stage, mark, write the result and its
        sidecar under a new job id; the sidecar's ``ResultRef``. Raises the job's error."""
        from flows.params import JobAttempt
        from flows.run import StoredJob
        from tasks.stages import InProcess, Work, run_stages

        spec = JobAttempt(
            job_id=str(uuid.uuid4()),
            owner_id="bench",
            source_key=source_key,
            target_key=target_key,
            deadline_at=datetime.now(UTC) + timedelta(minutes=30),
        )
        io = StoredJob(self.store, spec, self.ctx.device)
        work = Work(io, self.settings.apply_defaults(spec.options), job_id=spec.job_id)
        run_stages([work], self.ctx, InProcess(self.ctx))
        if io.ref is None:  # InProcess raises a job's error: a result was stored
            raise RuntimeError("the job stored no result")
        return io.ref
