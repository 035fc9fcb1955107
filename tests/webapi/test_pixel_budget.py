"""Decoded-pixel budgets at submit and in the batch planner (issue 22: memory amplification),
on real SQLite and PostgreSQL with real images.

A flat 8000 x 5000 PNG is ≈ 50 KB and decodes to 40 MP (the per-image limit, 120 MB as
RGB): 8 sources, 8 references and a target of it raised a worker by 3.5 GB. The submit
sums every image's header (no decode) against ``max_job_pixels``; the planner closes a
batch before ``max_batch_pixels``.
"""

from __future__ import annotations

import json
from typing import Any

import sqlalchemy as sa
from fastapi.testclient import TestClient
from sqlalchemy.engine import Engine
from sqlmodel import col

from faceflow.testing.jobs import (
    auth,
    data_uri,
    job_body,
    jobs_of,
    make_user,
    new_job,
    source_jpeg,
    target_jpeg,
)
from faceflow.testing.relay import job as stored
from tests.samples import flat_png
from webapi.config import Settings
from webapi.crud import NewUser
from webapi.inputs import store_image
from webapi.models import Job, Outbox
from webapi.relay import batches, runs
from webapi.storage import LocalObjectStore

MP40 = (8000, 5000)  # the default per-image limit exactly


def _body(sources: int, references: int, **overrides: Any) -> dict[str, Any]:
    """A mapped job of 40 MP flat PNGs: ``sources`` sources, ``references`` references and
    a target; each reference names a source."""
    big = data_uri(flat_png(*MP40), "image/png")
    mapping = [{"source": min(i, sources - 1), "reference": i} for i in range(references)]
    body: dict[str, Any] = {
        "sources": [big] * sources,
        "target": big,
        "references": [big] * references,
        "options": {"mapping": mapping},
    }
    body.update(overrides)
    return body


def _error(response: Any) -> dict[str, str]:
    return dict(response.json()["error"])


def test_the_amplification_job_is_refused_at_submit_before_it_queues(
    client: TestClient, engine: Engine, user: NewUser
) -> None:
    response = client.post("/v1/jobs", json=_body(8, 8), headers=auth(user))
    assert response.status_code == 413, response.text
    error = _error(response)
    assert error["code"] == "job_too_large"
    assert "680.0 megapixels" in error["message"] and "120.0" in error["message"]
    assert jobs_of(engine) == []


def test_a_job_at_the_budget_is_accepted_and_one_image_more_is_not(
    client: TestClient, engine: Engine, settings: Settings
) -> None:
    assert settings.image_limits.max_job_pixels == 3 * settings.image_limits.max_pixels
    user = make_user(engine, settings)
    accepted = client.post("/v1/jobs", json=_body(1, 1), headers=auth(user))
    assert accepted.status_code == 202, accepted.text
    [job] = jobs_of(engine)
    assert job.input_pixels == 120_000_000
    refused = client.post("/v1/jobs", json=_body(1, 2), headers=auth(user))
    assert refused.status_code == 413 and _error(refused)["code"] == "job_too_large"
    # Over multipart too: the same check on the same images.
    png = flat_png(*MP40)
    refused = client.post(
        "/v1/jobs",
        headers=auth(user),
        files=[
            ("source", ("s.png", png, "image/png")),
            ("source", ("s2.png", png, "image/png")),
            ("target", ("t.png", png, "image/png")),
            ("reference", ("r.png", png, "image/png")),
        ],
        data={"params": json.dumps({"options": {"mapping": [{"source": 1, "reference": 0}]}})},
    )
    assert refused.status_code == 413 and _error(refused)["code"] == "job_too_large"
    assert len(jobs_of(engine)) == 1


def test_an_input_url_counts_at_the_per_image_limit_until_fetched(
    client: TestClient, engine: Engine, settings: Settings
) -> None:
    user = make_user(engine, settings)
    url = "https://93.184.216.34/photo.jpg"  # SSRF-checked only: nothing is fetched here
    response = client.post("/v1/jobs", json=job_body(target=url), headers=auth(user))
    assert response.status_code == 202, response.text
    [job] = jobs_of(engine)
    assert job.input_pixels == 512 * 600 + settings.image_limits.max_pixels
    # 40 MP source + a URL (counted as 40 MP) + two 40 MP references: 160 MP.
    refused = client.post("/v1/jobs", json=_body(1, 2, target=url), headers=auth(user))
    assert refused.status_code == 413 and _error(refused)["code"] == "job_too_large"


def test_the_planner_closes_a_batch_before_its_pixel_budget(
    engine: Engine, settings: Settings
) -> None:
    """Five jobs of 0.57 MP each (source 512 x 600, target 512 x 512) under a batch budget
    of 1.2 MP: two per run; a job from before ``input_pixels`` (NULL) counts as the
    per-job budget (1 MP) and leaves alone."""
    limits = settings.image_limits.model_copy(
        update={"max_job_pixels": 1_000_000, "max_batch_pixels": 1_200_000}
    )
    settings = settings.model_copy(update={"image_limits": limits})
    store = LocalObjectStore(settings.home / "storage")
    user = make_user(engine, settings, quota=10)
    refs = {
        name: store_image(data, name=name, limits=limits, store=store)
        for name, data in (("source", source_jpeg()), ("target", target_jpeg()))
    }
    jobs = [
        new_job(engine, settings, user, source=refs["source"], target=refs["target"])
        for _ in range(5)
    ]
    assert {job.input_pixels for job in jobs} == {512 * 600 + 512 * 512}
    legacy = jobs[2].id
    with engine.begin() as connection:
        connection.execute(sa.update(Job).where(col(Job.id) == legacy).values(input_pixels=None))
    planned = [
        (Outbox(kind="dispatch", job_id=j.id), runs.plan_of(stored(engine, j.id), 1)) for j in jobs
    ]
    assert planned[2][1].pixels is None
    chunks = batches.group(planned, 8, limits)
    assert [[plan.job_id for plan in chunk.plans] for chunk in chunks] == [
        [jobs[0].id, jobs[1].id],
        [legacy],
        [jobs[3].id, jobs[4].id],
    ]
    # Without a pixel budget in the way, the size bound alone applies.
    roomy = limits.model_copy(update={"max_batch_pixels": 10**9})
    assert [len(chunk.plans) for chunk in batches.group(planned, 3, roomy)] == [3, 2]
