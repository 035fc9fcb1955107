"""Retention: delete what has expired — inputs, results, then job rows — and nothing else.

Inputs and results are personal photos: they are kept for the job's retention times
(fixed at submit from the owner, else ``FACEFLOW_INPUT_RETENTION_SECONDS``, default 0 —
deleted at the first pass after the job ends — and ``FACEFLOW_RESULT_RETENTION_SECONDS``,
default 24 h), counted from the job's end (``jobstate`` sets ``inputs_purge_at`` and
``result_purge_at`` on the terminal move). A job that has not ended has no purge time, so
nothing of it is deleted. One pass (``run_pass``), in batches of ``retention_batch``:

1. **Inputs** of due jobs (source, target, and a per-face mapping's other sources and
   references), and a video job's rendered chunks (partial work of a cancelled or
   failed job included) as its attempts listed them. Inputs are stored by content hash, so one object may serve
   several jobs: a key still used by a job that has not ended, or whose own inputs are
   not due, is kept. The check and the deletion run under the admission lock
   (``crud.serialise_admission``; SQLite: the write lock) and mark the jobs
   (``inputs_purged_at``) in the same transaction; a submit that found an input already
   stored and is admitted after that sees the mark and stores the input again
   (``crud.inputs_purged_since``).
2. **Results** of due jobs: every attempt's image and sidecar (``results/<job>/…``); the job
   gets ``result_expired_at`` and ``GET /v1/jobs/{id}/result`` answers 410.
3. **Rows** of jobs that ended more than ``job_retention_seconds`` ago and have nothing left
   to purge: the job, its outbox rows and its webhook attempts (kept until then for audit).
4. **Leftovers** of killed writers (local storage): temporary files of writes that never
   reached their rename (``tasks.partials.partial_name``), older than an hour.

The ``retention`` deployment (prefect.yaml, ``flows/retention.py``) runs a pass every five
minutes on the control pool; ``faceflow retention run`` runs one by hand.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from typing import get_args

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from flows.params import (
    analysis_manifest_key,
    analysis_part_of,
    chunk_part,
    chunks_manifest_key,
    part_progress_key,
    progress_key,
    result_error_key,
    result_key,
    result_meta_key,
    video_analysis_key,
    video_chunk_key,
    video_plan_key,
    video_report_key,
)
from tasks.options import OutputFormat
from webapi import crud
from webapi.config import Settings
from webapi.db import session_scope
from webapi.models import TERMINAL_STATUSES, Job, Outbox, WebhookDelivery, utcnow
from webapi.storage import LocalObjectStore, ObjectNotFound, ObjectStore, StorageError

log = logging.getLogger(__name__)

CHUNKS = video_chunk_key("")
"""The prefix of every rendered video chunk's key."""
ANALYSES = video_analysis_key("")
"""The prefix of every analysed video frame range's key."""
RESULT_FORMATS: tuple[str, ...] = (*get_args(OutputFormat), "mp4")
PARTIAL_MAX_AGE_S = 3600.0
"""A temporary file of a write older than this (s) is a killed writer's: no write of the
largest object (a 500 MB video) takes that long."""


@dataclass
class RetentionReport:
    """What one pass did."""

    input_jobs: int = 0
    """Jobs whose inputs were due and are now handled."""
    input_objects: int = 0
    """Input objects deleted."""
    inputs_shared: int = 0
    """Input objects kept because a job that is not due still uses them."""
    result_jobs: int = 0
    """Jobs whose result (and every attempt's files) was deleted."""
    results_expired: int = 0
    """Of those, jobs that had a result: now ``result_expired``."""
    rows_deleted: int = 0
    """Job rows deleted (with their outbox rows and webhook attempts)."""
    partials_deleted: int = 0
    """Temporary files of writes killed before their rename (local storage only)."""
    seconds: float = 0.0

    def as_dict(self) -> dict[str, float]:
        """The report as a flat mapping (logs, artifacts)."""
        return asdict(self)


def run_pass(
    engine: Engine, store: ObjectStore, settings: Settings, *, now: datetime | None = None
) -> RetentionReport:
    """One retention pass over everything due at ``now`` (default: the current time)."""
    now = now or utcnow()
    report = RetentionReport()
    started = time.perf_counter()
    batch = settings.retention_batch
    while _purge_inputs(engine, store, now, batch, report) == batch:
        pass
    while _expire_results(engine, store, now, batch, report) == batch:
        pass
    cutoff = now - timedelta(seconds=settings.job_retention_seconds)
    while _delete_rows(engine, cutoff, batch, report) == batch:
        pass
    if isinstance(store, LocalObjectStore):
        report.partials_deleted = store.sweep_partials(PARTIAL_MAX_AGE_S, now=now.timestamp())
    report.seconds = time.perf_counter() - started
    log.info("retention pass", extra=report.as_dict())
    return report


# --------------------------------------------------------------------------- inputs


def _purge_inputs(
    engine: Engine, store: ObjectStore, now: datetime, batch: int, report: RetentionReport
) -> int:
    """Delete the inputs of up to ``batch`` due jobs; returns how many jobs were due."""
    with session_scope(engine) as session:
        crud.serialise_admission(session)
        due = session.execute(
            sa.select(
                col(Job.id), col(Job.source_key), col(Job.target_key), col(Job.extra_inputs),
                col(Job.attempts),
            )
            .where(col(Job.inputs_purge_at) <= now)
            .order_by(col(Job.inputs_purge_at))
            .limit(batch)
        ).all()  # fmt: skip
        if not due:
            session.commit()
            return 0
        ids = [job_id for job_id, _, _, _, _ in due]
        keys = {
            key
            for _, source, target, extra, _ in due
            for key in (source, target, *crud.extra_input_keys(extra))
            if key
        }
        kept = keys_in_use(session, keys=keys, now=now)
        chunks = [k for job_id, *_, attempts in due for k in chunk_keys(store, job_id, attempts)]
        doomed = sorted((keys - kept) | set(chunks))
        try:
            store.delete(doomed)
        except (StorageError, OSError):
            # Some may be gone: mark the jobs (a submit reusing one stores it again) but
            # keep them due, so the next pass deletes the rest.
            _mark_inputs(session, ids, now, done=False)
            session.commit()
            raise
        _mark_inputs(session, ids, now, done=True)
        session.commit()
    report.input_jobs += len(ids)
    report.input_objects += len(doomed)
    report.inputs_shared += len(kept)
    return len(ids)


def chunk_keys(store: ObjectStore, job_id: uuid.UUID, attempts: int) -> list[str]:
    """The rendered chunks and analysed frame ranges a video job's attempts listed
    (``chunks_manifest_key``, ``analysis_manifest_key``), the lists themselves, the
    attempts' plans (faces of every frame) and their range and render parts' frame counts;
    none for a photo job (it has no list)."""
    found: list[str] = []
    for attempt in range(1, attempts + 1):
        analysed = analysis_manifest_key(str(job_id), attempt)
        ranges = _listed(store, analysed)
        if ranges is not None:
            keys = [key for key in ranges if isinstance(key, str) and key.startswith(ANALYSES)]
            found += keys
            found += [analysed, video_plan_key(str(job_id), attempt)]
            parts = [part for key in keys if (part := analysis_part_of(key)) is not None]
            found += [part_progress_key(str(job_id), attempt, part) for part in parts]
        manifest = chunks_manifest_key(str(job_id), attempt)
        listed = _listed(store, manifest)
        if listed is None:
            continue
        found += [key for key in listed if isinstance(key, str) and key.startswith(CHUNKS)]
        found += [manifest, video_plan_key(str(job_id), attempt)]
        found += [
            part_progress_key(str(job_id), attempt, chunk_part(i)) for i in range(len(listed))
        ]
        found.append(video_report_key(str(job_id), attempt))
    return list(dict.fromkeys(found))


def _listed(store: ObjectStore, key: str) -> list[object] | None:
    """The JSON list stored under ``key`` (empty when unreadable: the list goes, what it
    names stays for an operator); None when there is none."""
    try:
        listed = json.loads(store.get(key))
    except ObjectNotFound:
        return None
    except ValueError:
        return []
    return listed if isinstance(listed, list) else []


def keys_in_use(session: Session, *, keys: set[str], now: datetime) -> set[str]:
    """The input keys among ``keys`` that a job whose inputs are not due still uses: a job
    that has not ended (no purge time, never purged) or one whose purge time is later."""
    live = sa.or_(
        sa.and_(col(Job.inputs_purge_at).is_(None), col(Job.inputs_purged_at).is_(None)),
        col(Job.inputs_purge_at) > now,
    )
    return {key for key, _ in crud.input_key_uses(session, keys=keys, where=live)}


def _mark_inputs(session: Session, ids: Sequence[uuid.UUID], now: datetime, *, done: bool) -> None:
    values: dict[str, object] = {"inputs_purged_at": now}
    if done:
        values["inputs_purge_at"] = None
    session.execute(
        sa.update(Job)
        .where(col(Job.id).in_(list(ids)))
        .values(**values)
        .execution_options(synchronize_session=False)
    )


# --------------------------------------------------------------------------- results


def result_keys(job_id: uuid.UUID, attempts: int) -> list[str]:
    """Every key a job's attempts may have written: image (any format) or video, sidecar,
    failure record and a video's progress record and plan."""
    keys: list[str] = []
    for attempt in range(1, max(attempts, 1) + 1):
        keys += [result_key(str(job_id), attempt, ext) for ext in RESULT_FORMATS]
        keys += [
            result_meta_key(str(job_id), attempt),
            result_error_key(str(job_id), attempt),
            progress_key(str(job_id), attempt),
            video_plan_key(str(job_id), attempt),
        ]
    return keys


def _expire_results(
    engine: Engine, store: ObjectStore, now: datetime, batch: int, report: RetentionReport
) -> int:
    """Delete the results of up to ``batch`` due jobs; returns how many jobs were due."""
    with session_scope(engine) as session:
        due = session.exec(
            select(Job.id, Job.attempts, Job.result_key)
            .where(col(Job.result_purge_at) <= now)
            .order_by(col(Job.result_purge_at))
            .limit(batch)
        ).all()
        session.commit()
    if not due:
        return 0
    store.delete([key for job_id, attempts, _ in due for key in result_keys(job_id, attempts)])
    ids = [job_id for job_id, _, _ in due]
    with session_scope(engine) as session:
        session.execute(
            sa.update(Job)
            .where(col(Job.id).in_(ids))
            .values(
                result_purge_at=None,
                result_expired_at=sa.case(
                    (col(Job.result_key).is_not(None), now), else_=col(Job.result_expired_at)
                ),
            )
            .execution_options(synchronize_session=False)
        )
        session.commit()
    report.result_jobs += len(ids)
    report.results_expired += sum(1 for _, _, key in due if key)
    return len(ids)


# --------------------------------------------------------------------------- rows


def _delete_rows(engine: Engine, cutoff: datetime, batch: int, report: RetentionReport) -> int:
    """Delete up to ``batch`` job rows past their audit time; returns how many."""
    with session_scope(engine) as session:
        ids = list(
            session.exec(
                select(Job.id)
                .where(
                    col(Job.status).in_(list(TERMINAL_STATUSES)),
                    col(Job.finished_at) <= cutoff,
                    col(Job.inputs_purge_at).is_(None),
                    col(Job.result_purge_at).is_(None),
                )
                .order_by(col(Job.finished_at))
                .limit(batch)
            ).all()
        )
        if ids:
            for table, column in (
                (WebhookDelivery, WebhookDelivery.job_id),
                (Outbox, Outbox.job_id),
                (Job, Job.id),
            ):
                session.execute(
                    sa.delete(table)
                    .where(col(column).in_(ids))
                    .execution_options(synchronize_session=False)
                )
        session.commit()
    report.rows_deleted += len(ids)
    return len(ids)


def run_pass_from_settings(settings: Settings | None = None) -> RetentionReport:
    """One pass with the job store and storage the settings name (the flow, the CLI)."""
    from webapi.config import get_settings
    from webapi.db import get_engine
    from webapi.migrations import check_migrated
    from webapi.storage import open_store

    settings = settings or get_settings()
    engine = get_engine(settings.database_url)
    check_migrated(engine)
    store = open_store(settings.storage_url, s3_endpoint_url=settings.s3_endpoint_url)
    return run_pass(engine, store, settings)
