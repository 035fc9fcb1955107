"""Issue 22: the Prefect API asks for a credential, and the relay sends it.

A real ``prefect server start`` with ``PREFECT_SERVER_API_AUTH_STRING``: a client without
the credential can do none of what the issue's attacker did (create a deployment whose
pull step runs a script on a worker, fail or cancel a run, rewrite a run's parameters, read
runs' parameters and block secrets, follow the event stream); the relay, given the
credential by its settings, dispatches a job's run, and a Prefect client holding
``PREFECT_API_AUTH_STRING`` runs it to the end.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr
from sqlalchemy.engine import Engine
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect
from websockets.typing import Subprotocol

from faceflow.testing.jobs import make_user
from faceflow.testing.prefect import PrefectServer
from faceflow.testing.relay import FAST, SCRIPT, execute_run, job, submit
from faceflow.testing.wait import poll
from tests.webapi.conftest import PREFECT_AUTH as AUTH
from tests.webapi.conftest import stand_in_run
from webapi.config import Settings
from webapi.main import create_app
from webapi.models import JobStatus
from webapi.prefect_api import PrefectAPI, PrefectUnavailable, auth_headers
from webapi.readiness import PrefectReadiness
from webapi.relay import dispatch, sync
from webapi.relay.runner import build_relay
from webapi.storage import LocalObjectStore

pytestmark = pytest.mark.prefect

PREFECT_WS = [Subprotocol("prefect")]


@pytest.fixture
def settings(locked_settings: Settings) -> Settings:
    return locked_settings


def test_without_the_credential_nothing_is_read_or_changed(locked: PrefectServer) -> None:
    run = stand_in_run(locked, "victim")  # created with the credential
    run_id = run["id"]
    pull_step = [{"prefect.deployments.steps.run_shell_script": {"script": "id > /tmp/pwned"}}]
    attempts = {
        "create a deployment whose pull step runs a script": (
            "POST",
            "/deployments/",
            {"name": "evil", "flow_id": run["flow_id"], "pull_steps": pull_step},
        ),
        "fail a run with a job's error code": (
            "POST",
            f"/flow_runs/{run_id}/set_state",
            {"state": {"type": "FAILED", "message": "[content_blocked] forged"}, "force": True},
        ),
        "cancel a run": (
            "POST",
            f"/flow_runs/{run_id}/set_state",
            {"state": {"type": "CANCELLED"}, "force": True},
        ),
        "point a run at another user's input": (
            "PATCH",
            f"/flow_runs/{run_id}",
            {"parameters": {"job_id": "j1", "owner_id": "alice", "source_key": "bob/secret"}},
        ),
        "read runs' owners and storage keys": ("POST", "/flow_runs/filter", {}),
        "read one run": ("GET", f"/flow_runs/{run_id}", None),
        "read block documents (secrets)": (
            "POST",
            "/block_documents/filter",
            {"include_secrets": True},
        ),
        "read variables": ("POST", "/variables/filter", {}),
    }
    wrong = {
        "none": {},
        "wrong password": auth_headers(auth_string="faceflow:guess"),
        "bearer": {"Authorization": f"Bearer {AUTH}"},
        "garbage": {"Authorization": "Basic !!!"},
    }
    with httpx.Client(base_url=locked.api_url, timeout=10) as anonymous:
        for what, (method, path, body) in attempts.items():
            for label, headers in wrong.items():
                response = anonymous.request(method, path, json=body, headers=headers)
                assert response.status_code == 401, (what, label, response.text)
                assert AUTH not in response.text
        # Load balancers' and orchestrators' probes stay open; they reveal nothing.
        assert anonymous.get("/health").status_code == 200
        assert anonymous.get("/ready").status_code == 200

    # Nothing changed: the run is still scheduled with its own parameters.
    after = locked.rest.run(str(run_id))
    assert after["state_type"] == "SCHEDULED"
    assert after["parameters"] == run["parameters"]
    with httpx.Client(base_url=locked.api_url, headers=locked.headers, timeout=10) as owner:
        names = [d["name"] for d in owner.post("/deployments/filter", json={}).json()]
    assert "evil" not in names


def test_the_event_stream_asks_for_the_credential(locked: PrefectServer) -> None:
    """Events name every run's deployment, pool and tags (job and owner ids)."""
    url = locked.api_url.replace("http://", "ws://") + "/events/out"
    for token in (None, "faceflow:guess"):
        with connect(url, subprotocols=PREFECT_WS, open_timeout=10) as ws:
            ws.send(json.dumps({"type": "auth", "token": token}))
            with pytest.raises(ConnectionClosed) as closed:
                ws.recv(timeout=10)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008
    with connect(url, subprotocols=PREFECT_WS, open_timeout=10) as ws:
        ws.send(json.dumps({"type": "auth", "token": AUTH}))
        assert json.loads(ws.recv(timeout=10)) == {"type": "auth_success"}


def test_the_relay_with_the_credential_dispatches_and_learns_the_outcome(
    engine: Engine, settings: Settings, locked: PrefectServer, caplog: pytest.LogCaptureFixture
) -> None:
    store = LocalObjectStore(Path(settings.home) / "storage")
    SCRIPT.storage_dir = store.basepath
    owner = make_user(engine, settings, quota=10)

    # Without the credential: a 401, which keeps the job queued (an operator fixes it).
    bare = settings.model_copy(update={"prefect_api_auth_string": None})
    relay = build_relay(bare, engine=engine, store=store, timings=FAST)
    new = submit(engine, settings, store, owner)
    with caplog.at_level(logging.INFO):
        dispatch.run_once(relay)
    stored = job(engine, new.id)
    assert stored.status is JobStatus.queued and stored.flow_run_id is None
    assert "HTTP 401" in caplog.text and "PREFECT_API_AUTH_STRING" in caplog.text
    assert locked.rest.runs_of_job(new.id) == []
    with pytest.raises(PrefectUnavailable, match="401"):
        relay.prefect.deployment_id()
    relay.close()

    # With it (from the settings, as FACEFLOW_/PREFECT_API_AUTH_STRING give it): dispatched,
    # run by a Prefect client holding PREFECT_API_AUTH_STRING, and synced to success.
    relay = build_relay(settings, engine=engine, store=store, timings=FAST)
    try:

        def dispatched() -> bool:
            if job(engine, new.id).flow_run_id is not None:
                return True
            dispatch.run_once(relay)
            return False

        poll(dispatched, 10, step_s=0.1)  # the row waits out its backoff after the 401
        stored = job(engine, new.id)
        assert stored.flow_run_id is not None
        assert [r["id"] for r in locked.rest.runs_of_job(new.id)] == [str(stored.flow_run_id)]
        assert execute_run(str(stored.flow_run_id)) == "COMPLETED"
        sync.run_once(relay)
        assert job(engine, new.id).status is JobStatus.succeeded
    finally:
        relay.close()
    assert AUTH.split(":", 1)[1] not in caplog.text


def test_the_settings_take_the_credential_from_the_environment_and_never_show_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("FACEFLOW_HOME", str(tmp_path))
    monkeypatch.setenv("PREFECT_API_AUTH_STRING", AUTH)
    settings = Settings.model_validate({})
    secret = settings.prefect_api_auth_string
    assert secret is not None and secret.get_secret_value() == AUTH
    for shown in (repr(settings), str(settings.model_dump()), settings.model_dump_json()):
        assert AUTH.split(":", 1)[1] not in shown
    monkeypatch.setenv("FACEFLOW_PREFECT_API_AUTH_STRING", "faceflow:its-own")
    secret = Settings.model_validate({}).prefect_api_auth_string
    assert secret is not None and secret.get_secret_value() == "faceflow:its-own"


def _readyz(settings: Settings) -> httpx.Response:
    with TestClient(create_app(settings)) as client:
        return client.get("/readyz")


def test_readiness_tells_a_refused_credential_from_an_unreachable_api(
    settings: Settings, locked: PrefectServer
) -> None:
    """``/readyz`` asks a route that wants the credential: ready with the server's, not
    ready with a wrong one (``credential refused``), which reads apart from a Prefect API
    that does not answer; the credential never shows."""
    ready = _readyz(settings)
    assert ready.status_code == 200, ready.text
    assert ready.json()["checks"] == {"database": "ok", "prefect": "ok"}

    refused = _readyz(
        settings.model_copy(update={"prefect_api_auth_string": SecretStr("faceflow:guess")})
    )
    assert refused.status_code == 503
    body = refused.json()
    assert body["error"]["code"] == "not_ready"
    assert body["checks"]["database"] == "ok"
    assert body["checks"]["prefect"].startswith("credential refused: GET admin/version: HTTP 401")
    assert "credential refused" in body["error"]["message"]
    assert "guess" not in refused.text and AUTH.split(":", 1)[1] not in refused.text

    down = _readyz(settings.model_copy(update={"prefect_api_url": "http://127.0.0.1:9/api"}))
    assert down.status_code == 503
    assert down.json()["checks"]["prefect"].startswith("unreachable: GET admin/version")


def test_an_api_that_runs_the_relay_without_the_credential_is_not_ready(
    settings: Settings, locked: PrefectServer
) -> None:
    """The relay in the API process would get 401 on every call: the API is not ready.
    Without the relay (and no credential) the API never calls Prefect: the open health
    route is enough."""
    bare = settings.model_copy(update={"prefect_api_auth_string": None})
    with_relay = PrefectReadiness.from_settings(bare.model_copy(update={"run_relay": True}))
    without = PrefectReadiness.from_settings(bare)
    try:
        assert asyncio.run(with_relay.check()).startswith("credential refused: ")
        assert asyncio.run(without.check()) == "ok"
    finally:
        with_relay.close()
        without.close()


def test_the_readiness_answer_is_kept_briefly(settings: Settings, locked: PrefectServer) -> None:
    """Probes within the cache's time get the last answer without asking Prefect; the
    credential changing (a rotation gone wrong) shows once it has expired, and a failure
    is kept for less time than a success."""
    readiness = PrefectReadiness.from_settings(settings)
    readiness.ok_ttl_s, readiness.failed_ttl_s = 1.0, 0.3
    good = readiness.client
    try:
        assert asyncio.run(readiness.check()) == "ok"
        readiness.client = PrefectAPI(locked.api_url, auth_string="faceflow:rotated-away")
        assert asyncio.run(readiness.check()) == "ok"  # from the cache
        time.sleep(1.1)
        assert asyncio.run(readiness.check()).startswith("credential refused: ")
        readiness.client.close()
        readiness.client = good
        time.sleep(0.4)
        assert asyncio.run(readiness.check()) == "ok"
    finally:
        readiness.close()
