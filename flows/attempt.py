"""What every run of a job attempt does first and last, whatever its flow: admit the
attempt (its binding, its deadline), tag the run, end ``Failed`` with the typed error;
and what marks its results. Light (no pipeline, no model): the video coordinator on the
control pool uses it as ``fuse-faces`` and the GPU flows do."""

from __future__ import annotations

from typing import Any
from uuid import UUID

from prefect import get_run_logger
from prefect.client.orchestration import get_client
from prefect.runtime import flow_run
from prefect.states import Failed, State

from blocks.settings import FusionSettings
from blocks.signing import load_credentials
from flows.deadline import Deadline
from flows.outcome import check_binding
from flows.params import JobAttempt, run_tags
from tasks.errors import DeadlineExceeded, FaceFlowError, drop_frames
from tasks.provenance import Marker


def start_attempt(
    spec: JobAttempt, *, storage_block: str, settings_block: str, signing_block: str
) -> None:
    """What a single-job flow (``fuse-faces``, ``fuse-video``) does first: ``admit`` the
    attempt, then tag the run with its job and owner."""
    admit(spec, storage_block=storage_block, settings_block=settings_block,
          signing_block=signing_block)  # fmt: skip
    tag_flow_run(spec.job_id, spec.owner_id)


def admit(spec: JobAttempt, *, storage_block: str, settings_block: str, signing_block: str) -> None:
    """Refuse parameters not bound to the job (``run_binding_invalid``) and a start after
    the deadline (``deadline_exceeded``); what every run of a job attempt checks first."""
    check_binding(
        spec,
        storage_block=storage_block,
        settings_block=settings_block,
        signing_block=signing_block,
    )
    deadline = Deadline.of(spec.deadline_at)
    if deadline.passed():
        raise DeadlineExceeded(detail=f"started {-deadline.left():.1f} s after the deadline")


def tag_flow_run(job_id: str, owner_id: str) -> None:
    """Add job and owner tags to this flow run unless it has them already.

    The relay creates every run with these tags (``flows.params.run_tags``), so a
    dispatched run costs no API call here; a run started another way (a direct call, the
    UI) is tagged through the run's own client.
    """
    run_id = flow_run.get_id()
    current = set(flow_run.get_tags())
    wanted = set(run_tags(job_id, owner_id))
    if run_id is None or wanted <= current:
        return
    try:
        with get_client(sync_client=True) as client:  # the run's own client, if it has one
            client.update_flow_run(UUID(run_id), tags=sorted(current | wanted))
    except Exception as exc:  # tags help operators; a failed update must not fail the job
        get_run_logger().warning("Could not tag flow run %s: %r", run_id, exc)


def failed(exc: Exception, what: str) -> State[Any]:
    """The ``Failed`` state a job flow ends in for ``exc`` (logged): its typed error's
    ``[code] message``, or ``internal_error`` for anything unexpected. The state outlives
    the run in a warm worker: the error it keeps holds no frames (``drop_frames``)."""
    logger = get_run_logger()
    if isinstance(exc, FaceFlowError):
        logger.error("%s failed: %s", what, exc)
        return Failed(message=str(exc), data=drop_frames(exc))
    logger.error("%s failed unexpectedly", what, exc_info=exc)
    internal = FaceFlowError(detail=type(exc).__name__)
    return Failed(message=str(internal), data=internal)


def result_marker(settings: FusionSettings, signing_block: str | None) -> Marker | None:
    """What marks results: with marking required, the credentials of ``signing_block``
    (``MarkingFailed`` when they cannot be loaded: no job starts that could not end
    marked); None without."""
    if settings.marking == "required" and signing_block is not None:
        return Marker(load_credentials(signing_block))
    return None
