"""The fetch lane: input URLs are fetched here, off the dispatch pass, a few at a time.

A job submitted with an input URL is queued without that input's storage key; its
``dispatch`` outbox row belongs to the fetch lane until the input is stored (dispatch
leases only rows whose job has both inputs stored: ``runs.INPUTS_STORED``), so a slow
input server never delays anyone's dispatch. Each relay replica runs one lane of
``fetch_concurrency`` threads. A pass leases due rows of such jobs, one per free thread,
and never more than ``fetch_per_user`` of one user in flight at once over every replica:
the count is of the live leases on such rows in the job store, read and taken under one
lock (PostgreSQL: a transaction-scoped advisory lock; SQLite transactions are already
serial), so replicas together cannot exceed it. The lease outlasts the fetch: a replica
that dies mid-fetch leaves the row to another at ``lease_until``.

A job's input fetches share one ``fetch.Deadline`` of ``fetch_deadline_seconds`` (never
past the job's queue deadline) for connecting, TLS, headers, redirects and bodies
together. A fetched input is validated and stored as a submitted one is (a target that
turns out to be a video is spooled to a temporary file, hashed as it arrives, probed
against the video limits and stored as an upload; the job becomes a video job, which
dispatch sends to ``fuse-video``); its key is written on the job and the row handed to
dispatch in one transaction, and dispatch is woken. In that transaction the job's
``input_pixels`` (which counted the URL input at the per-image limit:
``webapi.inputs.job_pixels``) takes the image's own size from its header, so the batch
planner sees what the job decodes to. An input that can never be used fails
the job (``input_fetch_failed`` or the image's own code), and so do images that together
pass the per-job budget (``job_too_large``, as at submit); a transient failure (deadline
passed, connection refused or dropped, HTTP 5xx) backs the row off, and after
``fetch_tries`` tries the job fails with ``input_fetch_timeout`` (the last try ran out of
time) or ``input_fetch_failed``.

The queue deadline still applies: a job waiting for a fetch expires (``expire``) like any
queued job and no fetch starts for it past that deadline; the fetch of a job that is
cancelled or expires meanwhile is cut at the lane's next pass. Stopping the lane cuts
its fetches and hands their rows back untried.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.orm import aliased
from sqlmodel import col, select

from tasks.error_codes import JobErrorCode
from tasks.errors import FaceFlowError
from webapi import crud
from webapi.errors import ApiError
from webapi.inputs import InputRef, pixels_once_fetched, store_image, store_spooled_video
from webapi.models import Job, JobStatus, Outbox, utcnow
from webapi.relay import leases, runs
from webapi.relay.context import Relay
from webapi.relay.fetch import (
    Deadline,
    FetchError,
    FetchRejected,
    FetchTimedOut,
    Spool,
    fetch_into,
    fetch_url,
)
from webapi.relay.runs import Plan
from webapi.urls import UrlPolicy

log = logging.getLogger(__name__)

COUNTER = "faceflow_relay_input_fetches_total"
#: The advisory lock (PostgreSQL) under which replicas count and take fetch leases.
CLAIM_LOCK_KEY = 0x46465446


def waits_for_fetch(job: type[Job] = Job) -> sa.ColumnElement[bool]:
    """Whether ``job`` (the table or an alias of it) is queued with an input not stored
    (``Job.awaits_fetch`` for a loaded row)."""
    return sa.and_(
        col(job.status) == JobStatus.queued,
        sa.or_(col(job.source_key).is_(None), col(job.target_key).is_(None)),
    )


def run_once(relay: Relay) -> int:
    """One pass outside the relay's threads (``reconcile``): start what is due within the
    lane's limits and wait for those fetches to end (each within its deadline)."""
    lane = FetchLane(relay.settings.fetch_concurrency)
    try:
        return lane.run_once(relay)
    finally:
        lane.close(cut=False)


class FetchLane:
    """One replica's fetch threads and the deadlines of the fetches they run."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="faceflow-fetch")
        self._lock = threading.Lock()
        self._running: dict[uuid.UUID, Deadline | None] = {}  # job id → its fetch's deadline
        self._stopping = False  # no more rows are taken
        self._cutting = False  # fetches in flight, and those about to start, are cut

    def in_flight(self) -> int:
        """How many fetches this lane runs now."""
        with self._lock:
            return len(self._running)

    def run_once(self, relay: Relay) -> int:
        """Cut the fetches of jobs that stopped waiting for them, then lease due rows for
        the free threads and start their fetches; returns how many started."""
        self._cut_unwanted(relay)
        started = 0
        while True:
            with self._lock:
                if self._stopping or len(self._running) >= self.threads:
                    break
            row = claim_one(relay)
            if row is None:
                break
            with self._lock:
                self._running[row.job_id] = None
            self._pool.submit(self._fetch, relay, row)
            started += 1
        return started

    def close(self, *, cut: bool = True) -> None:
        """Stop taking rows and wait for the fetches in flight, cutting them first if
        ``cut`` (their rows are handed back untried)."""
        with self._lock:
            self._stopping = True
            self._cutting = cut
            deadlines = [d for d in self._running.values() if d is not None] if cut else []
        for deadline in deadlines:
            deadline.cut("the relay is stopping")
        self._pool.shutdown(wait=True)

    def _fetch(self, relay: Relay, row: Outbox) -> None:
        try:
            fetch_row(relay, row, track=self._track)
        except Exception:  # a fetch must not take the lane down; the lease expires
            log.exception("input fetch failed", extra={"job_id": str(row.job_id)})
            relay.metrics.inc("faceflow_relay_loop_errors_total", "fetch")
        finally:
            with self._lock:
                self._running.pop(row.job_id, None)
            relay.wake("fetch")

    def _track(self, job_id: uuid.UUID, deadline: Deadline) -> None:
        with self._lock:
            self._running[job_id] = deadline
            cutting = self._cutting
        if cutting:
            deadline.cut("the relay is stopping")

    def _cut_unwanted(self, relay: Relay) -> None:
        """Cut the fetches of jobs no longer queued (cancelled, expired)."""
        with self._lock:
            running = {job_id: d for job_id, d in self._running.items() if d is not None}
        if not running:
            return
        with relay.session() as session:
            queued = set(
                session.exec(
                    select(Job.id).where(
                        col(Job.id).in_(list(running)), col(Job.status) == JobStatus.queued
                    )
                ).all()
            )
            session.commit()
        for job_id, deadline in running.items():
            if job_id not in queued and deadline is not None:
                deadline.cut("the job is no longer queued")


def claim_one(relay: Relay) -> Outbox | None:
    """Lease the next due row of a job waiting for an input fetch whose owner has fewer
    than ``fetch_per_user`` fetches in flight (over every replica), for the fetch
    deadline plus a margin; None when there is none."""
    settings = relay.settings
    now = utcnow()
    due = sa.and_(
        waits_for_fetch(),
        col(Job.queue_deadline_at) > now,
        col(Job.deadline_at) > now,
        _in_flight_of_owner(now) < settings.fetch_per_user,
    )
    with relay.session() as session:
        if session.get_bind().dialect.name == "postgresql":
            session.exec(select(sa.func.pg_advisory_xact_lock(CLAIM_LOCK_KEY))).first()
        rows = leases.claim(
            session,
            kinds=["dispatch"],
            owner=relay.owner,
            limit=1,
            lease_s=settings.fetch_deadline_seconds + relay.timings.fetch_lease_margin_s,
            now=now,
            job_filter=due,
        )
    return rows[0] if rows else None


_OWNERS_JOB, _OWNERS_ROW = aliased(Job), aliased(Outbox)
"""The aliases ``_in_flight_of_owner`` counts with, made once: a fresh pair built its column
proxies again on every claim (3.2 of the 4.6 ms of CPU an empty claim took on SQLite)."""


def _in_flight_of_owner(now: datetime) -> sa.ScalarSelect[int]:
    """How many fetch rows of the candidate ``Job``'s owner are leased now, by any replica
    (a count correlated with the claim's ``Job``)."""
    job, row = _OWNERS_JOB, _OWNERS_ROW
    return (
        select(sa.func.count())
        .select_from(row)
        .join(job, col(job.id) == col(row.job_id))
        .where(
            col(row.kind) == "dispatch",
            col(row.done_at).is_(None),
            col(row.lease_until) > now,
            col(job.owner_id) == col(Job.owner_id),
            waits_for_fetch(job),  # type: ignore[arg-type]
        )
        .scalar_subquery()
    )


def fetch_row(
    relay: Relay,
    row: Outbox,
    *,
    track: Callable[[uuid.UUID, Deadline], None] | None = None,
) -> None:
    """Fetch, validate and store the URL inputs of a leased row's job within one deadline
    (``track`` is told it, so that the lane can cut it), then hand the row to dispatch,
    fail the job, or back the row off."""
    plan = runs.plan_row(relay, row)
    if plan is None:  # the job no longer wants a run: the row is closed
        return
    now = utcnow()
    seconds = min(
        relay.settings.fetch_deadline_seconds,
        (plan.queue_deadline_at - now).total_seconds(),
        (plan.deadline_at - now).total_seconds(),
    )
    if seconds <= 0:
        _hand_back(relay, row, "past the job's queue deadline")  # expire ends the job
        return
    with Deadline(seconds) as deadline:
        if track is not None:
            track(plan.job_id, deadline)
        _fetch_inputs(relay, row, plan, deadline)


def _fetch_inputs(relay: Relay, row: Outbox, plan: Plan, deadline: Deadline) -> None:
    fetched_at = utcnow()  # before any input is found already stored
    limits = relay.settings.image_limits
    refs: dict[str, InputRef] = {}
    try:
        for name, key, url in (
            ("source", plan.source_key, plan.source_url),
            ("target", plan.target_key, plan.target_url),
        ):
            if key is None:
                refs[name] = _fetch_and_store(relay, url, name, deadline)
        pixels = plan.pixels
        if pixels is not None:  # None: a job from before input_pixels (counted at the budget)
            pixels = pixels_once_fetched(pixels, list(refs.values()), limits)
            limits.check_job_pixels(pixels)  # job_too_large, as at submit
    except FetchRejected as exc:
        _reject(relay, row, plan, exc.code, exc.public_message, str(exc))
        return
    except FaceFlowError as exc:  # not an acceptable image, or the job's past its budget
        _reject(relay, row, plan, exc.code, exc.public_message, str(exc))
        return
    except ApiError as exc:  # empty or too large
        _reject(relay, row, plan, JobErrorCode.parse(exc.code), exc.message, str(exc))
        return
    except FetchError as exc:
        _retry_or_fail(relay, row, plan, exc, deadline)
        return
    source_key = plan.source_key or refs["source"].key
    target_key = plan.target_key or refs["target"].key
    fetched = [ref.key for ref in refs.values() if ref.key is not None]
    with relay.session() as session:
        # Under the admission lock, like a submit: retention may have deleted an input that
        # was found already stored; then fetch it again later.
        crud.serialise_admission(session)
        purged = crud.inputs_purged_since(session, keys=fetched, since=fetched_at)
        if crud.missing_inputs(fetched, purged, fetched_at, relay.store):
            session.rollback()
            _back_off(relay, row, "an input was deleted by retention while it was stored")
            return
        video = refs["target"].video if "target" in refs else None
        stored = runs.update_queued(
            session,
            plan,
            source_key=source_key,
            target_key=target_key,
            input_pixels=pixels,
            commit=False,
            **({"media": "video", "video_input": video} if video is not None else {}),
        )
        if stored:
            leases.release(session, row, owner=relay.owner)
        session.commit()
    if not stored:  # cancelled or expired meanwhile (the row was closed with the job)
        relay.metrics.inc(COUNTER, "obsolete")
        return
    relay.metrics.inc(COUNTER, "fetched")
    log.info("inputs fetched", extra={"job_id": str(plan.job_id)})
    relay.wake("dispatch")


def _fetch_and_store(relay: Relay, url: str | None, name: str, deadline: Deadline) -> InputRef:
    """Fetch and store one input: a source image in memory; a target, which may be a
    video, through a ``Spool`` (a video is probed and stored as an upload is)."""
    if url is None:
        raise FetchRejected(f"The job has no {name} image.")
    settings = relay.settings
    urls, hops = UrlPolicy.from_settings(settings), relay.timings.fetch_max_redirects
    images = settings.image_limits
    if name != "target":
        data = fetch_url(
            relay.http, url, max_bytes=images.max_bytes, urls=urls, max_redirects=hops,
            deadline=deadline,
        )  # fmt: skip
        return store_image(data, name=name, limits=images, store=relay.store)
    videos = settings.video_limits
    with Spool(image_bytes=images.max_bytes, video_bytes=videos.max_bytes) as spool:
        fetch_into(relay.http, url, spool, urls=urls, max_redirects=hops, deadline=deadline)
        spool.finish()
        if spool.is_video:
            digest = spool.sha256.hexdigest()
            return store_spooled_video(
                spool.path, digest, name=name, limits=videos, store=relay.store
            )
        return store_image(spool.read(), name=name, limits=images, store=relay.store)


def _reject(
    relay: Relay, row: Outbox, plan: Plan, code: JobErrorCode, message: str, detail: str
) -> None:
    runs.fail(relay, row, plan, code, message, detail)
    relay.metrics.inc(COUNTER, "rejected")


def _retry_or_fail(
    relay: Relay, row: Outbox, plan: Plan, exc: FetchError, deadline: Deadline
) -> None:
    """A transient failure: hand the row back untried when the fetch was cut (the job
    ended, or the relay stops) or the job's queue deadline has passed (expire ends it);
    else back off, or fail the job once ``fetch_tries`` tries have failed."""
    if deadline.reason not in (None, "deadline") or utcnow() >= plan.queue_deadline_at:
        _hand_back(relay, row, str(exc))
        return
    tries = row.attempts + 1
    if isinstance(exc, FetchTimedOut):
        relay.metrics.inc(COUNTER, "timeout")
    if tries < relay.settings.fetch_tries:
        _back_off(relay, row, str(exc))
        return
    message = f"{exc.public_message} Tried {tries} times."
    log.warning("input fetch gave up", extra={"job_id": str(plan.job_id), "code": exc.code})
    _reject(relay, row, plan, exc.code, message, str(exc))


def _back_off(relay: Relay, row: Outbox, error: str) -> None:
    """Release ``row`` to be tried again after its exponential backoff (one try more)."""
    delay = runs.reschedule_after_backoff(relay, row, error, counter=COUNTER)
    log.warning(
        "input fetch deferred: %s",
        error,
        extra={"job_id": str(row.job_id), "delay_s": round(delay, 2)},
    )


def _hand_back(relay: Relay, row: Outbox, error: str) -> None:
    """Release ``row`` untried (no try counted), due now."""
    with relay.session() as session:
        leases.reschedule(
            session, row, owner=relay.owner, error=error, delay_s=0.0, count_attempt=False
        )
        session.commit()
