"""The ``fuse-batch`` flow: several job attempts in one flow run, each with its own outcome.

The relay's dispatch puts the due jobs that can share a run (same lane, detector and
fuser) into one ``fuse-batch`` run when more than one is waiting (``FuseBatchParams``);
a job alone still gets its own ``fuse-faces`` run. Both are drivers of the same pipeline
(``flows.run.run_jobs`` over ``tasks.stages.PIPELINE``): every stage inline, once for the
whole batch (one task run per stage when the settings' ``stage_task_runs`` is ``batches``
or ``always``), MTCNN on every job's images in batched calls, and per job its own deadline,
outcome (a ``JobFailure`` record for a failed job, its result and ``ResultRef`` sidecar for
a successful one), fencing and stop markers (see ``flows.run``). The warm worker kills the
run past its ``deadline_at``, the latest of the jobs', plus grace.

The run itself ends ``Completed`` with ``{job id: outcome}``; it fails only for what no job
could survive (settings or storage block unusable), with the ``[code] message`` of the
error as ``fuse-faces`` does, after writing that failure for every job without an outcome.
A job whose parameters are not bound to it (``flows.binding``) is refused before the run
loads anything (``run_binding_invalid``); its batch-mates go on.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from prefect import flow, get_run_logger
from prefect.states import State

from flows.attempt import failed
from flows.batch_view import BatchView, JobRow
from flows.fuse import JOB_FLOW_OPTIONS
from flows.outcome import admit_bound, record_unsettled
from flows.params import (
    BATCH_FLOW_NAME,
    DEFAULT_SETTINGS_BLOCK,
    DEFAULT_SIGNING_BLOCK,
    DEFAULT_STORAGE_BLOCK,
    JobAttempt,
)
from flows.run import run_jobs


@flow(name=BATCH_FLOW_NAME, **JOB_FLOW_OPTIONS)
def fuse_batch(
    jobs: list[JobAttempt],
    deadline_at: datetime,
    storage_block: str = DEFAULT_STORAGE_BLOCK,
    settings_block: str = DEFAULT_SETTINGS_BLOCK,
    signing_block: str = DEFAULT_SIGNING_BLOCK,
) -> dict[str, str] | State[Any]:
    """Fuse every job of the batch; returns ``{job id: outcome}`` (``succeeded``, an error
    code, or ``stopped``). Fails only when no job could be attempted."""
    logger = get_run_logger()
    logger.info(
        "Batch of %d jobs: %s", len(jobs), ", ".join(f"{j.job_id}#{j.attempt}" for j in jobs)
    )
    bound, refused = admit_bound(
        jobs,
        storage_block=storage_block,
        settings_block=settings_block,
        signing_block=signing_block,
    )
    if not bound:
        return refused
    try:
        done = run_jobs(
            bound,
            storage_block=storage_block,
            settings_block=settings_block,
            signing_block=signing_block,
            view=lambda stages: BatchView([JobRow(j.job_id, j.attempt) for j in bound], stages),
            batch=True,
        )
    except Exception as exc:
        record_unsettled(bound, storage_block, exc)
        return failed(exc, f"Batch of {len(jobs)} jobs")
    return {**refused, **{job.spec.job_id: job.outcome for job in done}}
