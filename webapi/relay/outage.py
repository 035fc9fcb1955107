"""Prefect outages in dispatch: one failed call pauses dispatch, a health probe resumes it.

While Prefect is unreachable, trying every claimed dispatch row costs one failed connection
and one warning per row (a thousand queued jobs: a thousand of each per pass), and each row
then waits out its own backoff (up to ``dispatch_backoff_cap_s``) after Prefect is back,
while its queue deadline runs. Instead, the first ``PrefectUnavailable`` puts this replica
in outage mode: the rest of the claimed batch is deferred in one UPDATE (rows marked with
``OUTAGE_MARK`` in ``last_error``), no rows are claimed while the outage lasts, and Prefect's
``/health`` is probed every ``prefect_probe_interval_s`` (doubling, up to the backoff cap,
while outages follow each other without a successful dispatch). Once it answers, every
outage-deferred dispatch row that no replica holds is made due at once. ``cancel_run`` rows
(``webapi.relay.reap``) follow the same outage: none are claimed while it lasts, the first
unreachable cancel defers the rest of its batch, and recovery makes them due too.

Safe with several replicas: each keeps its own outage state; making rows due only touches
rows that are not leased (``lease_until`` past or unset), so it never changes a row another
replica is working on, and doing it twice is harmless.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.engine import CursorResult
from sqlmodel import Session, col

from webapi.models import Outbox, utcnow
from webapi.relay.leases import MAX_ERROR_CHARS

log = logging.getLogger(__name__)

OUTAGE_MARK = "prefect_unavailable: "
"""Prefix of ``last_error`` on rows deferred because Prefect was unreachable."""
OUTAGE_KINDS = ("dispatch", "cancel_run")
"""Outbox kinds that call Prefect and so pause in an outage (webhooks do not)."""


@dataclass
class PrefectOutage:
    """One replica's view of whether Prefect is reachable (used by the dispatch loop)."""

    since: float | None = None
    next_probe: float = 0.0
    streak: int = 0
    """Outages since the last successful dispatch (the probe interval doubles with it)."""

    @property
    def active(self) -> bool:
        return self.since is not None

    def begin(self, *, probe_s: float, cap_s: float, now: float | None = None) -> bool:
        """Enter outage mode (no-op if already in it); whether it was entered now."""
        if self.since is not None:
            return False
        now = time.monotonic() if now is None else now
        self.streak += 1
        self.since = now
        self.next_probe = now + self._interval(probe_s, cap_s)
        return True

    def probe_due(self, now: float | None = None) -> bool:
        return self.active and (time.monotonic() if now is None else now) >= self.next_probe

    def probe_failed(self, *, probe_s: float, cap_s: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.next_probe = now + self._interval(probe_s, cap_s)

    def _interval(self, probe_s: float, cap_s: float) -> float:
        """The probe interval: doubling with each outage since the last dispatch, capped."""
        return min(cap_s, probe_s * 2 ** max(0, self.streak - 1))

    def end(self) -> float:
        """Leave outage mode; how long it lasted (s)."""
        lasted = time.monotonic() - (self.since or time.monotonic())
        self.since = None
        return lasted

    def dispatched(self) -> None:
        """A dispatch went through: the next outage starts with the shortest probe interval."""
        self.streak = 0


def mark(error: str) -> str:
    """``error`` as the ``last_error`` of a row deferred because Prefect was unreachable."""
    return (OUTAGE_MARK + error.removeprefix(OUTAGE_MARK))[:MAX_ERROR_CHARS]


def _rowcount(result: object) -> int:
    assert isinstance(result, CursorResult)
    return int(result.rowcount)


def defer_rows(
    session: Session,
    rows: Sequence[Outbox],
    *,
    owner: str,
    error: str,
    delay_s: float,
    now: datetime | None = None,
) -> int:
    """Release leased dispatch or ``cancel_run`` rows that were not tried (Prefect
    unreachable) to be tried after ``delay_s`` or when Prefect is back, whichever is first;
    one UPDATE, no commit."""
    if not rows:
        return 0
    now = now or utcnow()
    statement = (
        sa.update(Outbox)
        .where(
            col(Outbox.id).in_([row.id for row in rows]),
            col(Outbox.lease_owner) == owner,
            col(Outbox.done_at).is_(None),
        )
        .values(
            next_attempt_at=now + timedelta(seconds=delay_s),
            last_error=mark(error),
            lease_owner=None,
            lease_until=None,
        )
    )
    return _rowcount(session.exec(statement))


def make_due(session: Session, *, now: datetime | None = None) -> int:
    """Make every outage-deferred, unleased, open dispatch or ``cancel_run`` row due now;
    no commit."""
    now = now or utcnow()
    statement = (
        sa.update(Outbox)
        .where(
            col(Outbox.kind).in_(OUTAGE_KINDS),
            col(Outbox.done_at).is_(None),
            col(Outbox.next_attempt_at) > now,
            sa.or_(col(Outbox.lease_until).is_(None), col(Outbox.lease_until) < now),
            col(Outbox.last_error).startswith(OUTAGE_MARK, autoescape=True),
        )
        .values(next_attempt_at=now)
    )
    return _rowcount(session.exec(statement))
