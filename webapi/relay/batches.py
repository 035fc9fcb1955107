"""Micro-batched dispatch: the due jobs that can share a flow run leave together.

With ``batch_max_jobs`` > 1 (``webapi.config``) a dispatch pass

1. counts each lane's unfinished flow runs and, when they already fill
   ``max_runs_in_flight`` (worker slots times runs ahead), dispatches nothing for it: the
   jobs wait in the outbox and leave together once a run ends (sync wakes dispatch). Under
   load batches grow up to ``batch_max_jobs``; when idle a job leaves at once;
2. per lane, leases up to ``free runs * batch_max_jobs`` due rows of that lane and, when
   fewer arrived than a batch holds and the oldest is younger than ``batch_linger_ms``,
   waits out the linger once for more — ``batch_ahead_linger_ms`` instead when every worker slot of their lane
   is busy (the run would only queue behind those: a burst then leaves in fewer, larger
   runs, while a job on an idle lane still leaves at once; the linger ends when a run of
   the lane ends, as its slot would idle). Such a run is not created
   while the lane's next run is being handed to a worker slot (created, not yet running,
   a slot without a running run: ``_await_handover``), at most ``batch_ahead_linger_ms``;
3. groups the jobs by what a run must share (lane, detector and fuser as the client set
   them), earliest deadline first, into chunks of at most ``batch_max_jobs`` and of at most
   ``image_limits.max_batch_pixels`` decoded pixels (``jobs.input_pixels``: what the run
   holds in memory at once), and sends at most the lane's free runs of them (the other
   jobs are due again at once);
4. dispatches a chunk of one as today (a ``fuse-faces`` run, key ``job-<id>-attempt-<n>``),
   and a larger chunk as one ``fuse-batch`` run: its Prefect idempotency key
   (``batch-<uuid>``) is first written to the jobs (``jobs.dispatch_key``, conditional on
   each being queued without a run), then the run is created under it, then recorded on
   every job that still wants it — so a relay that dies in between leaves jobs that the
   next pass sends again under the same key, getting the same run back. A member that
   stopped wanting the run meanwhile gets a stop marker (the run skips it), and a run no
   member wants is cancelled.

Creating and recording runs, Prefect outages and refusals are shared with single runs
(``webapi.relay.runs``).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import get_args

import sqlalchemy as sa
from sqlmodel import col, select

from flows.params import FuseBatchParams, stop_marker_key
from tasks.options import ImageLimits
from webapi.models import ACTIVE_STATUSES, Job, JobStatus, Outbox, Priority, utcnow
from webapi.relay import leases, runs
from webapi.relay.context import Relay
from webapi.relay.runs import COUNTER, Plan

log = logging.getLogger(__name__)

BATCH_KEY_PREFIX = "batch-"
HANDOVER_POLL_S = 0.025  # how often ``_await_handover`` looks whether the run started


@dataclass
class Chunk:
    """Jobs that leave in one flow run: their plans and the rows this relay holds."""

    plans: list[Plan]
    rows: dict[uuid.UUID, Outbox]
    key: str | None = None  # the dispatch key planned for these jobs by an earlier pass


def run_once(relay: Relay) -> int:
    """One batching dispatch pass; returns how many outbox rows it handled.

    Lane by lane (those with nothing ahead of their worker slots first, so a lane's ahead
    linger never holds another's jobs back), at most the lane's free runs of at most
    ``batch_max_jobs`` jobs each."""
    free = free_runs(relay)
    lanes = sorted(
        (lane for lane, n in free.items() if n > 0), key=lambda name: _ahead(relay, free, name)
    )
    size = relay.settings.batch_max_jobs
    handled = 0
    for lane in lanes:
        limit = min(relay.timings.batch - handled, free[lane] * size)
        if limit <= 0:
            break
        if _ahead(relay, free, lane):
            _await_handover(relay, lane, relay.settings.batch_ahead_linger_ms / 1000.0)
        rows = claim(relay, [lane], limit)
        if rows and len(rows) < limit:
            rows += _linger(relay, rows, lane, limit, ahead=_ahead(relay, free, lane))
        handled += len(rows)
        if rows and not _dispatch(relay, rows, max_runs=free[lane]):
            break  # Prefect unreachable: the rest waits for the outage to end
    return handled


def _dispatch(relay: Relay, rows: list[Outbox], *, max_runs: int) -> bool:
    """Send one lane's rows as at most ``max_runs`` runs (jobs that cannot share a run beyond
    those wait for the next pass); False when Prefect was unreachable."""
    settings = relay.settings
    chunks = group(runs.plans(relay, rows), settings.batch_max_jobs, settings.image_limits)
    for index, chunk in enumerate(chunks):
        if index >= max_runs:
            hold_back(relay, [row for later in chunks[index:] for row in later.rows.values()])
            return True
        if not send(relay, chunk):
            rest = [row for later in chunks[index + 1 :] for row in later.rows.values()]
            runs.defer_untried(relay, rest, "Prefect unavailable")
            return False
    return True


def hold_back(relay: Relay, rows: list[Outbox]) -> None:
    """Release leased rows untried, due again at once (their lane has no free run now)."""
    with relay.session() as session:
        for row in rows:
            leases.reschedule(
                session,
                row,
                owner=relay.owner,
                error="held back: the lane's runs are in flight",
                delay_s=0.0,
                count_attempt=False,
            )
        session.commit()


def free_runs(relay: Relay) -> dict[str, int]:
    """Per lane (job priority), how many more flow runs may be in flight now."""
    query = (
        select(Job.priority, sa.func.count(sa.distinct(col(Job.flow_run_id))))
        .where(col(Job.status).in_(list(ACTIVE_STATUSES)), col(Job.flow_run_id).is_not(None))
        .group_by(col(Job.priority))
    )
    with relay.session() as session:
        busy = {str(lane): int(n) for lane, n in session.exec(query).all()}
        session.commit()
    cap = relay.settings.max_runs_in_flight
    return {lane: cap - busy.get(lane, 0) for lane in get_args(Priority)}


def claim(relay: Relay, lanes: list[str], limit: int) -> list[Outbox]:
    """Lease up to ``limit`` due dispatch rows of jobs in ``lanes`` whose inputs are stored."""
    with relay.session() as session:
        return leases.claim(
            session,
            kinds=["dispatch"],
            owner=relay.owner,
            limit=limit,
            lease_s=relay.timings.dispatch_lease_s,
            job_filter=sa.and_(col(Job.priority).in_(lanes), runs.INPUTS_STORED),
        )


def _ahead(relay: Relay, free: dict[str, int], lane: str) -> bool:
    """Whether every worker slot of ``lane`` has a run: a new one would queue behind."""
    settings = relay.settings
    return free[lane] <= settings.max_runs_in_flight - settings.worker_slots


def _handing_over(relay: Relay, lane: str) -> bool:
    """Whether a run of ``lane`` is about to start: one was created whose jobs are not
    running yet, and fewer of the lane's runs are running than it has worker slots."""
    query = (
        select(Job.status, sa.func.count(sa.distinct(col(Job.flow_run_id))))
        .where(
            col(Job.priority) == lane,
            col(Job.status).in_([JobStatus.queued, JobStatus.running]),
            col(Job.flow_run_id).is_not(None),
        )
        .group_by(col(Job.status))
    )
    with relay.session() as session:
        runs_by_status = {JobStatus(status): int(n) for status, n in session.exec(query).all()}
        session.commit()
    running = runs_by_status.get(JobStatus.running, 0)
    return runs_by_status.get(JobStatus.queued, 0) > 0 and running < relay.settings.worker_slots


def _await_handover(relay: Relay, lane: str, at_most_s: float) -> None:
    """Wait, at most ``at_most_s``, while a run of ``lane`` is being handed to a worker slot
    (``_handing_over``; its jobs turn running on its Running event). A run created now would
    only queue behind it, while its creation, and the worker's claim of it ahead, would go
    to the Prefect server beside that run's start (its state changes), which waits for
    them; after the start they overlap the run's compute instead (docs/batching.md)."""
    until = time.monotonic() + at_most_s
    while time.monotonic() < until and _handing_over(relay, lane):
        time.sleep(HANDOVER_POLL_S)


def _linger(
    relay: Relay, rows: list[Outbox], lane: str, limit: int, *, ahead: bool
) -> list[Outbox]:
    """Wait once, up to the linger after the oldest row's arrival, for more rows to join a
    batch that is not full: ``batch_linger_ms``, or the longer ``batch_ahead_linger_ms``
    while the run would only queue behind the lane's running ones (``ahead``). The longer
    linger ends as soon as the lane stops being ahead (a run of it ended: the run would
    start at once, and the worker slot would idle while the rows wait); dispatch's wakes
    (a submit, a run's end) are when to look."""
    settings = relay.settings
    oldest = min(row.created_at for row in rows)
    waited_s = (utcnow() - oldest).total_seconds()
    start = time.monotonic() - waited_s
    plain_s = settings.batch_linger_ms / 1000.0
    linger_s = max(plain_s, settings.batch_ahead_linger_ms / 1000.0) if ahead else plain_s
    woken = False
    while (left := start + linger_s - time.monotonic()) > 0:
        if not relay.nap("dispatch", left):
            break
        woken = True
        if ahead and not _ahead(relay, free_runs(relay), lane):
            ahead, linger_s = False, plain_s
    if woken:
        relay.wake("dispatch")  # what woke the pass is looked at again once it ends
    if waited_s >= linger_s and not woken:
        return []
    return claim(relay, [lane], limit - len(rows))


def group(
    planned: Iterable[tuple[Outbox, Plan]], size: int, limits: ImageLimits = ImageLimits()
) -> list[Chunk]:
    """Chunks of at most ``size`` jobs that can share a run, oldest job's chunk first.

    Jobs already planned into a batch (``dispatch_key``) keep it; the others are grouped by
    lane, detector and fuser (as the client set them: the flow fills the operator's
    defaults, the same for every job), earliest deadline first, and a chunk closes before
    the job that would take its decoded pixels past ``limits.max_batch_pixels`` (a job of
    unknown size counts as ``max_job_pixels``; one past the budget alone leaves alone); a
    job with a per-face mapping goes alone (fuse-faces loads its extra images)."""
    planned_keys: dict[str, Chunk] = {}
    open_groups: dict[tuple[str, object, object], list[tuple[Outbox, Plan]]] = {}
    chunks_alone: list[Chunk] = []
    for row, plan in planned:
        if plan.dispatch_key is not None:
            chunk = planned_keys.setdefault(plan.dispatch_key, Chunk([], {}, plan.dispatch_key))
            chunk.plans.append(plan)
            chunk.rows[plan.job_id] = row
            continue
        if plan.alone:  # a mapping's extra images or a video: a run of its own
            chunks_alone.append(Chunk([plan], {plan.job_id: row}))
            continue
        key = (plan.priority, plan.options.get("detector"), plan.options.get("fuser"))
        open_groups.setdefault(key, []).append((row, plan))
    chunks = [*planned_keys.values(), *chunks_alone]
    for members in open_groups.values():
        members.sort(key=lambda member: member[1].deadline_at)
        for part in _within_budget(members, size, limits):
            chunks.append(Chunk([p for _r, p in part], {p.job_id: r for r, p in part}))
    chunks.sort(key=lambda chunk: min(plan.created_at for plan in chunk.plans))
    return chunks


def _within_budget(
    members: list[tuple[Outbox, Plan]], size: int, limits: ImageLimits
) -> list[list[tuple[Outbox, Plan]]]:
    """``members`` cut in order into parts of at most ``size`` jobs and
    ``limits.max_batch_pixels`` decoded pixels (a part of one job may pass it)."""
    parts: list[list[tuple[Outbox, Plan]]] = []
    pixels = 0
    for member in members:
        plan = member[1]
        count = limits.max_job_pixels if plan.pixels is None else plan.pixels
        if not parts or len(parts[-1]) >= size or pixels + count > limits.max_batch_pixels:
            parts.append([])
            pixels = 0
        parts[-1].append(member)
        pixels += count
    return parts


def send(relay: Relay, chunk: Chunk) -> bool:
    """Dispatch one chunk; False when Prefect was unreachable (the chunk is deferred)."""
    if chunk.key is None and len(chunk.plans) == 1:
        (plan,) = chunk.plans
        return runs.send_single(relay, chunk.rows[plan.job_id], plan)
    key = chunk.key or f"{BATCH_KEY_PREFIX}{uuid.uuid4().hex}"
    members = _members(relay, chunk, key)
    if not members:
        return True
    params = runs.batch_params(relay, members)
    # A chunk holds one lane (``group`` groups by it): the lane's work queue.
    return runs.create(
        relay,
        members,
        chunk.rows,
        lambda queue: relay.prefect.create_batch_run(params, key=key, work_queue_name=queue),
        lambda run_id: record(relay, chunk, members, run_id, params),
    )


def _members(relay: Relay, chunk: Chunk, key: str) -> list[Plan]:
    """The jobs that go into the run under ``key``: those that hold (or now take) the key
    and are still queued without a run. A newly planned chunk writes the key to its jobs
    first; a chunk planned by an earlier pass gathers every job holding its key."""
    now = utcnow()
    with relay.session() as session:
        if chunk.key is None:
            session.exec(
                sa.update(Job)
                .where(
                    col(Job.id).in_([plan.job_id for plan in chunk.plans]),
                    col(Job.status) == JobStatus.queued,
                    col(Job.flow_run_id).is_(None),
                    col(Job.dispatch_key).is_(None),
                )
                .values(dispatch_key=key, updated_at=now)
            )
        holders = session.exec(
            select(Job).where(
                col(Job.status) == JobStatus.queued,
                col(Job.flow_run_id).is_(None),
                col(Job.dispatch_key) == key,
            )
        ).all()
        members = [runs.plan_of(job, job.attempts + 1) for job in holders]
        session.commit()
    given = {plan.job_id: plan for plan in chunk.plans}
    members = [given.get(plan.job_id, plan) for plan in members]  # keep fetched inputs
    gone = [row for job_id, row in chunk.rows.items() if job_id not in {p.job_id for p in members}]
    for row in gone:
        runs.close(relay, row, "obsolete")
    ready = [plan for plan in members if plan.source_key and plan.target_key]
    return sorted(ready, key=lambda plan: plan.deadline_at)


def record(
    relay: Relay, chunk: Chunk, members: list[Plan], run_id: uuid.UUID, params: FuseBatchParams
) -> None:
    """Write the run on every member still queued without a run, and close the rows held;
    a member that no longer wants the run gets a stop marker, a run nobody wants is
    cancelled."""
    now = utcnow()
    recorded: list[Plan] = []
    with relay.session() as session:
        for plan in members:
            if runs.update_queued(
                session, plan, flow_run_id=run_id, attempts=plan.attempt, commit=False, now=now
            ):
                recorded.append(plan)
        done = {plan.job_id for plan in recorded}
        for job_id, row in chunk.rows.items():
            leases.finish(
                session, row, owner=relay.owner, outcome="done" if job_id in done else "obsolete"
            )
        session.commit()
    relay.metrics.inc(COUNTER, "dispatched", len(recorded))
    for plan in recorded:
        relay.metrics.observe_dispatch_lag((now - plan.created_at).total_seconds())
    log.info(
        "batch dispatched",
        extra={"flow_run_id": str(run_id), "jobs": len(recorded), "planned": len(params.jobs)},
    )
    unwanted = [job for job in params.jobs if uuid.UUID(job.job_id) not in done]
    if not recorded:
        runs.cancel_orphan(relay, run_id)
        return
    for job in unwanted:
        stop(relay, job.job_id, job.attempt)


def stop(relay: Relay, job_id: str, attempt: int) -> None:
    """Write the stop marker of a job attempt whose run carries other jobs (best effort:
    the relay discards whatever that attempt still produces)."""
    try:
        relay.store.put(stop_marker_key(job_id, attempt), b"stop")
    except Exception as exc:
        log.warning("could not write a stop marker", extra={"job_id": job_id, "error": str(exc)})
