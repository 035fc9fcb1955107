"""The ``fuse-faces`` flow: one job attempt through the pipeline (``tasks.stages.PIPELINE``):
load → moderate_inputs → detect → align → fuse → enhance → postprocess → quality →
moderate_result → store.

Parameters mirror ``flows.params.FuseFacesParams``. It is a one-job run of the driver that
``fuse-batch`` uses (``flows.run``): every stage runs on the main thread under
``flows.deadline.StageGuard``, inline by default, or as a sync task run when the settings'
``stage_task_runs`` is ``always`` (timeout ``min(stage budget, deadline_at - now)`` on
every attempt; retries stop for permanent errors or when the time left is below the
stage's expected cost), the moderation stages are skipped when the settings' policy turns
them off, enhance when the job chose no enhancer. A run started after its deadline fails at
once, before loading settings or models, and so does one whose parameters are not bound to
its job (``flows.binding``: ``run_binding_invalid``). Inputs come from, and the result goes to, the
storage block named by ``storage_block``; the flow returns the small ``ResultRef`` dict
(never image bytes). A failure is written as the job's ``JobFailure`` record and ends the
run ``Failed`` with the typed error's ``"[code] message"``.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from prefect import flow, get_run_logger
from prefect.states import Failed, State

from flows.artifacts import OperatorView, wait_for_operator_view
from flows.attempt import failed, start_attempt
from flows.deadline import alarm_timeouts_available
from flows.outcome import record_failure
from flows.params import (
    DEFAULT_SETTINGS_BLOCK,
    DEFAULT_SIGNING_BLOCK,
    DEFAULT_STORAGE_BLOCK,
    FLOW_NAME,
    JobAttempt,
)
from flows.run import run_jobs
from tasks.errors import FaceFlowError
from tasks.options import FusionOptions

JOB_FLOW_OPTIONS: dict[str, Any] = {
    "persist_result": False,  # results are images in storage; the run returns a small ref
    "retries": 0,  # a failed attempt is re-dispatched by the relay, under the same deadline
    "validate_parameters": True,
    "log_prints": False,
    "on_completion": [wait_for_operator_view],
    "on_failure": [wait_for_operator_view],
}
"""``@flow`` options shared by the job flows (``fuse-faces`` and ``fuse-batch``)."""


@flow(name=FLOW_NAME, flow_run_name="{job_id}", **JOB_FLOW_OPTIONS)
def fuse_faces(
    job_id: str,
    owner_id: str,
    source_key: str,
    target_key: str,
    deadline_at: datetime,
    options: FusionOptions | None = None,
    attempt: int = 1,
    extra_source_keys: list[str] | None = None,
    reference_keys: list[str] | None = None,
    storage_block: str = DEFAULT_STORAGE_BLOCK,
    settings_block: str = DEFAULT_SETTINGS_BLOCK,
    binding: str | None = None,
    signing_block: str = DEFAULT_SIGNING_BLOCK,
) -> dict[str, Any] | State[Any]:
    """Fuse the source face into the target photo for one job attempt.

    Returns ``ResultRef.model_dump(mode="json")``; on failure the attempt's ``JobFailure``
    is written to storage and the run ends ``Failed`` with the message ``"[code] message"``
    of the typed error. Parameters not bound to the job (``binding``, ``flows.binding``)
    fail it with ``run_binding_invalid`` before any input is read.
    """
    spec = JobAttempt.of_run(locals())
    logger = get_run_logger()
    try:
        start_attempt(
            spec,
            storage_block=storage_block,
            settings_block=settings_block,
            signing_block=signing_block,
        )
        if not alarm_timeouts_available():
            logger.warning(
                "Stage timeouts cannot interrupt blocking calls here (not the main thread, or "
                "another SIGALRM handler is installed): a stuck stage may overrun the deadline."
            )
        (job,) = run_jobs(
            [spec],
            storage_block=storage_block,
            settings_block=settings_block,
            signing_block=signing_block,
            view=lambda stages: OperatorView(job_id, attempt, stages),
        )
    except Exception as exc:
        record_failure(storage_block, job_id, attempt, exc)
        return failed(exc, f"Job {job_id} attempt {attempt}")
    if job.ref is None or job.outcome != "succeeded":
        error = job.work.error or FaceFlowError(detail=f"ended {job.outcome}")
        return Failed(message=str(error), data=error)
    logging.getLogger("faceflow.flows.fuse").debug("timings %s", job.work.timings_ms)
    return job.ref.model_dump(mode="json")
