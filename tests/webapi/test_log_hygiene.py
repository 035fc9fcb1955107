"""Invariant 10: logs correlate (request id, job id) and never carry secrets or image bytes."""

from __future__ import annotations

import base64
import logging

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine

from faceflow.testing.jobs import auth, job_body, make_user, source_jpeg
from webapi.config import Settings
from webapi.logs import JsonFormatter


def test_a_job_lifecycle_logs_no_secret_no_image_and_correlates(
    client: TestClient, engine: Engine, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    user = make_user(engine, settings)
    caplog.set_level(logging.DEBUG)
    body = job_body()
    response = client.post("/v1/jobs", json=body, headers={**auth(user), "X-Request-ID": "req-42"})
    assert response.status_code == 202, response.text
    job_id = response.json()["id"]
    client.get(f"/v1/jobs/{job_id}", headers=auth(user))
    client.post(f"/v1/jobs/{job_id}/cancel", headers=auth(user))
    client.get("/v1/jobs/nope", headers={"Authorization": "Bearer ff_wrong_key_123456"})
    bad = job_body(callback_url="https://user:hunter2@hooks.example.com/x")
    client.post("/v1/jobs", json=bad, headers=auth(user))

    formatter = JsonFormatter()
    lines = [formatter.format(record) for record in caplog.records]
    text = "\n".join(lines) + "\n".join(r.getMessage() for r in caplog.records)
    assert lines, "the API should log its requests"
    forbidden = [
        user.api_key,
        user.webhook_secret,
        user.webhook_secret.removeprefix("whsec_"),
        "ff_wrong_key_123456",
        "hunter2",
        base64.b64encode(source_jpeg()).decode()[:64],
    ]
    for secret in forbidden:
        assert secret not in text, f"log leaked {secret[:12]}…"
    assert "req-42" in text, "request id missing from the logs"
    assert job_id in text, "job id missing from the logs"
