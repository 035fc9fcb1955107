"""sync: Prefect flow-run states → job status, stage, result and error.

Polls the flow runs of every non-terminal job that has one (one batched filter call per
pass, every ``sync_interval_s``). Mapping:

- PENDING / RUNNING → ``running`` (``started_at``; ``stage`` from the run's progress
  artifact ``Stage i/n: <name> ...``, as fuse-faces writes it, or a state message
  ``stage: <name>``; one batched artifact query per pass);
- COMPLETED, FAILED, CANCELLED → the outcome the flow stored for the job's attempt, and
  nothing else (``outcomes.settle``): its ``ResultRef`` sidecar (``flows.params.result_meta_key``)
  → ``succeeded`` with the result and ``stage`` = the flow's last stage (the progress
  artifact is written lazily and may lag behind a run that finished); its ``JobFailure``
  (``result_error_key``, from the run the job holds) → ``failed`` with its code, or
  re-dispatched when it is retryable. A final run that stored neither was ended by someone
  else (another client of the Prefect API, an operator): a cancel-requested job is then
  ``cancelled``, any other is a lost run, re-dispatched or failed ``worker_lost`` as the
  reaper does (``outcomes.retry_or_fail``). A state's message never decides an outcome;
- CRASHED, lost runs and overdue runs are the reaper's (``webapi.relay.reap``).

A run that Prefect's events said ended (COMPLETED, FAILED, CANCELLED: ``run_events``) is
settled first, from what its flow stored, without waiting for the read of the runs
(``settle_ended``); a job whose run stored nothing is left to that read.

Every write is conditional on the job's current ``flow_run_id``: a stale run never writes.
"""

from __future__ import annotations

import logging
import re

from pydantic import ValidationError

from flows.params import JobProgress, progress_key
from webapi.jobstate import record_progress
from webapi.models import JobStatus, utcnow
from webapi.prefect_api import FlowRun, PrefectError, StateType
from webapi.relay.context import Relay
from webapi.relay.outcomes import (
    TRANSITIONS,
    Watched,
    end,
    observe,
    retry_or_fail,
    settle,
    watched_jobs,
    write,
)
from webapi.storage import StorageError

log = logging.getLogger(__name__)

_STAGE = re.compile(r"^\s*stage\s*[:=]\s*([A-Za-z][\w-]{0,31})")
_PROGRESS = re.compile(r"^\s*Stage \d+/\d+:\s*([A-Za-z][\w-]{0,31})")


def run_once(relay: Relay) -> int:
    """One sync pass; returns how many jobs changed."""
    settled = settle_ended(relay)
    observed = [(job, run) for job, run in observe(relay) or [] if run is not None]
    progress = _progress(relay, [run for _job, run in observed])
    changed = settled + sum(
        apply_run_state(relay, job, run, progress.get(run.id)) for job, run in observed
    )
    videos = [
        job for job, run in observed if job.media == "video" and run.state_type is StateType.RUNNING
    ]
    # A video's progress is read from storage, not told by events: keep the fast poll.
    relay.reading_progress = bool(videos)
    return changed + sum(video_progress(relay, job) for job in videos)


def settle_ended(relay: Relay) -> int:
    """Settle the jobs of the runs that Prefect's events said ended (``relay.ended_runs``)
    from the outcome their flow stored, without reading the runs first: the flow stores
    its ``ResultRef`` or ``JobFailure`` before it proposes its final state, the outcome
    never depends on the state, and the write is fenced on the job's run as always. A job
    with no stored outcome, or not yet marked started (its start time is the run's), is
    left to the pass that reads its run. Returns how many jobs changed."""
    runs = relay.ended_runs.take()
    if not runs:
        return 0
    changed = 0
    for job in watched_jobs(relay, runs=runs):
        if job.started_at is not None and settle(relay, job, None):
            changed += 1
    return changed


def video_progress(relay: Relay, job: Watched) -> bool:
    """Copy a running video job's progress record (``fuse-video`` writes it as frames
    advance) onto the job when it moved; whether the job changed."""
    try:
        raw = relay.store.get(progress_key(str(job.job_id), job.attempts))
        record = JobProgress.model_validate_json(raw).model_dump(mode="json")
    except (StorageError, ValidationError):  # none yet, or unreadable: the next pass
        return False
    if job.progress is not None and all(
        job.progress.get(name) == record[name] for name in _PROGRESS_MOVES
    ):
        return False
    with relay.session() as session:
        return record_progress(
            session, job_id=job.job_id, flow_run_id=job.flow_run_id, progress=record
        )


#: The progress fields whose change is worth a write (not the timestamp alone).
_PROGRESS_MOVES = (
    "frames_analysed",
    "frames_done",
    "frames_total",
    "chunks_done",
    "chunks_total",
    "stage",
)


def _progress(relay: Relay, runs: list[FlowRun]) -> dict[str, str]:
    """Progress descriptions of the running runs (one call; empty if it fails)."""
    running = [run.id for run in runs if run.state_type is StateType.RUNNING]
    if not running:
        return {}
    try:
        return relay.prefect.read_progress(running)
    except PrefectError:
        return {}


def apply_run_state(relay: Relay, job: Watched, run: FlowRun, progress: str | None = None) -> bool:
    """Write what ``run``'s state means for ``job``; returns whether the job changed.
    ``progress`` is the run's progress-artifact description, if any."""
    state = run.state_type
    if state in (StateType.PENDING, StateType.RUNNING):
        return _started(relay, job, stage_of(run, progress))
    if state in (StateType.COMPLETED, StateType.FAILED, StateType.CANCELLED):
        return _ended(relay, job, run)
    return False  # SCHEDULED, PAUSED, CANCELLING: wait; CRASHED: the reaper's


def stage_of(run: FlowRun, progress: str | None = None) -> str | None:
    """The stage a running flow reports: its state message (``stage: detect``) or its
    progress artifact (``Stage 2/6: detect (attempt 1).``)."""
    match = _STAGE.match(run.state_message or "") or _PROGRESS.match(progress or "")
    return match.group(1).lower() if match else None


def _started(relay: Relay, job: Watched, stage: str | None) -> bool:
    if job.status is JobStatus.queued:
        changed = write(relay, job, JobStatus.running, JobStatus.queued, stage=stage or "started")
        if changed:
            relay.metrics.inc(TRANSITIONS, JobStatus.running.value)
        return changed
    if job.status is JobStatus.running and stage is not None and stage != job.stage:
        return write(relay, job, JobStatus.running, JobStatus.running, stage=stage)
    return False


def _ended(relay: Relay, job: Watched, run: FlowRun) -> bool:
    """A final run: the outcome its flow stored, else cancelled (asked for) or lost."""
    settled = settle(relay, job, run)
    if settled is not None:
        return settled
    if job.status is JobStatus.cancel_requested:
        return end(relay, job, JobStatus.cancelled)
    log.warning(
        "run ended without an outcome: taken as lost",
        extra={"job_id": str(job.job_id), "state": run.state_type.value},
    )
    return retry_or_fail(relay, job, run, reason="no_outcome", now=utcnow())
