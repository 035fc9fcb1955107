"""Prometheus metrics of the API: jobs by status, queue depth, submit latency.

One registry per app (``ApiMetrics``), so test apps do not share series. Job counts are
read from the job store at scrape time (every replica reports the same truth). The
relay's counters and dispatch-lag histogram (``webapi.relay.metrics.METRICS``, in-process)
are appended to the same response when the relay module is present.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy.engine import Engine
from sqlmodel import Session

from webapi import crud
from webapi.models import JobStatus

log = logging.getLogger(__name__)

SUBMIT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class JobStoreCollector(Collector):
    """Jobs by status and queue depth, queried when scraped."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[GaugeMetricFamily]:
        by_status = GaugeMetricFamily(
            "faceflow_jobs", "Jobs in the job store by status.", labels=["status"]
        )
        depth = GaugeMetricFamily("faceflow_queue_depth", "Jobs queued and not yet running.")
        try:
            with Session(self.engine) as session:
                counts = crud.status_counts(session)
        except Exception:  # a scrape must not fail because the database is down
            log.warning("metrics: job store unavailable", exc_info=True)
            return
        for status, count in counts.items():
            by_status.add_metric([status.value], count)
        depth.add_metric([], counts[JobStatus.queued])
        yield by_status
        yield depth


class ApiMetrics:
    """The metrics of one app; ``extra`` renderers add text (the relay's counters)."""

    def __init__(self, engine: Engine) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.submit_latency = Histogram(
            "faceflow_submit_latency_seconds",
            "Time to accept POST /v1/jobs (until the 202), by outcome.",
            labelnames=["outcome"],
            buckets=SUBMIT_BUCKETS_S,
            registry=self.registry,
        )
        self.registry.register(JobStoreCollector(engine))
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
