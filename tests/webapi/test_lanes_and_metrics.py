"""The priority lane at admission (per-lane 429/503, who may use it) and the autoscaling
signal and restart counters on ``/metrics``, on SQLite and PostgreSQL."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.engine import Engine

from faceflow.testing.jobs import auth, job_body, make_user, move, new_job
from tests.webapi.conftest import make_settings
from webapi import services
from webapi.config import Settings
from webapi.main import create_app
from webapi.metrics import workers_wanted
from webapi.models import JobStatus


@pytest.fixture
def settings(database_url: str, tmp_path: Path) -> Settings:
    # Fixed service time of 10 s, one slot, 60 s queue timeout: 7 queued jobs fill a lane.
    return make_settings(database_url, tmp_path, default_service_seconds=10.0)


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in metrics")


def test_a_full_normal_lane_refuses_normal_jobs_but_admits_priority_ones(
    client: TestClient, engine: Engine, settings: Settings
) -> None:
    bulk = make_user(engine, settings, quota=100)
    vip = make_user(engine, settings, priority="high")
    for _ in range(7):
        new_job(engine, settings, bulk)
    refused = client.post("/v1/jobs", json=job_body(), headers=auth(bulk))
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "overloaded"
    assert int(refused.headers["Retry-After"]) >= 1
    # The VIP's jobs go to the priority lane by default and wait behind no normal job.
    accepted = client.post("/v1/jobs", json=job_body(), headers=auth(vip))
    assert accepted.status_code == 202, accepted.text
    assert accepted.json()["priority"] == "high"
    # A VIP may still send bulk work to the normal lane: then it is refused like any.
    bulk_from_vip = client.post("/v1/jobs", json=job_body(priority="normal"), headers=auth(vip))
    assert bulk_from_vip.status_code == 503


def test_the_priority_lane_has_its_own_limit(
    client: TestClient, engine: Engine, settings: Settings
) -> None:
    vip = make_user(engine, settings, priority="high", quota=100)
    for _ in range(7):
        new_job(engine, settings, vip, priority="high")
    response = client.post("/v1/jobs", json=job_body(), headers=auth(vip))
    assert response.status_code == 503


def test_a_normal_key_cannot_use_the_priority_lane(
    client: TestClient, engine: Engine, settings: Settings
) -> None:
    user = make_user(engine, settings)
    response = client.post("/v1/jobs", json=job_body(priority="high"), headers=auth(user))
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "priority_not_allowed"
    ok = client.post("/v1/jobs", json=job_body(), headers=auth(user))
    assert ok.status_code == 202 and ok.json()["priority"] == "normal"


def test_metrics_carry_the_autoscaling_signal_per_lane(
    client: TestClient, engine: Engine, settings: Settings
) -> None:
    bulk = make_user(engine, settings, quota=100)
    vip = make_user(engine, settings, priority="high")
    normal_jobs = [new_job(engine, settings, bulk) for _ in range(4)]
    new_job(engine, settings, vip, priority="high")
    move(engine, normal_jobs[0].id, JobStatus.running, JobStatus.queued)
    text = client.get("/metrics").text
    assert 'faceflow_lane_queued_jobs{lane="normal"} 3.0' in text
    assert 'faceflow_lane_queued_jobs{lane="high"} 1.0' in text
    assert "faceflow_jobs_running 1.0" in text
    # Estimated waits (10 s per job, one slot): high waits behind 1 queued + half a running.
    assert 'faceflow_lane_estimated_wait_seconds{lane="high"} 15.0' in text
    assert 'faceflow_lane_estimated_wait_seconds{lane="normal"} 45.0' in text
    age = _metric(text, 'faceflow_lane_oldest_queued_age_seconds{lane="normal"}')
    assert 0 <= age < 60
    # 1 running + 4 queued x 10 s over a 30 s target wait → ⌈1 + 1.33⌉ = 3 workers.
    assert "faceflow_gpu_workers_wanted 3.0" in text
    assert "faceflow_service_time_seconds 10.0" in text


def test_workers_wanted() -> None:
    assert workers_wanted(running=0, queued=0, service_s=10, target_wait_s=30) == 0
    assert workers_wanted(running=2, queued=0, service_s=10, target_wait_s=30) == 2
    assert workers_wanted(running=0, queued=3, service_s=10, target_wait_s=30) == 1
    assert workers_wanted(running=1, queued=30, service_s=2, target_wait_s=30) == 3


def test_metrics_export_service_restart_counters(
    engine: Engine, database_url: str, tmp_path: Path
) -> None:
    settings = make_settings(database_url, tmp_path, services_dir=tmp_path / "services")
    assert settings.services_dir is not None
    for _ in range(3):
        services.record_start(settings.services_dir, "webapi")
    services.record_start(settings.services_dir, "faceflow-gpu-worker@0")
    services.record_exit(settings.services_dir, "webapi", "exited with code 1")
    with TestClient(create_app(settings)) as client:
        text = client.get("/metrics").text
    assert 'faceflow_service_restarts_total{service="webapi"} 2.0' in text
    assert 'faceflow_service_starts_total{service="webapi"} 3.0' in text
    assert 'faceflow_service_restarts_total{service="faceflow-gpu-worker@0"} 0.0' in text
    [worker, api] = services.read_records(settings.services_dir)
    assert api.last_exit == "exited with code 1" and worker.last_exit is None
