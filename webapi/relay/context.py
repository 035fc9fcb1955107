"""What every relay step needs: the job store, Prefect, storage, settings and timings.

One ``Relay`` value is built by the runner and passed to each step's ``run_once``. Steps
keep database transactions short and never hold one across an HTTP call (SQLite takes
the write lock at ``BEGIN``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime

import httpx
import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlmodel import Session

from webapi import capacity
from webapi.config import Settings
from webapi.db import session_scope
from webapi.models import Outbox, OutboxKind
from webapi.prefect_api import PrefectAPI
from webapi.relay import leases
from webapi.relay.leases import DEFAULT_LEASE_S, replica_id
from webapi.relay.metrics import METRICS, RelayMetrics
from webapi.relay.outage import PrefectOutage
from webapi.storage import ObjectStore


@dataclass(frozen=True)
class RelayTimings:
    """Intervals, batch sizes, grace periods and backoff of the relay loops (seconds)."""

    dispatch_interval_s: float = 0.2
    sync_interval_s: float = 0.5
    # While Prefect's flow-run events arrive (webapi.relay.run_events) sync runs on each
    # event, and sync and reap read the runs over REST only this often (and where an
    # event asks), as the safety net for a missed event.
    sync_safety_net_s: float = 5.0
    expire_interval_s: float = 1.0
    reap_interval_s: float = 1.0
    notify_interval_s: float = 0.5
    batch: int = 50
    lease_s: float = DEFAULT_LEASE_S
    # Dispatch rows are leased briefly: a relay that dies mid-dispatch holds its rows this
    # long, and a job must still start within its queue timeout (default 60 s). Taking a
    # row over is safe: flow-run creation is idempotent and recording the run conditional.
    dispatch_lease_s: float = 15.0
    dispatch_backoff_base_s: float = 0.5
    dispatch_backoff_cap_s: float = 30.0
    # While Prefect is unreachable dispatch claims nothing and probes /health this often
    # (doubling while outages repeat without a dispatch); deferred rows are due on recovery.
    prefect_probe_interval_s: float = 1.0
    running_grace_s: float = 30.0  # Running past deadline_at + this → reaped
    pending_timeout_s: float = 120.0  # Pending this long after its state change → lost
    cancel_grace_s: float = 60.0  # Cancelling this long after the request → forced
    webhook_timeout_s: float = 10.0
    webhook_backoff_base_s: float = 5.0
    webhook_backoff_cap_s: float = 3600.0
    webhook_max_age_s: float = 24 * 3600.0
    webhook_concurrency: int = 8
    # The fetch lane (webapi.relay.fetch_lane); its limits are settings (fetch_*).
    fetch_interval_s: float = 0.2
    fetch_max_redirects: int = 3
    # A fetch row's lease outlasts the fetch deadline by this (storing, the job update).
    fetch_lease_margin_s: float = 10.0


@dataclass(frozen=True)
class Noted:
    """A run that an event said started (``at``: the RUNNING event's time) or ended (``at``
    None), and how often sync has taken it up again (an event can come before the relay or
    Prefect's REST API can act on it)."""

    run_id: str
    at: datetime | None = None
    tries: int = 0


class RunNews:
    """What Prefect's flow-run events told the relay, kept (thread-safe) until sync takes
    it: runs that started, runs that ended, and the times at which sync should pass
    (``time.monotonic``), reading the runs over REST or not."""

    def __init__(self) -> None:
        self._started: dict[str, tuple[Noted, float]] = {}
        self._ended: dict[str, tuple[Noted, float]] = {}
        self._passes: list[tuple[float, bool, str]] = []
        self._lock = threading.Lock()

    def started(self, run_id: str, at: datetime) -> None:
        """Note that ``run_id`` went RUNNING at ``at``."""
        with self._lock:
            self._started.setdefault(run_id, (Noted(run_id, at), 0.0))

    def ended(self, run_id: str) -> None:
        """Note that ``run_id`` reached a final state whose outcome its flow may have
        stored."""
        with self._lock:
            self._ended.setdefault(run_id, (Noted(run_id), 0.0))

    def again(self, noted: Noted, after_s: float, *, read: bool) -> None:
        """Take ``noted`` up again in a pass ``after_s`` seconds from now (that reads the
        runs when ``read``)."""
        due = time.monotonic() + after_s
        retry = Noted(noted.run_id, noted.at, noted.tries + 1)
        with self._lock:
            (self._ended if noted.at is None else self._started).setdefault(
                noted.run_id, (retry, due)
            )
            self._passes.append((due, read, "sync"))

    def read(self, after_s: Iterable[float] = (0.0,), *, steps: Iterable[str] = ("sync",)) -> None:
        """Ask for a pass of each of ``steps`` (sync, reap) that reads the runs ``after_s``
        seconds from now (each)."""
        now = time.monotonic()
        with self._lock:
            self._passes.extend((now + delay, True, step) for delay in after_s for step in steps)

    def take_started(self) -> list[Noted]:
        """The started runs due now."""
        return self._take(self._started)

    def take_ended(self) -> list[Noted]:
        """The ended runs due now."""
        return self._take(self._ended)

    def _take(self, noted: dict[str, tuple[Noted, float]]) -> list[Noted]:
        now = time.monotonic()
        with self._lock:
            due = [run for run, at in noted.values() if at <= now]
            for run in due:
                del noted[run.run_id]
        return due

    def take_read(self, step: str = "sync") -> bool:
        """Whether a pass of ``step`` that reads the runs is due now; its passes due now
        are done."""
        now = time.monotonic()
        with self._lock:
            due = [read for at, read, of in self._passes if of == step and at <= now]
            self._passes = [p for p in self._passes if p[2] != step or p[0] > now]
        return any(due)

    def wait_s(self, step: str = "sync") -> float | None:
        """Seconds until ``step``'s next asked pass (0 when one is due); None when none
        is."""
        with self._lock:
            asked = [at for at, _read, of in self._passes if of == step]
        return max(0.0, min(asked) - time.monotonic()) if asked else None


def _sleep(seconds: float) -> bool:
    """``Relay.nap`` outside a runner: nothing can wake it."""
    time.sleep(seconds)
    return False


@dataclass
class Relay:
    """The relay's dependencies; ``owner`` names this replica in outbox leases."""

    engine: Engine
    prefect: PrefectAPI
    store: ObjectStore
    settings: Settings
    timings: RelayTimings = field(default_factory=RelayTimings)
    owner: str = field(default_factory=replica_id)
    metrics: RelayMetrics = METRICS
    outage: PrefectOutage = field(default_factory=PrefectOutage)
    reading_progress: bool = False  # a video job runs: sync polls fast for its progress
    http: httpx.Client = field(default_factory=lambda: httpx.Client(follow_redirects=False))
    wake: Callable[[str], None] = field(default=lambda _step: None)
    """Run a relay step's loop now (set by ``RelayRunner``; a no-op for single passes)."""
    nap: Callable[[str, float], bool] = field(default=lambda _step, seconds: _sleep(seconds))
    """Wait up to the seconds given inside a pass of a step, True as soon as that step's loop
    is woken meanwhile (set by ``RelayRunner``; a plain sleep for single passes)."""
    news: RunNews = field(default_factory=RunNews)
    """What flow-run events said, for sync's next pass (``sync.start_from_events``,
    ``sync.settle_ended``)."""

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A short-lived job-store session (closed, and rolled back if uncommitted)."""
        with session_scope(self.engine) as session:
            yield session

    def claim(
        self,
        kind: OutboxKind,
        *,
        lease_s: float | None = None,
        job_filter: sa.ColumnElement[bool] | None = None,
    ) -> list[Outbox]:
        """Lease up to ``timings.batch`` due outbox rows of ``kind`` for this replica (of
        jobs matching ``job_filter``, when given)."""
        with self.session() as session:
            return leases.claim(
                session,
                kinds=[kind],
                owner=self.owner,
                limit=self.timings.batch,
                lease_s=lease_s or self.timings.lease_s,
                job_filter=job_filter,
            )

    def expected_cost_s(self) -> float:
        """Time one attempt is expected to need (median of recent runs, else the setting):
        no re-dispatch starts with less time left."""
        with self.session() as session:
            value = capacity.service_seconds(session, settings=self.settings)
            session.commit()
        return value

    def close(self) -> None:
        """Close the HTTP clients (the engine belongs to the caller)."""
        self.http.close()
        self.prefect.close()
