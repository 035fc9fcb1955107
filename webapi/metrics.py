"""Prometheus metrics of the API: jobs by status, queue depth, submit latency, the
autoscaling signal and the restart counters of supervised services.

One registry per app (``ApiMetrics``), so test apps do not share series. Job counts are
read from the job store at scrape time (every replica reports the same truth). The
relay's counters and dispatch-lag histogram (``webapi.relay.metrics.METRICS``, in-process)
are appended to the same response when the relay module is present.

Autoscaling (``docs/operations.md``): per lane, the queued jobs, the oldest one's age and
the estimated wait of a new job (``capacity.Backlog.wait_s``: jobs ahead plus half the running
ones, times the measured service time, over ``worker_slots``); jobs running; and
``faceflow_gpu_workers_wanted`` = ⌈running + queued * service time / target wait⌉, the
workers that would start every queued job within ``autoscale_target_wait_seconds``
(what the KEDA ScaledObject in ``work_pools/keda/`` scales the GPU workers to).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy.engine import Engine
from sqlmodel import Session

from webapi import capacity, crud
from webapi.config import Settings
from webapi.models import JobStatus, utcnow
from webapi.services import read_records

log = logging.getLogger(__name__)

SUBMIT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def workers_wanted(*, running: int, queued: int, service_s: float, target_wait_s: float) -> int:
    """GPU workers that would start every queued job within ``target_wait_s``: one per
    running job, plus the queued jobs' work (``queued * service_s``) spread over the target
    wait. Zero when nothing is queued or running (scale to zero)."""
    return math.ceil(running + queued * service_s / target_wait_s - 1e-9)


class JobStoreCollector(Collector):
    """Jobs by status, queue depth, the autoscaling signal per lane, queried when scraped."""

    def __init__(self, engine: Engine, settings: Settings) -> None:
        self.engine = engine
        self.settings = settings

    def collect(self) -> Iterator[GaugeMetricFamily]:
        by_status = GaugeMetricFamily(
            "faceflow_jobs", "Jobs in the job store by status.", labels=["status"]
        )
        depth = GaugeMetricFamily("faceflow_queue_depth", "Jobs queued and not yet running.")
        try:
            with Session(self.engine) as session:
                counts = crud.status_counts(session)
                load = capacity.backlog(session, settings=self.settings)
                oldest = crud.oldest_queued(session)
                session.commit()
        except Exception:  # a scrape must not fail because the database is down
            log.warning("metrics: job store unavailable", exc_info=True)
            return
        for status, count in counts.items():
            by_status.add_metric([status.value], count)
        depth.add_metric([], counts[JobStatus.queued])
        yield by_status
        yield depth
        yield from self._autoscaling(load, oldest)

    def _autoscaling(
        self, load: capacity.Backlog, oldest: Mapping[str, datetime]
    ) -> Iterator[GaugeMetricFamily]:
        now = utcnow()

        def age_s(lane: str) -> float:
            created = oldest.get(lane)
            return max(0.0, (now - created).total_seconds()) if created is not None else 0.0

        queued = _per_lane(
            "faceflow_lane_queued_jobs",
            "Jobs queued per lane.",
            lambda lane: load.queued_by_lane.get(lane, 0),
        )
        age = _per_lane(
            "faceflow_lane_oldest_queued_age_seconds",
            "Age of the oldest queued job per lane (0 when none).",
            age_s,
        )
        wait = _per_lane(
            "faceflow_lane_estimated_wait_seconds",
            "Estimated wait before a new job of the lane starts.",
            load.wait_s,
        )
        running = GaugeMetricFamily(
            "faceflow_jobs_running", "Jobs running (or being cancelled).", value=load.running
        )
        service = GaugeMetricFamily(
            "faceflow_service_time_seconds",
            "Worker time one job costs (measured on recent jobs, else the configured default).",
            value=load.service_s,
        )
        video = load.video or capacity.VideoBacklog(0, 0, 0, 0.0)
        wanted = GaugeMetricFamily(
            "faceflow_gpu_workers_wanted",
            "GPU workers that would start every queued job within the target wait.",
            value=workers_wanted(
                running=load.running + video.running,
                queued=load.queued,
                service_s=load.service_s,
                target_wait_s=self.settings.autoscale_target_wait_seconds,
            ),
        )
        frames = GaugeMetricFamily(
            "faceflow_video_frames",
            "Video frames to render: of queued videos, and left in running ones.",
            labels=["state"],
        )
        frames.add_metric(["queued"], video.frames_queued)
        frames.add_metric(["left"], video.frames_left)
        frame_s = GaugeMetricFamily(
            "faceflow_video_frame_seconds",
            "Worker time one video frame costs (recent videos, else the configured default).",
            value=video.frame_s,
        )
        video_wait = GaugeMetricFamily(
            "faceflow_video_estimated_wait_seconds",
            "Estimated wait before a new video starts.",
            value=load.video_wait_s(),
        )
        yield from (queued, age, wait, running, service, wanted, frames, frame_s, video_wait)


def _per_lane(name: str, documentation: str, value: Callable[[str], float]) -> GaugeMetricFamily:
    """A gauge labelled ``lane`` with ``value(lane)`` for every lane."""
    gauge = GaugeMetricFamily(name, documentation, labels=["lane"])
    for lane in capacity.LANES:
        gauge.add_metric([lane], value(lane))
    return gauge


class ServiceCollector(Collector):
    """Start and restart counts of the supervised services (``webapi.services``)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def collect(self) -> Iterator[CounterMetricFamily]:
        starts = CounterMetricFamily(
            "faceflow_service_starts", "Starts of each supervised service.", labels=["service"]
        )
        restarts = CounterMetricFamily(
            "faceflow_service_restarts",
            "Restarts of each supervised service (starts after the first).",
            labels=["service"],
        )
        for record in read_records(self.settings.services_dir):
            starts.add_metric([record.service], record.starts)
            restarts.add_metric([record.service], record.restarts)
        yield starts
        yield restarts


class ApiMetrics:
    """The metrics of one app; ``extra`` renderers add text (the relay's counters)."""

    def __init__(self, engine: Engine, settings: Settings) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.submit_latency = Histogram(
            "faceflow_submit_latency_seconds",
            "Time to accept POST /v1/jobs (until the 202), by outcome.",
            labelnames=["outcome"],
            buckets=SUBMIT_BUCKETS_S,
            registry=self.registry,
        )
        self.registry.register(JobStoreCollector(engine, settings))
        self.registry.register(ServiceCollector(settings))
        self.extra: list[Callable[[], str]] = []
        relay_metrics = _relay_metrics()
        if relay_metrics is not None:
            self.extra.append(relay_metrics)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        text = generate_latest(self.registry)
        for render in self.extra:
            text += render().encode()
        return text


def _relay_metrics() -> Callable[[], str] | None:
    try:
        from webapi.relay.metrics import METRICS
    except ImportError:
        return None
    return METRICS.render
