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

Prefect's flow-run events (``run_events``) are applied first, without reading the runs: a
RUNNING event marks its queued job running at the event's time (``start_from_events``); a
COMPLETED, FAILED or CANCELLED event settles its jobs from what their flow stored
(``settle_ended``). While events arrive the runner reads the runs only at the safety-net
interval and where an event leaves the decision to the run's state (CRASHED, CANCELLING, a
run that stored nothing, a job whose start was missed).

Every write is conditional on the job's current ``flow_run_id``: a stale run never writes.
"""

from __future__ import annotations

import logging
import re
from datetime import datetime

import sqlalchemy as sa
from pydantic import ValidationError

from flows.params import JobProgress, progress_key
from webapi.jobstate import record_progress
from webapi.models import Job, JobStatus, UTCDateTime, utcnow
from webapi.prefect_api import FlowRun, PrefectError, StateType
from webapi.relay.context import Noted, Relay
from webapi.relay.outcomes import (
    TRANSITIONS,
    Watched,
    end,
    observe,
    retry_or_fail,
    settle,
    settle_all,
    watched_jobs,
    write,
)
from webapi.relay.run_events import REREAD_AFTER_S
from webapi.storage import StorageError

log = logging.getLogger(__name__)

_STAGE = re.compile(r"^\s*stage\s*[:=]\s*([A-Za-z][\w-]{0,31})")
_PROGRESS = re.compile(r"^\s*Stage \d+/\d+:\s*([A-Za-z][\w-]{0,31})")


def run_once(relay: Relay, *, read_runs: bool = True) -> int:
    """One sync pass; returns how many jobs changed. It first applies what flow-run events
    said (``start_from_events``, ``settle_ended``); then it reads the watched runs over
    REST, unless ``read_runs`` is False (the runner between safety-net polls, while events
    arrive) and no event asked for it or left a job undecided."""
    changed = start_from_events(relay)
    settled, undecided = settle_ended(relay)
    asked = relay.news.take_read()
    if not (read_runs or asked or undecided):
        return changed + settled
    observed = [(job, run) for job, run in observe(relay) or [] if run is not None]
    progress = _progress(relay, [run for _job, run in observed])
    changed += settled + sum(
        apply_run_state(relay, job, run, progress.get(run.id)) for job, run in observed
    )
    videos = [
        job for job, run in observed if job.media == "video" and run.state_type is StateType.RUNNING
    ]
    # A video's progress is read from storage, not told by events: keep the fast poll.
    relay.reading_progress = bool(videos)
    return changed + sum(video_progress(relay, job) for job in videos)


def _again_after_s(noted: Noted) -> float | None:
    """When to take an event up again (``REREAD_AFTER_S`` counts from the event), or None
    once those tries are spent (the safety-net read covers it then)."""
    if noted.tries >= len(REREAD_AFTER_S):
        return None
    return REREAD_AFTER_S[noted.tries] - (REREAD_AFTER_S[noted.tries - 1] if noted.tries else 0.0)


def start_from_events(relay: Relay) -> int:
    """Mark ``running`` (stage "started", ``started_at`` = the RUNNING event's time) the
    queued jobs whose runs an event said went RUNNING, without reading the runs; fenced on
    the job's run as ``_started``, so a stale run's event writes nothing. A run that no job
    holds may be one that dispatch has not recorded yet: it is looked for again
    ``REREAD_AFTER_S`` after the event (no REST read), then left to the safety net.
    Returns how many jobs changed."""
    noted = relay.news.take_started()
    if not noted:
        return 0
    jobs = watched_jobs(relay, runs=[run.run_id for run in noted])
    held = {str(job.flow_run_id) for job in jobs}
    at = {run.run_id: run.at for run in noted}
    for run in noted:
        after_s = _again_after_s(run)
        if run.run_id not in held and after_s is not None:
            relay.news.again(run, after_s, read=False)
    return sum(_started(relay, job, None, at=at[str(job.flow_run_id)]) for job in jobs)


def settle_ended(relay: Relay) -> tuple[int, bool]:
    """Settle the jobs of the runs that Prefect's events said ended (COMPLETED, FAILED,
    CANCELLED) from the outcome their flow stored, without reading the runs first: the flow
    stores its ``ResultRef`` or ``JobFailure`` before it proposes its final state, the
    outcome never depends on the state, and the write is fenced on the job's run as always.

    A job whose attempt stored nothing (cancelled or lost: the run's state decides), or
    not yet marked started (its RUNNING event was missed: its start time is the run's) is
    undecided: the pass reads the runs, and the run is taken up again ``REREAD_AFTER_S``
    after its event, as its final state may not be visible over REST yet. The jobs of the
    runs are settled together (``settle_all``: one transaction). Returns how many jobs
    changed and whether one is undecided."""
    noted = {run.run_id: run for run in relay.news.take_ended()}
    if not noted:
        return 0, False
    jobs = watched_jobs(relay, runs=noted)
    started = [job for job in jobs if job.started_at is not None]
    outcomes = settle_all(relay, [(job, None) for job in started])
    settled = {job.job_id: outcome for job, outcome in zip(started, outcomes, strict=True)}
    changed, undecided = 0, False
    for job in jobs:
        if settled.get(job.job_id) is None:
            undecided = True
            run = noted[str(job.flow_run_id)]
            after_s = _again_after_s(run)
            if after_s is not None:
                relay.news.again(run, after_s, read=True)
        changed += bool(settled.get(job.job_id))
    return changed, undecided


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


def _started(relay: Relay, job: Watched, stage: str | None, *, at: datetime | None = None) -> bool:
    """A running run: a queued job is marked running (``started_at``: ``at`` when given,
    else now), a running one follows the run's stage."""
    if job.status is JobStatus.queued:
        started = (
            {}
            if at is None
            else {"started_at": sa.func.coalesce(Job.started_at, sa.literal(at, UTCDateTime))}
        )
        changed = write(
            relay, job, JobStatus.running, JobStatus.queued, stage=stage or "started", **started
        )
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
