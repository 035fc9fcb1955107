"""One retention pass over 1,000 expired jobs, on a real job store and real storage.

Builds a migrated job store (SQLite, or a fresh PostgreSQL schema with ``--database
postgresql``) and storage (a local directory, or a moto S3 server with ``--storage s3``),
then: N jobs that ended long ago (inputs and result due), M that ended a minute ago with a
24 h result retention (inputs due, result not), and K queued jobs, half of them sharing
an input with an expired job. Times ``webapi.retention.run_pass`` and checks that nothing
that was not due changed: the fresh results and every input of the queued jobs are
still stored, and their rows are as before.

    .venv/bin/python bench/retention.py [--jobs 1000] [--database postgresql] [--storage s3]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import sqlalchemy as sa
from sqlmodel import Session, col, select

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from faceflow.testing.databases import job_store
from faceflow.testing.s3 import ACCESS_KEY, REGION, SECRET_KEY, moto_server
from flows.params import input_key, result_key, result_meta_key
from webapi.config import Settings
from webapi.db import get_engine
from webapi.models import Job, JobStatus, User, utcnow
from webapi.retention import run_pass
from webapi.storage import ObjectStore, open_store


@contextmanager
def storage(kind: str, tmp: Path) -> Iterator[tuple[str, str | None]]:
    if kind == "local":
        yield (tmp / "storage").as_uri(), None
        return
    for name, value in (
        ("AWS_ACCESS_KEY_ID", ACCESS_KEY),
        ("AWS_SECRET_ACCESS_KEY", SECRET_KEY),
        ("AWS_DEFAULT_REGION", REGION),
    ):
        os.environ.setdefault(name, value)
    with moto_server(tmp, "bench") as endpoint:
        yield "s3://bench/retention", endpoint


def populate(
    engine: sa.Engine, store: ObjectStore, *, expired: int, fresh: int, queued: int
) -> dict[str, list[uuid.UUID]]:
    now = utcnow()
    owner = User(name=f"bench-{uuid.uuid4().hex[:6]}", quota=10**6, webhook_secret="whsec_x")
    groups: dict[str, list[uuid.UUID]] = {"expired": [], "fresh": [], "queued": []}
    jobs: list[Job] = []
    for group, count in (("expired", expired), ("fresh", fresh), ("queued", queued)):
        for index in range(count):
            job_id = uuid.uuid4()
            data = f"{group}-{index}".encode()
            source = input_key(hashlib.sha256(data + b"s").hexdigest(), "jpeg")
            if group == "queued" and index % 2 == 0 and jobs:
                source = jobs[index].source_key or source  # shared with an expired job
            target = input_key(hashlib.sha256(data + b"t").hexdigest(), "png")
            for key in (source, target):
                store.put(key, data)
            ended = group != "queued"
            finished = now - (timedelta(days=2) if group == "expired" else timedelta(minutes=1))
            result = result_key(str(job_id), 1, "png") if ended else None
            if result is not None:
                store.put(result, data)
                store.put(result_meta_key(str(job_id), 1), b"{}")
            jobs.append(
                Job(
                    id=job_id,
                    owner_id=owner.id,
                    input_digest="0" * 64,
                    source_key=source,
                    target_key=target,
                    status=JobStatus.succeeded if ended else JobStatus.queued,
                    attempts=1 if ended else 0,
                    created_at=finished - timedelta(seconds=5),
                    updated_at=finished,
                    queue_deadline_at=now + timedelta(minutes=1),
                    deadline_at=now + timedelta(minutes=2),
                    started_at=finished - timedelta(seconds=3) if ended else None,
                    finished_at=finished if ended else None,
                    result_key=result,
                    result_content_type="image/png" if ended else None,
                    inputs_purge_at=finished if ended else None,
                    result_purge_at=finished + timedelta(seconds=86400) if ended else None,
                )
            )
            groups[group].append(job_id)
    with Session(engine) as session:
        session.add(owner)
        session.flush()
        session.add_all(jobs)
        session.commit()
    return groups


def snapshot(engine: sa.Engine, ids: list[uuid.UUID]) -> dict[uuid.UUID, tuple[object, ...]]:
    with Session(engine) as session:
        rows = session.exec(select(Job).where(col(Job.id).in_(ids))).all()
        return {
            job.id: (
                job.status,
                job.result_key,
                job.result_purge_at,
                job.result_expired_at,
                job.inputs_purge_at,
                job.inputs_purged_at,
            )
            for job in rows
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1000, help="expired jobs")
    parser.add_argument("--fresh", type=int, default=100, help="jobs whose result is not due")
    parser.add_argument("--queued", type=int, default=100, help="jobs that have not ended")
    parser.add_argument("--database", choices=["sqlite", "postgresql"], default="sqlite")
    parser.add_argument("--storage", choices=["local", "s3"], default="local")
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory() as tmp,
        job_store(args.database, Path(tmp)) as url,
        storage(args.storage, Path(tmp)) as (storage_url, endpoint),
    ):
        settings = Settings.model_validate(
            {
                "home": tmp,
                "database_url": url,
                "storage_url": storage_url,
                "s3_endpoint_url": endpoint,
            }
        )
        engine = get_engine(url)
        store = open_store(storage_url, s3_endpoint_url=endpoint)
        groups = populate(engine, store, expired=args.jobs, fresh=args.fresh, queued=args.queued)
        keep = groups["fresh"] + groups["queued"]
        before = snapshot(engine, groups["queued"])
        started = time.perf_counter()
        report = run_pass(engine, store, settings)
        elapsed = time.perf_counter() - started
        after = snapshot(engine, groups["queued"])
        with Session(engine) as session:
            kept = session.exec(select(Job).where(col(Job.id).in_(keep))).all()
            gone = session.exec(select(Job).where(col(Job.id).in_(groups["expired"]))).all()
        untouched = before == after and all(
            store.exists(job.source_key or "") and store.exists(job.target_key or "")
            for job in kept
            if job.status is JobStatus.queued
        )
        fresh_results = all(
            store.exists(job.result_key or "") and job.result_expired_at is None
            for job in kept
            if job.status is JobStatus.succeeded
        )
        expired_ok = all(
            job.result_expired_at is not None and not store.exists(job.result_key or "")
            for job in gone
        )
        print(
            f"retention pass, {args.database} + {args.storage}: {report.seconds:.2f} s "
            f"({elapsed:.2f} s wall) for {args.jobs} expired jobs: "
            f"{report.result_jobs} results and {report.input_objects} inputs deleted "
            f"({report.inputs_shared} inputs kept: shared with queued jobs); "
            f"{args.fresh} unexpired results intact: {fresh_results}; "
            f"{args.queued} queued jobs untouched (rows and inputs): {untouched}; "
            f"expired jobs marked: {expired_ok}"
        )
        if not (untouched and fresh_results and expired_ok):
            raise SystemExit(1)


if __name__ == "__main__":
    main()
