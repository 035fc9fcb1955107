"""The /v1/jobs API against real SQLite and PostgreSQL: every status code of issue 4."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from httpx import Response
from sqlalchemy.engine import Engine

from faceflow.testing.jobs import (
    auth,
    clear_jobs,
    data_uri,
    dispatch,
    finished_job,
    image_bytes,
    job_body,
    jobs_of,
    make_user,
    move,
    outbox_of,
    source_jpeg,
    submit,
    succeed,
    target_jpeg,
)
from faceflow.testing.wait import poll_value
from flows.params import input_key
from tests.webapi.conftest import app_client
from webapi.config import Settings
from webapi.crud import NewUser
from webapi.models import JobStatus, utcnow
from webapi.relay.runner import RelayRunner, build_relay
from webapi.storage import LocalObjectStore


def _error(response) -> str:  # type: ignore[no-untyped-def]
    body = response.json()
    assert set(body) >= {"error"} and set(body["error"]) == {"code", "message"}, body
    return str(body["error"]["code"])


# --------------------------------------------------------------------------- submit


def test_submit_json_returns_202_location_and_commits_job_with_dispatch(
    client: TestClient, engine: Engine, settings: Settings, user: NewUser
) -> None:
    response = client.post("/v1/jobs", json=job_body(deadline_seconds=90), headers=auth(user))
    assert response.status_code == 202, response.text
    job = response.json()
    assert response.headers["location"] == job["urls"]["self"]
    assert job["urls"]["self"].endswith(f"/v1/jobs/{job['id']}")
    assert job["status"] == "queued" and job["attempts"] == 0 and job["result"] is None
    assert job["options"]["identity_weight"] == 0.8

    [stored] = jobs_of(engine, user.user.id)
    assert str(stored.id) == job["id"]
    assert stored.deadline_at - stored.created_at == timedelta(seconds=90)
    assert stored.queue_deadline_at - stored.created_at == timedelta(
        seconds=settings.default_queue_timeout_seconds
    )
    [dispatch] = outbox_of(engine, stored.id)
    assert dispatch.kind == "dispatch" and dispatch.payload == {"attempt": 1}
    assert dispatch.done_at is None

    store = LocalObjectStore(Path(settings.storage_url.removeprefix("file://")))
    import hashlib

    source_digest = hashlib.sha256(source_jpeg()).hexdigest()
    assert stored.source_key == input_key(source_digest, "jpeg")
    assert store.get(stored.source_key) == source_jpeg()
    assert stored.target_key is not None and store.exists(stored.target_key)


def test_submit_multipart(client: TestClient, engine: Engine, settings: Settings) -> None:
    user = make_user(engine, settings, priority="high")  # may ask for the priority lane
    response = client.post(
        "/v1/jobs",
        headers=auth(user),
        files={
            "source": ("face.jpg", source_jpeg(), "image/jpeg"),
            "target": ("photo.jpg", target_jpeg(), "image/jpeg"),
        },
        data={"params": json.dumps({"options": {"output_format": "jpeg"}, "priority": "high"})},
    )
    assert response.status_code == 202, response.text
    assert response.json()["options"]["output_format"] == "jpeg"
    assert response.json()["priority"] == "high"
    [stored] = jobs_of(engine, user.user.id)
    assert stored.source_key and stored.target_key and stored.source_key != stored.target_key


def test_submit_https_url_input_is_stored_for_the_relay(
    client: TestClient, engine: Engine, user: NewUser, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = job_body(target="https://93.184.216.34/photo.jpg")
    response = client.post("/v1/jobs", json=body, headers=auth(user))
    assert response.status_code == 202, response.text
    [stored] = jobs_of(engine, user.user.id)
    assert stored.target_key is None and stored.target_url == "https://93.184.216.34/photo.jpg"


def test_a_submit_wakes_the_relay_loop_its_job_waits_for(
    app: FastAPI, client: TestClient, engine: Engine, settings: Settings, user: NewUser
) -> None:
    """A job with its inputs stored wakes dispatch alone, not the fetch lane, whose pass
    would claim a lease of the job store for nothing, nor notify (no webhook is sent for a
    queued job); one with an input URL wakes the fetch lane alone (dispatch leaves it until
    its inputs are stored)."""
    runner = RelayRunner(build_relay(settings, engine=engine, store=app.state.store))
    app.state.relay = runner  # not started: a wake stays set until the test takes it

    def woken() -> set[str]:
        return {name for name in ("fetch", "dispatch", "notify") if runner.nap(name, 0)}

    try:
        assert client.post("/v1/jobs", json=job_body(), headers=auth(user)).status_code == 202
        assert woken() == {"dispatch"}
        body = job_body(target="https://93.184.216.34/photo.jpg")
        assert client.post("/v1/jobs", json=body, headers=auth(user)).status_code == 202
        assert woken() == {"fetch"}
    finally:
        runner.relay.close()


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer ff_wrong"},
        {"Authorization": "Basic abc"},
        {"Authorization": "Bearer"},
    ],
    ids=["missing", "wrong", "basic", "empty"],
)
def test_unauthenticated_is_401(
    client: TestClient, engine: Engine, headers: dict[str, str]
) -> None:
    for method, path in (
        ("POST", "/v1/jobs"),
        ("GET", "/v1/jobs"),
        ("GET", f"/v1/jobs/{uuid.uuid4()}"),
    ):
        response = client.request(method, path, headers=headers, json=job_body())
        assert response.status_code == 401, (method, path, response.text)
        assert _error(response) == "unauthorized"


def test_unsupported_content_type_is_415(client: TestClient, engine: Engine, user: NewUser) -> None:
    response = client.post(
        "/v1/jobs", content=b"source=x", headers={**auth(user), "Content-Type": "text/plain"}
    )
    assert response.status_code == 415 and _error(response) == "unsupported_media_type"


@pytest.mark.parametrize(
    ("source", "code"),
    [
        (data_uri(image_bytes(64, 64, "GIF"), "image/gif"), "unsupported_media_type"),
        (data_uri(image_bytes(64, 64, "GIF"), "image/png"), "unsupported_format"),
        (data_uri(image_bytes(64, 64, "BMP"), ""), "unsupported_format"),
    ],
    ids=["declared-gif", "gif-bytes-declared-png", "bmp-bytes"],
)
def test_unsupported_image_format_is_415(
    client: TestClient, engine: Engine, user: NewUser, source: str, code: str
) -> None:
    response = client.post("/v1/jobs", json=job_body(source=source), headers=auth(user))
    assert response.status_code == 415, response.text
    assert _error(response) == code


def test_too_large_is_413(database_url: str, tmp_path: Path, engine: Engine) -> None:
    limits = {"max_bytes": 20_000, "max_pixels": 100_000, "min_side": 16}
    with app_client(database_url, tmp_path, image_limits=limits) as client:
        settings = client.app.state.settings  # type: ignore[attr-defined]
        user = make_user(engine, settings)
        # bytes: a real photo of ~60 KB against a 20 KB limit
        response = client.post("/v1/jobs", json=job_body(), headers=auth(user))
        assert response.status_code == 413 and _error(response) == "payload_too_large"
        # the whole JSON body, declared by Content-Length
        big = b"{" + b" " * (settings.max_json_bytes + 1) + b"}"
        response = client.post(
            "/v1/jobs", content=big, headers={**auth(user), "Content-Type": "application/json"}
        )
        assert response.status_code == 413
        # pixels: a small file with too many pixels (decompression-bomb shape)
        bomb = data_uri(image_bytes(400, 400, "PNG", (0, 0, 0)), "image/png")
        response = client.post(
            "/v1/jobs", json=job_body(source=bomb, target=bomb), headers=auth(user)
        )
        assert response.status_code == 413 and _error(response) == "image_too_large"
        # multipart file over the byte limit
        response = client.post(
            "/v1/jobs",
            headers=auth(user),
            files={"source": ("a.jpg", source_jpeg()), "target": ("b.jpg", source_jpeg())},
        )
        assert response.status_code == 413
    assert jobs_of(engine) == []


@pytest.mark.parametrize(
    ("overrides", "code"),
    [
        ({"options": {"identity_weight": 2}}, "invalid_request"),
        ({"options": {"detector": "yolo"}}, "invalid_request"),
        ({"target": None}, "invalid_request"),
        ({"unknown_field": 1}, "invalid_request"),
        ({"priority": "urgent"}, "invalid_request"),
        ({"deadline_seconds": 0}, "invalid_request"),
        ({"deadline_seconds": 10**6}, "invalid_request"),
        ({"callback_events": ["job.exploded"]}, "invalid_request"),
        ({"callback_url": "ftp://example.com/hook"}, "blocked_url"),
        ({"source": "data:image/png;base64,@@@"}, "invalid_request"),
        ({"source": "data:image/png,rawbytes"}, "invalid_request"),
        ({"source": "file:///etc/passwd"}, "invalid_request"),
        ({"source": data_uri(b"\xff\xd8\xff" + b"\x00" * 200)}, "invalid_input"),
        ({"source": data_uri(image_bytes(8, 8))}, "image_too_small"),
        ({"source": data_uri(b"")}, "invalid_request"),
    ],
)
def test_invalid_fields_are_422(
    client: TestClient, engine: Engine, user: NewUser, overrides: dict[str, object], code: str
) -> None:
    response = client.post("/v1/jobs", json=job_body(**overrides), headers=auth(user))
    assert response.status_code == 422, response.text
    assert _error(response) == code
    assert jobs_of(engine) == []


def test_malformed_json_is_422(client: TestClient, engine: Engine, user: NewUser) -> None:
    for content in (b"{", b"[]", b'"x"', b"\xff\xfe"):
        response = client.post(
            "/v1/jobs", content=content, headers={**auth(user), "Content-Type": "application/json"}
        )
        assert response.status_code == 422, (content, response.text)


def _refuse_connections(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """From now on, a Python socket connection fails the test; returns the attempts."""
    attempts: list[object] = []

    def refuse(*args: object, **kwargs: object) -> None:
        attempts.append(args)
        raise AssertionError("a connection was attempted")

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    return attempts


def test_blocked_callback_and_input_urls_are_422_without_connecting(
    database_url: str, tmp_path: Path, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    with app_client(database_url, tmp_path, allow_private_urls=False) as client:
        user = make_user(engine, client.app.state.settings)  # type: ignore[attr-defined]
        attempts = _refuse_connections(monkeypatch)
        for url in (
            "http://127.0.0.1:8080/hook",
            "http://10.0.0.1/hook",
            "http://169.254.169.254/latest",
            "http://[::1]/x",
            "http://localhost/hook",
        ):
            response = client.post("/v1/jobs", json=job_body(callback_url=url), headers=auth(user))
            assert response.status_code == 422 and _error(response) == "blocked_url", url
            https = url.replace("http:", "https:")
            response = client.post("/v1/jobs", json=job_body(source=https), headers=auth(user))
            assert response.status_code == 422 and _error(response) == "blocked_url", url
            response = client.post("/v1/jobs", json=job_body(source=url), headers=auth(user))
            assert response.status_code == 422, url  # plain http inputs: https only
    assert attempts == []
    assert jobs_of(engine) == []


def test_callbacks_and_input_urls_are_https_on_the_allowed_ports(
    database_url: str, tmp_path: Path, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without FACEFLOW_ALLOW_PRIVATE_URLS (as production): https only, ports 443 and
    8443 (FACEFLOW_URL_PORTS), public addresses in every form; nothing is connected to."""
    with app_client(database_url, tmp_path, allow_private_urls=False) as client:
        user = make_user(engine, client.app.state.settings)  # type: ignore[attr-defined]
        attempts = _refuse_connections(monkeypatch)
        for url, reason in (
            ("http://93.184.216.34/hook", "scheme"),
            ("https://93.184.216.34:22/hook", "port"),
            ("https://93.184.216.34:6379/hook", "port"),
            ("https://93.184.216.34:80/hook", "port"),
            ("https://[::127.0.0.1]/hook", "non-public"),
            ("https://[64:ff9b::a00:1]/hook", "non-public"),
            ("https://[::ffff:169.254.169.254]/hook", "metadata"),
        ):
            for body in (job_body(callback_url=url), job_body(source=url)):
                response = client.post("/v1/jobs", json=body, headers=auth(user))
                assert response.status_code == 422, url
                if reason != "scheme" or "callback_url" in body:  # http inputs: "https URL"
                    assert _error(response) == "blocked_url", url
                    assert reason in response.json()["error"]["message"], response.text
        # a numeric host: the callback's URL parser (WHATWG) writes it as dotted decimal,
        # an input URL is kept as given and so refused
        response = client.post(
            "/v1/jobs", json=job_body(source="https://0x5db8d822/a.jpg"), headers=auth(user)
        )
        assert response.status_code == 422 and "dotted decimal" in response.text
        body = job_body(
            callback_url="https://0x5db8d822:8443/hook", source="https://93.184.216.34/a.jpg"
        )
        assert client.post("/v1/jobs", json=body, headers=auth(user)).status_code == 202
    assert attempts == []
    [job] = jobs_of(engine)
    assert job.callback_url == "https://93.184.216.34:8443/hook"


def test_metadata_callbacks_are_refused_even_with_private_urls_allowed(
    client: TestClient, engine: Engine, user: NewUser
) -> None:
    for url in (
        "http://[::ffff:169.254.169.254]/latest",
        "http://[::a9fe:a9fe]/",
        "http://0xa9fea9fe/",
    ):
        response = client.post("/v1/jobs", json=job_body(callback_url=url), headers=auth(user))
        assert response.status_code == 422 and "metadata" in response.text, url
    assert (
        client.post(
            "/v1/jobs", json=job_body(callback_url="http://127.0.0.1:9/hook"), headers=auth(user)
        ).status_code
        == 202
    )


def test_quota_is_429_with_retry_after(
    client: TestClient, engine: Engine, settings: Settings
) -> None:
    user = make_user(engine, settings, quota=2)
    for _ in range(2):
        assert client.post("/v1/jobs", json=job_body(), headers=auth(user)).status_code == 202
    response = client.post("/v1/jobs", json=job_body(), headers=auth(user))
    assert response.status_code == 429 and _error(response) == "quota_exceeded"
    assert int(response.headers["retry-after"]) >= 1
    # another user is not affected; a finished job frees the slot
    assert (
        client.post(
            "/v1/jobs", json=job_body(), headers=auth(make_user(engine, settings))
        ).status_code
        == 202
    )
    first = jobs_of(engine, user.user.id)[0]
    move(engine, first.id, JobStatus.cancelled, JobStatus.queued)
    assert client.post("/v1/jobs", json=job_body(), headers=auth(user)).status_code == 202


def test_backlog_is_503_with_retry_after_from_service_time(
    database_url: str, tmp_path: Path, engine: Engine
) -> None:
    with app_client(
        database_url, tmp_path, default_service_seconds=30, worker_slots=1, admission_safety=1
    ) as client:
        user = make_user(engine, client.app.state.settings, quota=100)  # type: ignore[attr-defined]
        body = job_body(queue_timeout_seconds=45)
        assert client.post("/v1/jobs", json=body, headers=auth(user)).status_code == 202
        assert (
            client.post("/v1/jobs", json=body, headers=auth(user)).status_code == 202
        )  # waits ~30 s
        response = client.post("/v1/jobs", json=body, headers=auth(user))  # would wait ~60 s > 45
        assert response.status_code == 503 and _error(response) == "overloaded"
        assert int(response.headers["retry-after"]) == 60 - 45 + 30
        # a longer queue timeout fits
        assert (
            client.post(
                "/v1/jobs", json=job_body(queue_timeout_seconds=120), headers=auth(user)
            ).status_code
            == 202
        )


def test_admission_keeps_headroom_on_the_estimated_wait(
    database_url: str, tmp_path: Path, engine: Engine
) -> None:
    # 20 s per job (measured: a job that took 20 s from submit to finish), one slot, 45 s
    # to start: alone the estimate admits two queued jobs (wait 40 s); with a safety factor
    # of 1.5 (wait 60 s > 45 s) the second is refused. A configured default (no history)
    # is used without the factor.
    settings = {"default_service_seconds": 1000, "worker_slots": 1}
    body = job_body(queue_timeout_seconds=45)
    for safety, accepted in ((1.0, 3), (1.5, 2)):
        with app_client(database_url, tmp_path, admission_safety=safety, **settings) as client:
            app_settings = client.app.state.settings  # type: ignore[attr-defined]
            user = make_user(engine, app_settings, quota=100)
            clear_jobs(engine)
            end = utcnow()
            start, created = end - timedelta(seconds=1), end - timedelta(seconds=20)
            finished_job(engine, app_settings, user, created=created, started=start, finished=end)
            codes = [
                client.post("/v1/jobs", json=body, headers=auth(user)).status_code for _ in range(4)
            ]
        assert codes == [202] * accepted + [503] * (4 - accepted), (safety, codes)
    with app_client(database_url, tmp_path, default_service_seconds=20, worker_slots=1) as client:
        clear_jobs(engine)
        user = make_user(engine, client.app.state.settings, quota=100)  # type: ignore[attr-defined]
        codes = [
            client.post("/v1/jobs", json=body, headers=auth(user)).status_code for _ in range(4)
        ]
        assert codes == [202, 202, 202, 503]  # the default 2.0 does not apply to a guess


def test_service_time_is_the_median_of_recent_runs(
    database_url: str, tmp_path: Path, engine: Engine
) -> None:
    from webapi import capacity

    with app_client(database_url, tmp_path, default_service_seconds=1000) as client:
        user = make_user(engine, client.app.state.settings, quota=100)  # type: ignore[attr-defined]
        ids = [submit(client, user) for _ in range(1)]
        # with a 1000 s default, a second job would be refused...
        assert client.post("/v1/jobs", json=job_body(), headers=auth(user)).status_code == 503
        # ...until a job has run: then the measured run time (~0 s, floored at 50 ms) is used
        succeed(engine, ids[0], result_key="results/x/attempt-1.png")
        capacity.reset_service_time_cache()
        assert client.post("/v1/jobs", json=job_body(), headers=auth(user)).status_code == 202


# --------------------------------------------------------------------------- idempotency


def test_idempotency_key_replays_or_conflicts(
    client: TestClient, engine: Engine, settings: Settings, user: NewUser
) -> None:
    headers = {**auth(user), "Idempotency-Key": "order-42"}
    first = client.post("/v1/jobs", json=job_body(), headers=headers)
    assert first.status_code == 202
    again = client.post("/v1/jobs", json=job_body(), headers=headers)
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"]
    assert again.headers["location"] == first.headers["location"]
    other = client.post(
        "/v1/jobs", json=job_body(options={"identity_weight": 0.5}), headers=headers
    )
    assert other.status_code == 409 and _error(other) == "idempotency_key_reused"
    # the same key belongs to each user separately
    someone = make_user(engine, settings)
    theirs = client.post(
        "/v1/jobs", json=job_body(), headers={**auth(someone), "Idempotency-Key": "order-42"}
    )
    assert theirs.status_code == 202 and theirs.json()["id"] != first.json()["id"]
    assert len(jobs_of(engine)) == 2


def test_idempotent_multipart_matches_json_with_same_images(
    client: TestClient, engine: Engine, user: NewUser
) -> None:
    headers = {**auth(user), "Idempotency-Key": "same-images"}
    first = client.post("/v1/jobs", json=job_body(options={}), headers=headers)
    again = client.post(
        "/v1/jobs",
        headers=headers,
        files={"source": ("s.jpg", source_jpeg()), "target": ("t.jpg", target_jpeg())},
    )
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"]


# --------------------------------------------------------------------------- Prefer: wait


def test_prefer_wait_returns_current_object_after_timeout(
    client: TestClient, engine: Engine, user: NewUser
) -> None:
    started = time.monotonic()
    response = client.post("/v1/jobs", json=job_body(), headers={**auth(user), "Prefer": "wait=1"})
    elapsed = time.monotonic() - started
    assert response.status_code == 202 and response.json()["status"] == "queued"
    assert 0.9 <= elapsed < 5
    assert response.headers["preference-applied"] == "wait=1"


def test_prefer_wait_returns_as_soon_as_the_job_is_terminal(
    client: TestClient, engine: Engine, user: NewUser
) -> None:

    def finish(job_id: uuid.UUID) -> None:
        succeed(engine, job_id, result_key=f"results/{job_id}/attempt-1.png")

    started = time.monotonic()
    response, _ = _wait_and_end(client, user, finish, prefer="respond-async, wait=30")
    elapsed = time.monotonic() - started
    assert response.status_code == 202
    job = response.json()
    assert job["status"] == "succeeded" and job["result"]["width"] == 64
    assert elapsed < 10


def _wait_and_end(
    client: TestClient,
    user: NewUser,
    end: Callable[[uuid.UUID], float | None],
    prefer: str = "wait=30",
) -> tuple[Response, float]:
    """POST a job with ``Prefer: <prefer>``, have ``end`` end it from another thread 0.3 s
    after it is stored (looked for over 10 s); the response and how long after the end's
    commit it came (the wall-clock time ``end`` returns, else when it returned)."""
    ended_at: list[float] = []
    engine = client.app.state.engine  # type: ignore[attr-defined]

    def end_when_submitted() -> None:
        jobs = poll_value(lambda: jobs_of(engine, user.user.id) or None, 10, step_s=0.05)
        if jobs:
            time.sleep(0.3)
            committed = end(jobs[0].id)
            ended_at.append(committed or time.time())

    worker = threading.Thread(target=end_when_submitted)
    worker.start()
    response = client.post("/v1/jobs", json=job_body(), headers={**auth(user), "Prefer": prefer})
    answered = time.time()
    worker.join()
    return response, answered - ended_at[0]


_END_ELSEWHERE = (
    "import sys, time, uuid\n"
    "from sqlalchemy import create_engine\n"
    "from faceflow.testing.jobs import succeed\n"
    "job_id = uuid.UUID(sys.argv[2])\n"
    "succeed(create_engine(sys.argv[1]), job_id, result_key=f'results/{job_id}.png')\n"
    "print(time.time(), flush=True)\n"
)


@pytest.mark.parametrize("where", ["this process", "another process"])
def test_a_waiter_hears_of_its_jobs_end_at_once_not_at_its_poll(
    database_url: str, tmp_path: Path, engine: Engine, where: str
) -> None:
    """Issue 24: the job store is read every 5 s here, yet the answer follows the end's
    commit by milliseconds (the margin is for a loaded machine): in this process through
    the session's commit, from another process (a relay run as its own service, another
    replica) through PostgreSQL's NOTIFY in the ending transaction and the API's LISTEN."""
    if where == "another process" and not database_url.startswith("postgresql"):
        pytest.skip("only PostgreSQL carries job ends between processes (NOTIFY)")

    def end(job_id: uuid.UUID) -> float | None:
        if where == "this process":
            succeed(engine, job_id, result_key=f"results/{job_id}.png")
            return None
        done = subprocess.run(
            [sys.executable, "-c", _END_ELSEWHERE, database_url, str(job_id)],
            check=True,
            timeout=60,
            cwd=Path(__file__).resolve().parents[2],
            capture_output=True,
            text=True,
        )
        return float(done.stdout.split()[-1])

    with app_client(database_url, tmp_path, wait_poll_seconds=5.0) as client:
        user = make_user(engine, client.app.state.settings)  # type: ignore[attr-defined]
        response, after = _wait_and_end(client, user, end)
    assert response.status_code == 202 and response.json()["status"] == "succeeded"
    assert after < 2.5, after
    print(f"\nend committed in {where} -> answered: {after * 1000:.1f} ms (poll 5 s)")


# --------------------------------------------------------------------------- read, list, ownership


def test_read_job_and_ownership_404s(
    client: TestClient, engine: Engine, settings: Settings
) -> None:
    owner, stranger = make_user(engine, settings), make_user(engine, settings)
    job_id = submit(client, owner)
    mine = client.get(f"/v1/jobs/{job_id}", headers=auth(owner))
    assert mine.status_code == 200 and mine.json()["id"] == job_id
    assert set(mine.json()) >= {
        "id", "status", "stage", "attempts", "created_at", "started_at", "finished_at",
        "deadline_at", "error", "result", "timings", "urls", "callbacks",
    }  # fmt: skip
    for method, path in (
        ("GET", f"/v1/jobs/{job_id}"),
        ("GET", f"/v1/jobs/{job_id}/result"),
        ("POST", f"/v1/jobs/{job_id}/cancel"),
        ("GET", f"/v1/jobs/{uuid.uuid4()}"),
    ):
        response = client.request(method, path, headers=auth(stranger))
        assert response.status_code == 404, (method, path)
        assert _error(response) == "not_found"
    assert client.get(f"/v1/jobs/{job_id}", headers=auth(owner)).json()["status"] == "queued"
    assert client.get("/v1/jobs", headers=auth(stranger)).json() == {
        "data": [],
        "next_cursor": None,
    }


def test_list_newest_first_with_cursor_and_status_filter(
    client: TestClient, engine: Engine, settings: Settings
) -> None:
    user = make_user(engine, settings, quota=10)
    ids = [submit(client, user) for _ in range(5)]
    move(engine, ids[1], JobStatus.cancelled, JobStatus.queued)
    seen, cursor, pages = [], None, 0
    while True:
        params = {"limit": 2, **({"cursor": cursor} if cursor else {})}
        page = client.get("/v1/jobs", params=params, headers=auth(user)).json()
        seen += [job["id"] for job in page["data"]]
        pages += 1
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == ids[::-1] and pages == 3
    queued = client.get("/v1/jobs", params={"status": "queued"}, headers=auth(user)).json()
    assert [job["id"] for job in queued["data"]] == [i for i in ids[::-1] if i != ids[1]]
    cancelled = client.get("/v1/jobs", params={"status": "cancelled"}, headers=auth(user)).json()
    assert [job["id"] for job in cancelled["data"]] == [ids[1]]
    bad = client.get("/v1/jobs", params={"cursor": "not-a-cursor"}, headers=auth(user))
    assert bad.status_code == 422
    assert client.get("/v1/jobs", params={"status": "nope"}, headers=auth(user)).status_code == 422


# --------------------------------------------------------------------------- cancel


def _cancel(client: TestClient, user: NewUser, job_id: str) -> Response:
    return client.post(f"/v1/jobs/{job_id}/cancel", headers=auth(user))


def _not_cancellable(response: Response) -> bool:
    return response.status_code == 409 and _error(response) == "job_not_cancellable"


def test_cancel_queued_is_immediate_and_obsoletes_dispatch(
    client: TestClient, engine: Engine, user: NewUser
) -> None:
    body = job_body(callback_url="http://127.0.0.1:9/hook")
    job_id = client.post("/v1/jobs", json=body, headers=auth(user)).json()["id"]
    response = _cancel(client, user, job_id)
    assert response.status_code == 200, response.text
    job = response.json()
    assert job["status"] == "cancelled" and job["finished_at"] is not None
    assert job["error"]["code"] == "cancelled"
    rows = {row.kind: row for row in outbox_of(engine, uuid.UUID(job_id))}
    assert rows["dispatch"].outcome == "obsolete" and rows["dispatch"].done_at is not None
    assert rows["webhook"].payload["event"] == "job.cancelled"
    assert "cancel_run" not in rows  # never dispatched: no flow run to cancel
    assert _not_cancellable(_cancel(client, user, job_id))


def test_cancel_dispatched_queued_job_cancels_its_flow_run(
    client: TestClient, engine: Engine, user: NewUser
) -> None:
    job_id = submit(client, user)
    flow_run_id = dispatch(engine, job_id)
    assert _cancel(client, user, job_id).json()["status"] == "cancelled"
    cancel_rows = [row for row in outbox_of(engine, uuid.UUID(job_id)) if row.kind == "cancel_run"]
    assert [row.payload for row in cancel_rows] == [{"flow_run_id": str(flow_run_id), "attempt": 1}]


def test_cancel_running_requests_cancellation(
    client: TestClient, engine: Engine, user: NewUser
) -> None:
    job_id = submit(client, user)
    dispatch(engine, job_id)
    move(engine, job_id, JobStatus.running, JobStatus.queued)
    response = _cancel(client, user, job_id)
    assert response.status_code == 202 and response.json()["status"] == "cancel_requested"
    again = _cancel(client, user, job_id)
    assert again.status_code == 202 and again.json()["status"] == "cancel_requested"
    cancel_rows = [row for row in outbox_of(engine, uuid.UUID(job_id)) if row.kind == "cancel_run"]
    assert len(cancel_rows) == 1
    # the relay sees the run stop
    move(engine, job_id, JobStatus.cancelled, JobStatus.cancel_requested)
    assert client.get(f"/v1/jobs/{job_id}", headers=auth(user)).json()["status"] == "cancelled"
    assert _cancel(client, user, job_id).status_code == 409


@pytest.mark.parametrize("terminal", [JobStatus.succeeded, JobStatus.failed, JobStatus.expired])
def test_cancel_terminal_is_409(
    client: TestClient, engine: Engine, user: NewUser, terminal: JobStatus
) -> None:
    job_id = submit(client, user)
    if terminal is JobStatus.succeeded:
        succeed(engine, job_id, result_key="results/a/attempt-1.png")
    else:
        move(engine, job_id, terminal, JobStatus.queued, error_code="x", error_message="y")
    assert _not_cancellable(_cancel(client, user, job_id))


# --------------------------------------------------------------------------- result


def test_result_404_before_success_then_bytes(
    client: TestClient, engine: Engine, settings: Settings, user: NewUser
) -> None:
    job_id = submit(client, user)
    before = client.get(f"/v1/jobs/{job_id}/result", headers=auth(user))
    assert before.status_code == 404 and _error(before) == "not_found"
    png = image_bytes(64, 48)
    key = f"results/{job_id}/attempt-1.png"
    LocalObjectStore(settings.storage_url.removeprefix("file://")).put(key, png)
    succeed(engine, job_id, result_key=key, timings={"detect": 3.0, "fuse": 9.0})
    job = client.get(f"/v1/jobs/{job_id}", headers=auth(user)).json()
    assert job["status"] == "succeeded" and job["timings"] == {"detect": 3.0, "fuse": 9.0}
    assert job["result"] == {
        "url": f"{job['urls']['self']}/result",
        "content_type": "image/png",
        "width": 64,
        "height": 48,
    }
    response = client.get(job["result"]["url"], headers=auth(user))
    assert response.status_code == 200 and response.content == png
    assert response.headers["content-type"] == "image/png"


# --------------------------------------------------------------------------- errors, docs


def test_unknown_route_and_method_use_the_error_body(client: TestClient) -> None:
    assert _error(client.get("/nope")) == "not_found"
    assert client.delete("/v1/jobs").status_code == 405
    assert client.get(
        "/v1/jobs/not-a-uuid", headers={"Authorization": "Bearer ff_x"}
    ).status_code in (401, 422)


def test_openapi_documents_both_submit_bodies(client: TestClient) -> None:
    assert client.get("/docs").status_code == 200
    spec = client.get("/openapi.json").json()
    content = spec["paths"]["/v1/jobs"]["post"]["requestBody"]["content"]
    assert set(content) == {"application/json", "multipart/form-data"}
    assert "JobCreate" in spec["components"]["schemas"]
    assert "FusionOptions" in spec["components"]["schemas"]


# --------------------------------------------------------------------------- per-face mapping

MAPPING = [{"source": 0, "target": 0}, {"source": 1, "reference": 0}]


def _mapped_body(**overrides: object) -> dict[str, object]:
    body: dict[str, object] = {
        "sources": [data_uri(source_jpeg()), data_uri(target_jpeg())],
        "target": data_uri(target_jpeg()),
        "references": [data_uri(source_jpeg())],
        "options": {"mapping": MAPPING},
    }
    body.update(overrides)
    return body


def test_several_sources_and_references_are_stored_and_digested(
    client: TestClient, engine: Engine, settings: Settings, user: NewUser
) -> None:
    headers = {**auth(user), "Idempotency-Key": "mapped"}
    response = client.post("/v1/jobs", json=_mapped_body(), headers=headers)
    assert response.status_code == 202, response.text
    assert response.json()["options"]["mapping"] == [
        {"source": 0, "target": 0, "reference": None},
        {"source": 1, "target": None, "reference": 0},
    ]
    [stored] = jobs_of(engine, user.user.id)
    store = LocalObjectStore(Path(settings.storage_url.removeprefix("file://")))
    assert stored.extra_inputs is not None
    [second] = stored.extra_inputs["sources"]
    [reference] = stored.extra_inputs["references"]
    assert store.get(second) == target_jpeg() and store.get(reference) == source_jpeg()
    assert stored.source_key is not None and store.get(stored.source_key) == source_jpeg()
    # Every image is part of "the same request": another reference is another request.
    again = client.post("/v1/jobs", json=_mapped_body(), headers=headers)
    assert again.status_code == 200 and again.json()["id"] == response.json()["id"]
    other = _mapped_body(references=[data_uri(image_bytes(64, 64), "image/png")])
    conflict = client.post("/v1/jobs", json=other, headers=headers)
    assert conflict.status_code == 409 and _error(conflict) == "idempotency_key_reused"


def test_mapping_must_fit_the_images_given(
    client: TestClient, engine: Engine, user: NewUser
) -> None:
    one = data_uri(source_jpeg())
    twice = [{"source": 0, "target": 1}, {"source": 1, "target": 1}]
    bad = [
        (_mapped_body(options={}), "invalid_mapping"),  # several sources, no mapping
        (_mapped_body(options={"mapping": [{"source": 2, "target": 0}]}), "invalid_mapping"),
        (_mapped_body(options={"mapping": [{"source": 0, "reference": 1}]}), "invalid_mapping"),
        (_mapped_body(options={"mapping": [{"source": 0, "target": 0}]}), "invalid_mapping"),
        (_mapped_body(options={"mapping": twice}, references=None), "invalid_mapping"),
        (_mapped_body(source=one), "invalid_request"),  # source and sources
        (_mapped_body(options={"mapping": [{"source": 0}]}), "invalid_request"),
        (_mapped_body(options={"mapping": MAPPING, "face": "all"}), "invalid_request"),
        (_mapped_body(references=["https://93.184.216.34/ref.jpg"]), "invalid_request"),
        ({**_mapped_body(), "sources": [one] * 9}, "invalid_request"),
    ]
    for body, code in bad:
        response = client.post("/v1/jobs", json=body, headers=auth(user))
        assert response.status_code == 422, (body.get("options"), response.text)
        assert _error(response) == code, response.text
    assert jobs_of(engine, user.user.id) == []


def test_mapping_over_multipart_repeats_the_source_part(
    client: TestClient, engine: Engine, user: NewUser
) -> None:
    two_sources = [
        ("source", ("a.jpg", source_jpeg(), "image/jpeg")),
        ("source", ("b.jpg", target_jpeg(), "image/jpeg")),
        ("target", ("t.jpg", target_jpeg(), "image/jpeg")),
    ]
    response = client.post(
        "/v1/jobs",
        headers=auth(user),
        files=[*two_sources, ("reference", ("r.jpg", source_jpeg(), "image/jpeg"))],
        data={"params": json.dumps({"options": {"mapping": MAPPING}})},
    )
    assert response.status_code == 202, response.text
    [stored] = jobs_of(engine, user.user.id)
    assert stored.extra_inputs is not None
    assert len(stored.extra_inputs["sources"]) == 1 == len(stored.extra_inputs["references"])
    two_sources_no_mapping = client.post("/v1/jobs", headers=auth(user), files=two_sources)
    assert two_sources_no_mapping.status_code == 422
