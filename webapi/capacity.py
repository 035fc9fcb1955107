"""The capacity model of admission: how long a new job would wait, and whether to take it.

``Backlog`` is what waits in each lane and how fast it drains (the recent service time
per photo job, ``service_estimate``, over the worker slots) and the video work beside it
(frames queued and left, at the recent worker time per frame, ``frame_estimate``);
``check_capacity`` refuses a submit over its owner's quota (429) or that would not start
within its queue timeout (503), both with ``Retry-After``. ``webapi.crud`` admits jobs with it; the relay sizes its work by the
same service time, and ``/metrics`` exports the backlog.
"""

from __future__ import annotations

import math
import statistics
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, TypeVar, get_args

import sqlalchemy as sa
from sqlmodel import Session, col, select
from sqlmodel.sql.expression import Select

from tasks.recent import Recent
from webapi.config import Settings
from webapi.errors import Overloaded, QuotaExceeded
from webapi.models import ACTIVE_STATUSES, Job, JobStatus, Priority, User

SERVICE_TIME_SAMPLE = 50
SERVICE_TIME_TTL_S = 5.0
VIDEO_SAMPLE = 20
#: Finished photo jobs the batching model (``drain_estimate``) needs before its wait is
#: taken as it is (``batch_admission_safety``); from fewer it carries ``admission_safety``.
MIN_DRAIN_JOBS = 5
#: Seconds of video in one render chunk (the flow's default ``video_chunk_s``): a photo job
#: waits for at most the rest of one chunk on a worker that renders a video.
VIDEO_CHUNK_S = 10.0
#: Frames assumed for a video whose probe is not known yet (a target URL that looks like a
#: video: it is fetched and probed after admission).
UNPROBED_VIDEO_FRAMES = 300
#: Lanes of the queue, one per priority class; ``high`` jobs go to the priority work queue.
LANES: tuple[Priority, ...] = get_args(Priority)


@dataclass(frozen=True)
class Backlog:
    """What is waiting, in each lane, and how fast it drains.

    Workers take the priority work queue first, so a ``high`` job waits only for the
    ``high`` jobs queued before it and for a running job to finish; a ``normal`` job waits
    for every queued job."""

    queued_by_lane: Mapping[str, int]
    running: int
    service_s: float
    slots: int
    measured: bool = True  # service_s comes from recent jobs, not the configured default
    video: VideoBacklog | None = None
    drain: Drain | None = None  # per-run and per-job costs (measured), for batching
    running_runs: int = 0  # flow runs the running photo jobs are in

    @property
    def queued(self) -> int:
        """Queued jobs in every lane."""
        return sum(self.queued_by_lane.values())

    def ahead(self, lane: str) -> int:
        """Queued jobs a new job of ``lane`` waits behind."""
        if lane == "high":
            return self.queued_by_lane.get("high", 0)
        return self.queued

    def wait_s(self, lane: str) -> float:
        """Estimated time before one more photo job of ``lane`` would start: the photo jobs
        ahead, and on workers that render a video the rest of their chunk (video chunks
        have a work queue of their own, below the photo ones)."""
        photos = self._photo_work_s(self.ahead(lane)) + self._running_work_s()
        return (photos + self._videos().chunk_left_s) / self.slots

    def _photo_work_s(self, jobs: int) -> float:
        """Worker seconds ``jobs`` queued photo jobs cost: one service time each, or with a
        measured ``drain`` their compute plus one run's overhead per batch they fill."""
        if self.drain is None:
            return jobs * self.service_s
        runs = math.ceil(jobs / self.drain.batch_jobs)
        return runs * self.drain.overhead_s + jobs * self.drain.compute_s

    def _running_work_s(self) -> float:
        """Worker seconds the running photo jobs have left: half of what they cost."""
        if self.drain is None:
            return self.running / 2 * self.service_s
        runs = self.running_runs or self.running
        return (runs * self.drain.overhead_s + self.running * self.drain.compute_s) / 2

    def video_wait_s(self) -> float:
        """Estimated time before one more video job would start: every photo job queued or
        running, and the frames every earlier video has left."""
        photos = self._photo_work_s(self.queued) + self._running_work_s()
        return (photos + self._videos().work_s) / self.slots

    def _videos(self) -> VideoBacklog:
        return self.video or VideoBacklog(frames_queued=0, frames_left=0, running=0, frame_s=0)

    @property
    def expected_wait_s(self) -> float:
        """Estimated time before one more normal job would start."""
        return self.wait_s("normal")

    def admitted(self, lane: str, *, video_frames: int | None = None) -> Backlog:
        """This backlog with one more job queued in ``lane``, or with one more video of
        ``video_frames`` frames."""
        if video_frames is not None:
            video = self._videos()
            return replace(
                self, video=replace(video, frames_queued=video.frames_queued + video_frames)
            )
        counts = dict(self.queued_by_lane)
        counts[lane] = counts.get(lane, 0) + 1
        return replace(self, queued_by_lane=counts)


@dataclass(frozen=True)
class Drain:
    """How the photo queue drains under batching, measured on recent jobs: each flow run
    costs ``overhead_s`` (dispatch, Prefect's bookkeeping, sync) plus ``compute_s`` per job
    it carries, up to ``batch_jobs`` jobs a run (``settings.batch_max_jobs``)."""

    overhead_s: float
    compute_s: float
    batch_jobs: int
    samples: int  # the finished jobs it was measured on

    @property
    def settled(self) -> bool:
        """Whether it was measured on enough jobs (``MIN_DRAIN_JOBS``) to be used as it is."""
        return self.samples >= MIN_DRAIN_JOBS


@dataclass(frozen=True)
class VideoBacklog:
    """The video work waiting and under way: frames of queued videos, frames running videos
    have left, how many run (at most the slots), the recent worker seconds per frame
    (``frame_estimate``), and the frames of the chunks under way that a photo waits for."""

    frames_queued: int
    frames_left: int
    running: int
    frame_s: float
    chunk_frames_left: float = 0.0

    @property
    def work_s(self) -> float:
        """Worker seconds of every frame queued or left."""
        return (self.frames_queued + self.frames_left) * self.frame_s

    @property
    def chunk_left_s(self) -> float:
        """Worker seconds a photo waits for, summed over the workers that render a video."""
        return self.chunk_frames_left * self.frame_s


def video_frames(video_input: Mapping[str, object] | None) -> int:
    """The frames a video job renders, from its probe at submit (``UNPROBED_VIDEO_FRAMES``
    when it has none yet)."""
    frames = (video_input or {}).get("frame_count")
    return int(frames) if isinstance(frames, int | float) and frames > 0 else UNPROBED_VIDEO_FRAMES


def backlog(session: Session, *, settings: Settings) -> Backlog:
    """Counts of queued jobs per lane and of running jobs, and the recent service time."""
    unfinished = [JobStatus.queued, JobStatus.running, JobStatus.cancel_requested]
    rows = session.exec(
        select(
            Job.status,
            Job.priority,
            sa.func.count(),
            sa.func.count(sa.distinct(col(Job.flow_run_id))),
        )
        .where(col(Job.status).in_(unfinished), col(Job.media) == "photo")
        .group_by(col(Job.status), col(Job.priority))
    ).all()
    queued: dict[str, int] = dict.fromkeys(LANES, 0)
    running = running_runs = 0
    for status, lane, count, runs in rows:
        if JobStatus(status) is JobStatus.queued:
            queued[lane] = queued.get(lane, 0) + int(count)
        else:
            running += int(count)
            running_runs += int(runs)
    service_s, measured = service_estimate(session, settings=settings)
    return Backlog(
        queued_by_lane=queued,
        running=running,
        service_s=service_s,
        slots=settings.worker_slots,
        measured=measured,
        video=video_backlog(session, settings=settings, unfinished=unfinished),
        drain=drain_estimate(session, settings=settings) if settings.batching else None,
        running_runs=running_runs,
    )


def video_backlog(
    session: Session, *, settings: Settings, unfinished: Sequence[JobStatus]
) -> VideoBacklog:
    """Frames of the queued videos and frames the running ones have left (from their
    progress), bounded by the users' quotas like every unfinished job."""
    videos = session.exec(
        select(Job.status, Job.video_input, Job.progress).where(
            col(Job.status).in_(list(unfinished)), col(Job.media) == "video"
        )
    ).all()
    frames_queued = frames_left = 0
    chunks: list[float] = []  # per running video: half the frames its current chunk has left
    for status, probe, progress in videos:
        frames = video_frames(probe)
        if JobStatus(status) is JobStatus.queued:
            frames_queued += frames
            continue
        left = max(frames - int((progress or {}).get("frames_done") or 0), 0)
        frames_left += left
        chunks.append(min(VIDEO_CHUNK_S * float((probe or {}).get("fps") or 30.0), left) / 2)
    busy = sorted(chunks, reverse=True)[: settings.worker_slots]
    return VideoBacklog(
        frames_queued=frames_queued,
        frames_left=frames_left,
        running=len(busy),
        frame_s=frame_estimate(session, settings=settings),
        chunk_frames_left=sum(busy),
    )


# The estimates per job store (its database URL), measured again after SERVICE_TIME_TTL_S.
_SERVICE: Recent[str, tuple[float, bool]] = Recent(lambda: SERVICE_TIME_TTL_S)
_DRAIN: Recent[str, Drain | None] = Recent(lambda: SERVICE_TIME_TTL_S)
_FRAME: Recent[str, float] = Recent(lambda: SERVICE_TIME_TTL_S)


def _store(session: Session) -> str:
    """The key of ``session``'s job store in the estimate caches: its database URL."""
    return str(session.get_bind().engine.url)


def service_seconds(session: Session, *, settings: Settings) -> float:
    """Seconds of worker time one job costs (``service_estimate``)."""
    return service_estimate(session, settings=settings)[0]


#: A select of some of ``Job``'s columns.
Q = TypeVar("Q", bound=Select[*tuple[Any, ...]])


def _latest_succeeded(query: Q, media: str, limit: int) -> Q:
    """``query`` narrowed to the last ``limit`` jobs of ``media`` (newest first) that ran and
    succeeded: the jobs every estimate samples."""
    return (
        query.where(
            col(Job.status) == JobStatus.succeeded,
            col(Job.started_at).is_not(None),
            col(Job.media) == media,
        )
        .order_by(col(Job.created_at).desc())
        .limit(limit)
    )


def service_estimate(session: Session, *, settings: Settings) -> tuple[float, bool]:
    """``(seconds, measured)``: what one job costs, from the last succeeded jobs (cached a
    few seconds per database), or ``settings.default_service_seconds`` with no history.

    The median over those jobs of what each one cost the queue: for a job that was
    submitted while the one before it was still unfinished, the gap between their finishes
    times the worker slots (what each queued job adds to the wait of the ones behind it);
    for a job submitted to an idle system, its whole latency, created → finished (dispatch,
    worker pick-up, run and sync). Run times alone (started → finished) missed all but the
    run, so a burst was admitted far past what could start in time (fault suite,
    scenario 8).
    """
    return _SERVICE.get(_store(session), lambda: _measure_service(session, settings))


def _measure_service(session: Session, settings: Settings) -> tuple[float, bool]:
    query = _latest_succeeded(
        select(Job.created_at, Job.finished_at, Job.flow_run_id), "photo", SERVICE_TIME_SAMPLE
    )
    rows = session.exec(query).all()
    costs = run_costs(
        [(created, end, run) for created, end, run in rows if end is not None and end >= created],
        slots=settings.worker_slots,
    )
    value = max(0.05, statistics.median(costs)) if costs else settings.default_service_seconds
    return value, bool(costs)


def drain_estimate(session: Session, *, settings: Settings) -> Drain | None:
    """The batching queue's costs from the last succeeded photo jobs (cached like
    ``service_estimate``): a job's compute is the sum of its stage timings; a run's
    overhead is what it cost the queue (``run_costs``, times its jobs) less its jobs'
    compute; each the median. None before any photo job has succeeded (then every job
    costs one service time, as without batching). Measured on fewer than
    ``MIN_DRAIN_JOBS`` jobs (``Drain.settled`` false) it is used with the headroom of
    ``admission_safety``: one slow warm-up job then costs the queue one slow run, not one
    slow run per queued job (fault suite, scenario 1 refused good jobs so)."""
    return _DRAIN.get(_store(session), lambda: _measure_drain(session, settings))


def _measure_drain(session: Session, settings: Settings) -> Drain | None:
    query = _latest_succeeded(
        select(Job.created_at, Job.finished_at, Job.flow_run_id, Job.timings),
        "photo",
        SERVICE_TIME_SAMPLE,
    )
    rows = session.exec(query).all()
    jobs = [
        (created, end, run, sum(float(ms) for ms in (timings or {}).values()) / 1000.0)
        for created, end, run, timings in rows
        if end is not None and end >= created
    ]
    if not jobs:
        return None
    overheads = [
        max(0.0, cost * len(run) - sum(job[3] for job in run))
        for run, cost in run_groups(jobs, slots=settings.worker_slots)
    ]
    return Drain(
        overhead_s=statistics.median(overheads),
        compute_s=max(0.001, statistics.median(job[3] for job in jobs)),
        batch_jobs=settings.batch_max_jobs,
        samples=len(jobs),
    )


def frame_estimate(session: Session, *, settings: Settings) -> float:
    """Worker seconds one video frame costs: the median over the last succeeded video jobs
    of their run time (started → finished) times the workers they could use (their chunks,
    at most the slots) over their frames; ``settings.default_frame_seconds`` with none.
    Cached a few seconds per database, like ``service_estimate``."""
    return _FRAME.get(_store(session), lambda: _measure_frame(session, settings))


def _measure_frame(session: Session, settings: Settings) -> float:
    query = _latest_succeeded(
        select(Job.started_at, Job.finished_at, Job.video_report), "video", VIDEO_SAMPLE
    )
    rows = session.exec(query).all()
    costs = []
    for started, finished, report in rows:
        frames, chunks = int((report or {}).get("frames") or 0), (report or {}).get("chunks")
        if started is None or finished is None or finished < started or frames <= 0:
            continue
        workers = min(int(chunks or 1), settings.worker_slots)
        costs.append((finished - started).total_seconds() * workers / frames)
    return max(0.001, statistics.median(costs)) if costs else settings.default_frame_seconds


FinishedJob = tuple[datetime, datetime, uuid.UUID | None]
#: A finished job as ``run_groups`` reads it: (created, finished, flow run, ...anything).
J = TypeVar("J", bound=tuple[Any, ...])


def run_costs(jobs: Sequence[FinishedJob], *, slots: int) -> list[float]:
    """What each finished job cost the queue (``service_estimate``), from its (created,
    finished, flow run): the jobs of one run (a ``fuse-batch`` run carries several) finish
    together and share their run's cost, so a batch of ``k`` counts ``k`` times its cost / k."""
    return [cost for run, cost in run_groups(jobs, slots=slots) for _job in run]


def run_groups(jobs: Sequence[J], *, slots: int) -> list[tuple[list[J], float]]:
    """The finished jobs grouped by flow run, in finishing order, each run with what each of
    its jobs cost the queue: for a run submitted while the one before it was unfinished,
    the gap between their finishes times the slots, else its whole latency; over its jobs."""
    done = sorted(jobs, key=lambda job: job[1])
    runs: list[list[J]] = []
    for job in done:
        if runs and job[2] is not None and runs[-1][-1][2] == job[2]:
            runs[-1].append(job)
        else:
            runs.append([job])
    groups: list[tuple[list[J], float]] = []
    previous_end: datetime | None = None
    for run in runs:
        created, end = min(job[0] for job in run), max(job[1] for job in run)
        if previous_end is not None and created < previous_end:  # it waited for the one before
            cost = (end - previous_end).total_seconds() * slots
        else:
            cost = (end - created).total_seconds()
        groups.append((run, cost / len(run)))
        previous_end = end
    return groups


def count_active(session: Session, *, owner: User) -> int:
    """The owner's unfinished jobs, counted up to ``quota + 1`` from the (owner, status)
    index: bounded however many there are."""
    unfinished = (
        select(Job.status)
        .where(col(Job.owner_id) == owner.id, col(Job.status).in_(list(ACTIVE_STATUSES)))
        .limit(owner.quota + 1)
        .subquery()
    )
    return int(session.exec(select(sa.func.count()).select_from(unfinished)).one())


def check_capacity(
    *,
    active: int,
    owner: User,
    load: Backlog,
    lane: str,
    queue_timeout_s: int,
    settings: Settings,
    video: bool = False,
) -> None:
    """429 over the owner's quota, 503 when a new job of ``lane`` (or a new video) would
    not start in time (each lane judged by the work it waits behind: a normal burst does
    not refuse a priority job, a long video does not refuse photos)."""
    if active >= owner.quota:
        raise QuotaExceeded(
            f"Too many unfinished jobs: the quota of this API key is {owner.quota}.",
            retry_after=load.wait_s(lane) + load.service_s,
        )
    ahead = load.queued if video else load.ahead(lane)
    over_cap = settings.max_backlog is not None and ahead >= settings.max_backlog
    # The service time measured before a burst understates what each job costs during one
    # (a host shared with the API and the relay, a busier Prefect server): keep headroom.
    # The configured default (no history yet) is a deliberate guess and used as it is.
    safety = settings.admission_safety if load.measured else 1.0
    if load.drain is not None and load.drain.settled:  # measured per run and per job on
        safety = settings.batch_admission_safety  # enough jobs: it carries the load
    expected_wait_s = (load.video_wait_s() if video else load.wait_s(lane)) * safety
    if over_cap or expected_wait_s > queue_timeout_s:
        what = "video work and photo jobs are" if video else f"{ahead} jobs are"
        raise Overloaded(
            f"{what} queued ahead; a new one would not start within {queue_timeout_s} s.",
            retry_after=max(expected_wait_s - queue_timeout_s, 0) + load.service_s,
        )


def reset_service_time_cache() -> None:
    """Forget cached service times (tests; after bulk changes)."""
    for recent in (_SERVICE, _DRAIN, _FRAME):
        recent.clear()
