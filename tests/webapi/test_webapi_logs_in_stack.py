"""Regression (found by the fault suite): ``faceflow up`` starts the webapi with
``uvicorn --factory webapi.main:create_app``, which never configured logging, so the
stack's webapi log had no JSON lines and dropped INFO records (the relay's "relay started",
"dispatched", "job ended"). The factory now logs JSON lines at INFO, like ``webapi.main:app``.
The webapi is started here exactly as the stack starts it (``faceflow.stack.webapi_argv``)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx

from faceflow.testing.jobs import stack_webapi
from webapi.migrations import upgrade


def test_the_stacks_webapi_logs_json_lines_at_info(tmp_path: Path) -> None:
    database_url = f"sqlite:///{tmp_path / 'webapi.db'}"
    upgrade(database_url)
    service, api_url = stack_webapi(tmp_path, database_url)
    service.start()
    try:
        service.wait_ready(
            lambda: httpx.get(f"{api_url}/healthz", timeout=2).status_code == 200, 60
        )
        response = httpx.get(f"{api_url}/healthz", headers={"X-Request-ID": "req-logs-1"})
        assert response.headers["x-request-id"] == "req-logs-1"
        time.sleep(0.5)
    finally:
        service.stop(grace=10)
    lines = [line for line in service.log.read_text().splitlines() if line.startswith("{")]
    entries = [json.loads(line) for line in lines]
    started = [e for e in entries if e["msg"] == "relay started"]
    assert started and started[0]["level"] == "info" and started[0]["logger"].startswith("webapi")
