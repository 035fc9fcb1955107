"""Outbox leases: how N relay replicas share the outbox without processing a row twice.

A replica claims due rows by setting ``lease_owner``/``lease_until``. On PostgreSQL the
candidates are selected ``FOR UPDATE SKIP LOCKED`` (concurrent claimers skip each other's
rows); on SQLite (one writer at a time) each row is taken with a conditional UPDATE that
only succeeds while the row is unleased or its lease has expired. A replica that dies
mid-row loses the lease at ``lease_until`` and another takes over. Finishing or
rescheduling a row is conditional on still holding the lease.
"""

from __future__ import annotations

import os
import random
import socket
import uuid
from collections.abc import Sequence
from datetime import datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.engine import CursorResult
from sqlmodel import Session, col, select

from webapi.models import Job, Outbox, OutboxKind, OutboxOutcome, utcnow

DEFAULT_LEASE_S = 60.0
MAX_ERROR_CHARS = 1000


def replica_id() -> str:
    """A lease-owner name unique to this relay instance (host, pid, random suffix)."""
    return f"{socket.gethostname()[:60]}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def backoff_s(attempts: int, *, base_s: float = 0.5, cap_s: float = 30.0) -> float:
    """Exponential backoff with full jitter: uniform in [cap/2, cap] of ``base * 2**n``.

    Half the nominal delay is kept so the delay still grows with ``attempts``.
    """
    nominal = min(cap_s, base_s * (2 ** max(0, attempts - 1)))
    return random.uniform(nominal / 2, nominal)


def _rowcount(result: object) -> int:
    assert isinstance(result, CursorResult)
    return int(result.rowcount)


def _due(kinds: Sequence[OutboxKind], now: datetime) -> sa.ColumnElement[bool]:
    return sa.and_(
        col(Outbox.kind).in_(list(kinds)),
        col(Outbox.done_at).is_(None),
        col(Outbox.next_attempt_at) <= now,
        sa.or_(col(Outbox.lease_until).is_(None), col(Outbox.lease_until) < now),
    )


def claim(
    session: Session,
    *,
    kinds: Sequence[OutboxKind],
    owner: str,
    limit: int = 50,
    lease_s: float = DEFAULT_LEASE_S,
    now: datetime | None = None,
    job_filter: sa.ColumnElement[bool] | None = None,
) -> list[Outbox]:
    """Lease up to ``limit`` due rows of ``kinds`` for ``owner`` and commit; oldest due first.
    ``job_filter`` (a condition on ``Job``) takes only rows whose job matches it.

    Returns the claimed rows (detached from any lock: the lease is the claim).
    """
    now = now or utcnow()
    until = now + timedelta(seconds=lease_s)
    candidates = (
        select(Outbox.id)
        .where(_due(kinds, now))
        .order_by(col(Outbox.next_attempt_at), col(Outbox.created_at))
        .limit(limit)
    )
    if job_filter is not None:
        candidates = candidates.where(
            sa.exists().where(col(Job.id) == col(Outbox.job_id), job_filter)
        )
    postgres = session.get_bind().dialect.name == "postgresql"
    if postgres:
        candidates = candidates.with_for_update(skip_locked=True)
    ids = list(session.exec(candidates).all())
    claimed: list[uuid.UUID] = []
    for row_id in ids:
        # On PostgreSQL the row is already locked by us; on SQLite this conditional
        # UPDATE is the claim itself (another replica may have leased it meanwhile).
        taken = session.exec(
            sa.update(Outbox)
            .where(col(Outbox.id) == row_id, _due(kinds, now))
            .values(lease_owner=owner, lease_until=until)
        )
        if _rowcount(taken) == 1:
            claimed.append(row_id)
    session.commit()
    if not claimed:
        return []
    rows = session.exec(select(Outbox).where(col(Outbox.id).in_(claimed))).all()
    order = {row_id: i for i, row_id in enumerate(claimed)}
    return sorted(rows, key=lambda row: order[row.id])


def _held(row: Outbox, owner: str) -> sa.ColumnElement[bool]:
    return sa.and_(
        col(Outbox.id) == row.id,
        col(Outbox.lease_owner) == owner,
        col(Outbox.done_at).is_(None),
    )


def finish(
    session: Session,
    row: Outbox,
    *,
    owner: str,
    outcome: OutboxOutcome = "done",
    error: str | None = None,
    now: datetime | None = None,
) -> bool:
    """Close a leased row (``done``, ``obsolete`` or ``gave_up``) if ``owner`` still holds it.

    Does not commit: callers commit it together with the job change it belongs to.
    """
    values: dict[str, object] = {
        "done_at": now or utcnow(),
        "outcome": outcome,
        "lease_owner": None,
        "lease_until": None,
    }
    if error is not None:
        values["last_error"] = error[:MAX_ERROR_CHARS]
    return _rowcount(session.exec(sa.update(Outbox).where(_held(row, owner)).values(**values))) == 1


def reschedule(
    session: Session,
    row: Outbox,
    *,
    owner: str,
    error: str,
    delay_s: float,
    count_attempt: bool = True,
    now: datetime | None = None,
) -> bool:
    """Release a leased row to be tried again after ``delay_s`` (attempts + 1). No commit."""
    now = now or utcnow()
    values: dict[str, object] = {
        "next_attempt_at": now + timedelta(seconds=delay_s),
        "last_error": error[:MAX_ERROR_CHARS],
        "lease_owner": None,
        "lease_until": None,
    }
    if count_attempt:
        values["attempts"] = col(Outbox.attempts) + 1
    return _rowcount(session.exec(sa.update(Outbox).where(_held(row, owner)).values(**values))) == 1


def release(session: Session, row: Outbox, *, owner: str, now: datetime | None = None) -> bool:
    """Hand a leased row on, due now and with its attempts reset: one stage of its work is
    done and the next (another step's) starts afresh. No commit."""
    values: dict[str, object] = {
        "next_attempt_at": now or utcnow(),
        "attempts": 0,
        "lease_owner": None,
        "lease_until": None,
    }
    return _rowcount(session.exec(sa.update(Outbox).where(_held(row, owner)).values(**values))) == 1


def pending_count(session: Session, *, kinds: Sequence[OutboxKind]) -> int:
    """How many rows of ``kinds`` are not done yet (for metrics and tests)."""
    query = (
        select(sa.func.count())
        .select_from(Outbox)
        .where(col(Outbox.kind).in_(list(kinds)), col(Outbox.done_at).is_(None))
    )
    return int(session.exec(query).one())
