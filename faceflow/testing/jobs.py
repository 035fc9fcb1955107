"""Factories for the webapi's tests and benches: users, images, request bodies, jobs in a
given state."""

from __future__ import annotations

import base64
import io
import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from PIL import Image
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from faceflow.samples import astronaut_jpeg_bytes, grace_hopper_jpeg_bytes
from faceflow.supervisor import Service
from webapi import capacity, crud
from webapi.config import Settings
from webapi.inputs import InputRef
from webapi.jobstate import transition
from webapi.models import Job, JobStatus, Outbox, Priority


def make_user(
    engine: Engine,
    settings: Settings,
    *,
    name: str | None = None,
    quota: int = 10,
    priority: Priority = "normal",
    input_retention_s: int | None = None,
    result_retention_s: int | None = None,
) -> crud.NewUser:
    """A new user with its API key and webhook secret."""
    with Session(engine, expire_on_commit=False) as session:
        return crud.create_user(
            session,
            name=name or f"user-{uuid.uuid4().hex[:8]}",
            quota=quota,
            pepper=settings.api_key_pepper.get_secret_value(),
            priority=priority,
            input_retention_s=input_retention_s,
            result_retention_s=result_retention_s,
        )


def auth(user: crud.NewUser) -> dict[str, str]:
    """The Authorization header of a user."""
    return {"Authorization": f"Bearer {user.api_key}"}


def data_uri(data: bytes, media_type: str = "image/jpeg") -> str:
    """A base64 data: URI."""
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


@cache
def source_jpeg() -> bytes:
    """A real face photo (grace_hopper.jpg re-encoded)."""
    return grace_hopper_jpeg_bytes()


@cache
def target_jpeg() -> bytes:
    """Another real face photo (astronaut)."""
    return astronaut_jpeg_bytes()


def image_bytes(
    width: int, height: int, fmt: str = "PNG", color: tuple[int, int, int] = (200, 120, 40)
) -> bytes:
    """A plain image of the given size and format."""
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buffer, format=fmt)
    return buffer.getvalue()


def job_body(**overrides: Any) -> dict[str, Any]:
    """A valid JSON submit body (two real JPEG photos as data: URIs)."""
    body: dict[str, Any] = {
        "source": data_uri(source_jpeg()),
        "target": data_uri(target_jpeg()),
        "options": {"identity_weight": 0.8},
    }
    body.update(overrides)
    return body


def jobs_of(engine: Engine, owner_id: uuid.UUID | None = None) -> list[Job]:
    """Every job (of one owner), oldest first."""
    with Session(engine, expire_on_commit=False) as session:
        query = select(Job).order_by(col(Job.created_at))
        if owner_id is not None:
            query = query.where(col(Job.owner_id) == owner_id)
        return list(session.exec(query))


def outbox_of(engine: Engine, job_id: uuid.UUID) -> list[Outbox]:
    """Outbox rows of a job, oldest first."""
    with Session(engine, expire_on_commit=False) as session:
        query = select(Outbox).where(col(Outbox.job_id) == job_id).order_by(col(Outbox.created_at))
        return list(session.exec(query))


def move(
    engine: Engine, job_id: uuid.UUID | str, to: JobStatus, expected: JobStatus, **fields: Any
) -> None:
    """Drive a job through the state machine as the relay would (must succeed)."""
    with Session(engine) as session:
        assert transition(
            session, job_id=uuid.UUID(str(job_id)), to=to, expected=expected, **fields
        )


def succeed(
    engine: Engine,
    job_id: uuid.UUID | str,
    *,
    result_key: str,
    content_type: str = "image/png",
    size: tuple[int, int] = (64, 48),
    timings: Mapping[str, float] | None = None,
) -> None:
    """queued → running → succeeded with a result, like a finished flow run."""
    flow_run_id = uuid.uuid4()
    move(engine, job_id, JobStatus.queued, JobStatus.queued, flow_run_id=flow_run_id, attempts=1)
    move(engine, job_id, JobStatus.running, JobStatus.queued, stage="fuse")
    move(
        engine,
        job_id,
        JobStatus.succeeded,
        JobStatus.running,
        result_key=result_key,
        result_content_type=content_type,
        result_width=size[0],
        result_height=size[1],
        timings=dict(timings or {"fuse": 12.5}),
    )


def submit(client: Any, user: crud.NewUser, **overrides: Any) -> str:
    """Submit a valid job through the API (must be accepted); its id."""
    response = client.post("/v1/jobs", json=job_body(**overrides), headers=auth(user))
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def dispatch(engine: Engine, job_id: uuid.UUID | str) -> uuid.UUID:
    """Record a flow run on a queued job, as the relay's dispatch does; the run id."""
    flow_run_id = uuid.uuid4()
    move(engine, job_id, JobStatus.queued, JobStatus.queued, flow_run_id=flow_run_id, attempts=1)
    return flow_run_id


def new_job(
    engine: Engine,
    settings: Settings,
    user: crud.NewUser,
    *,
    source: InputRef | None = None,
    target: InputRef | None = None,
    extra_sources: Sequence[InputRef] = (),
    references: Sequence[InputRef] = (),
    **create: Any,
) -> Job:
    """A queued job created through ``crud.submit_job``, from ``create`` (the request's
    fields); inputs as given (stored ones for tests that read them), else fake keys."""
    from webapi.models import JobCreate

    digest = uuid.uuid4().hex * 2
    if source is None:
        source = InputRef(name="source", digest=digest, key=f"inputs/{digest[:2]}/{digest}.jpeg")
    if target is None:
        target = InputRef(name="target", digest=digest[::-1], key=f"inputs/x/{digest[::-1]}.png")
    with Session(engine, expire_on_commit=False) as session:
        job, created = crud.submit_job(
            session,
            owner=user.user,
            create=JobCreate.model_validate(create),
            source=source,
            target=target,
            settings=settings,
            extra_sources=extra_sources,
            references=references,
        )
    assert created
    return job


def finished_job(
    engine: Engine,
    settings: Settings,
    user: crud.NewUser,
    *,
    created: datetime,
    started: datetime,
    finished: datetime,
    flow_run_id: uuid.UUID | None = None,
    timings: Mapping[str, float] | None = None,
) -> uuid.UUID:
    """A succeeded job with the given submit, start and finish times (service-time tests),
    the flow run that carried it (a batch run carries several jobs) and its stage
    timings (ms)."""
    job_id = new_job(engine, settings, user).id
    succeed(engine, job_id, result_key=f"results/{job_id}/attempt-1.png", timings=timings)
    values: dict[str, Any] = {"created_at": created, "started_at": started, "finished_at": finished}
    if flow_run_id is not None:
        values["flow_run_id"] = flow_run_id
    with Session(engine) as session:
        session.execute(sa.update(Job).where(col(Job.id) == job_id).values(**values))
        session.commit()
    capacity.reset_service_time_cache()
    return job_id


def clear_jobs(engine: Engine) -> None:
    """Delete every job and outbox row (users stay), and forget cached service times."""
    with Session(engine) as session:
        session.execute(sa.delete(Outbox))
        session.execute(sa.delete(Job))
        session.commit()
    capacity.reset_service_time_cache()


def stack_webapi(home: Path, database_url: str, **env: str) -> tuple[Service, str]:
    """The webapi as ``faceflow up`` starts it (``faceflow.stack.webapi_argv``) on a free
    loopback port, against ``database_url`` and an unreachable Prefect, ``env`` on top
    (not started): the service and its base URL."""
    from faceflow.stack import REPO_ROOT, StackConfig, webapi_argv
    from faceflow.testing.net import free_port

    config = StackConfig(home=home, api_port=free_port(), external_prefect=None)
    service = Service(
        name="webapi",
        argv=webapi_argv(config),
        log=home / "webapi.log",
        env={
            **config.env(),
            "FACEFLOW_DATABASE_URL": database_url,
            "FACEFLOW_PREFECT_API_URL": "http://127.0.0.1:9/api",  # nothing listens
            **env,
        },
        cwd=REPO_ROOT,
    )
    return service, config.api_url
