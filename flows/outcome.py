"""What the job flows do at their entry points, before and after the pipeline: refuse a job
whose parameters are not bound to it (``flows.binding``), and record a job attempt's
failure in result storage (``JobFailure`` at ``result_error_key``), the only place the relay
takes a failure from. A record names the flow run that wrote it, so a run created by
another Prefect API client cannot fail someone else's job.
"""

from __future__ import annotations

from prefect import get_run_logger
from prefect.context import FlowRunContext
from prefect.runtime import flow_run

from blocks.storage import ByteStore, exists, load_storage, write_to
from flows.binding import PREVIOUS_KEYS_ENV, SIGNING_KEY_ENV, verify, worker_keys
from flows.params import JobAttempt, JobFailure, result_error_key, result_meta_key
from tasks.errors import FaceFlowError, RunBindingInvalid, as_job_error

KEY_VARIABLES = frozenset({SIGNING_KEY_ENV, PREVIOUS_KEYS_ENV, "FACEFLOW_ENVIRONMENT"})
"""Environment variables that choose the keys a worker accepts: a run may not set them."""


def check_binding(
    job: JobAttempt, *, storage_block: str, settings_block: str, signing_block: str
) -> None:
    """Raise ``RunBindingInvalid`` unless ``job`` carries the relay's binding of exactly
    these parameters, under a key this worker accepts."""
    if KEY_VARIABLES & run_environment().keys():
        raise RunBindingInvalid(detail="the run's job variables set the signing keys")
    keys = worker_keys()
    if not keys:
        raise RunBindingInvalid(detail="this worker has no FACEFLOW_RUN_SIGNING_KEY")
    blocks = {
        "storage_block": storage_block,
        "settings_block": settings_block,
        "signing_block": signing_block,
    }
    if not verify(job, keys, **blocks):
        raise RunBindingInvalid(
            detail="the parameters do not match their binding" if job.binding else "no binding"
        )


def run_environment() -> dict[str, object]:
    """The environment this flow run's own job variables set (``env``; empty outside a
    run). A client that may create or change runs sets these: they never choose keys."""
    context = FlowRunContext.get()
    run = context.flow_run if context is not None else None
    env = (run.job_variables or {}).get("env") if run is not None else None
    return dict(env) if isinstance(env, dict) else {}


def record_failure(
    store: ByteStore | str,
    job_id: str,
    attempt: int,
    exc: BaseException,
    stage: str | None = None,
) -> None:
    """Write the ``JobFailure`` of ``exc`` for a job attempt (``store``: a storage block or
    its name); a failed write is logged (the relay then takes the run as lost)."""
    try:
        target = load_storage(store) if isinstance(store, str) else store
    except Exception as read_error:
        get_run_logger().error("Job %s: failure not recorded: %r", job_id, read_error)
        return
    write_failure(target, job_id, attempt, as_job_error(exc), stage)


def write_failure(
    store: ByteStore, job_id: str, attempt: int, error: FaceFlowError, stage: str | None = None
) -> JobFailure:
    """Log a job attempt's failure (at ``stage``) and write its ``JobFailure`` record, which
    names this flow run; a failed write is logged (the relay then takes the run as lost)."""
    failure = JobFailure.of(error, stage=stage, flow_run_id=flow_run.get_id())
    get_run_logger().warning("Job %s attempt %d failed at %s: %s", job_id, attempt, stage, error)
    try:
        write_to(store, result_error_key(job_id, attempt), failure.model_dump_json().encode())
    except Exception as write_error:
        get_run_logger().error("Job %s: failure not recorded: %r", job_id, write_error)
    return failure


def admit_bound(
    jobs: list[JobAttempt], *, storage_block: str, settings_block: str, signing_block: str
) -> tuple[list[JobAttempt], dict[str, str]]:
    """Split a batch's jobs into those bound to their parameters and the refused ones (their
    failure recorded): ``(admitted, {refused job id: error code})``."""
    admitted: list[JobAttempt] = []
    refused: dict[str, str] = {}
    for job in jobs:
        try:
            check_binding(
                job,
                storage_block=storage_block,
                settings_block=settings_block,
                signing_block=signing_block,
            )
        except RunBindingInvalid as exc:
            get_run_logger().error("Job %s attempt %d refused: %s", job.job_id, job.attempt, exc)
            record_failure(storage_block, job.job_id, job.attempt, exc)
            refused[job.job_id] = exc.code
            continue
        admitted.append(job)
    return admitted, refused


def record_unsettled(jobs: list[JobAttempt], storage_block: str, exc: BaseException) -> None:
    """After a run-wide failure: record it for every job that stored no outcome of its own."""
    try:
        store = load_storage(storage_block)
        unsettled = [
            job
            for job in jobs
            if not exists(store, result_meta_key(job.job_id, job.attempt))
            and not exists(store, result_error_key(job.job_id, job.attempt))
        ]
    except Exception as read_error:
        get_run_logger().error("Batch failure not recorded: %r", read_error)
        return
    for job in unsettled:
        record_failure(store, job.job_id, job.attempt, exc)
