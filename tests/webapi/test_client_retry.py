"""The Python clients ride out a short outage where a retry is safe: a job store cut for a
moment (a PostgreSQL restart: 503 ``store_unavailable``), an API whose port refuses
connections for a moment, and an ``overloaded`` submit are sent again after their
``Retry-After`` (or a backoff), and a submit whose fate is unknown is not.

The real app runs under uvicorn on loopback; what it answered is recorded by a middleware
of the app. Waits are loose: the cores are shared."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request, Response
from sqlalchemy.engine import Engine

from faceflow.client import (
    AsyncFaceFlowClient,
    FaceFlowAPIError,
    FaceFlowClient,
    RetryPolicy,
    retry_is_safe,
)
from faceflow.testing.jobs import make_user
from faceflow.testing.net import TcpForwarder
from faceflow.testing.wait import poll
from tests import samples
from tests.videos import Videos
from tests.webapi.conftest import make_settings, serve
from webapi.config import Settings
from webapi.db import get_engine
from webapi.main import create_app

Seen = list[tuple[str, str, int]]
SOURCE, TARGET = samples.astronaut_jpeg_bytes(), samples.grace_hopper_jpeg_bytes()


def answers_of(app: FastAPI) -> Seen:
    """``(method, path, status)`` of every request ``app`` answers, in order."""
    seen: Seen = []

    @app.middleware("http")
    async def record(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        response = await call_next(request)
        seen.append((request.method, request.url.path, response.status_code))
        return response

    return seen


def submits(seen: Seen) -> list[int]:
    return [status for method, path, status in seen if (method, path) == ("POST", "/v1/jobs")]


@contextmanager
def cut_for(forwarder: TcpForwarder, seconds: float) -> Iterator[None]:
    """Cut ``forwarder`` now and restore it ``seconds`` later, while the block runs."""
    forwarder.cut()
    restore = threading.Timer(seconds, forwarder.restore)
    restore.start()
    try:
        yield
    finally:
        restore.join()


@contextmanager
def fronted(app: FastAPI) -> Iterator[tuple[TcpForwarder, str]]:
    """``app`` under uvicorn behind a ``TcpForwarder``: the forwarder and its base URL."""
    with serve(app) as base:
        port = httpx.URL(base).port
        assert port is not None
        with TcpForwarder(("127.0.0.1", port)) as api:
            yield api, f"http://127.0.0.1:{api.port}"


@dataclass(frozen=True)
class Live:
    """The app served on loopback: its URL, what it answered, a user's API key and clients
    with the default retries (``ff``) and with none (``once``)."""

    base: str
    seen: Seen
    key: str
    ff: FaceFlowClient
    once: FaceFlowClient


@contextmanager
def live(settings: Settings, engine: Engine) -> Iterator[Live]:
    app = create_app(settings)
    seen = answers_of(app)
    key = make_user(engine, settings).api_key
    with (
        serve(app) as base,
        FaceFlowClient(base, key) as ff,
        FaceFlowClient(base, key, retries=0) as once,
    ):
        yield Live(base, seen, key, ff, once)


@pytest.mark.postgres
def test_reads_cancels_and_waits_ride_out_a_job_store_restart(
    forwarded_store: tuple[str, TcpForwarder], tmp_path: Path, videos: Videos
) -> None:
    url, store = forwarded_store
    settings = make_settings(url, tmp_path)
    with live(settings, get_engine(url)) as api:
        ff, once, seen = api.ff, api.once, api.seen
        job_id = str(ff.submit(SOURCE, TARGET)["id"])
        store.cut()
        try:
            for call in (once.status, once.cancel, once.wait):
                with pytest.raises(FaceFlowAPIError) as refused:
                    call(job_id)
                assert (refused.value.status, refused.value.code) == (503, "store_unavailable")
                assert refused.value.retry_after == 2
            before = len(submits(seen))
            with pytest.raises(FaceFlowAPIError) as unknown:  # its commit's fate is unknown
                ff.submit(SOURCE, TARGET)
            assert unknown.value.code == "store_unavailable"
            assert submits(seen)[before:] == [503]
        finally:
            store.restore()

        with cut_for(store, 1.0):
            assert ff.status(job_id)["status"] == "queued"
        with cut_for(store, 1.0):
            assert ff.cancel(job_id)["status"] == "cancelled"
        # Each poll gives up after one short wait (2 tries); ``wait`` polls again.
        before = len(seen)
        with (
            FaceFlowClient(api.base, api.key, retries=1, max_retry_wait=0.2) as impatient,
            cut_for(store, 1.5),
        ):
            assert impatient.wait(job_id, timeout=60, interval=0.1)["status"] == "cancelled"
        assert [status for _m, _p, status in seen[before:]].count(503) > 2

        before = len(submits(seen))
        with cut_for(store, 1.0):  # keyed: sent again, the video file read again from its start
            video = ff.submit(TARGET, videos.silent, idempotency_key="through-a-restart")
        assert submits(seen)[before] == 503 and submits(seen)[-1] == 202
        assert video["video"]["frame_count"] == 30
        again = ff.submit(TARGET, videos.silent, idempotency_key="through-a-restart")
        assert again["id"] == video["id"]


def test_an_overloaded_submit_is_sent_again_after_retry_after(
    database_url: str, tmp_path: Path, engine: Engine
) -> None:
    settings = make_settings(database_url, tmp_path, max_backlog=1)
    with live(settings, engine) as api:
        ff, once, seen = api.ff, api.once, api.seen
        first = ff.submit(SOURCE, TARGET)
        with pytest.raises(FaceFlowAPIError) as refused:
            once.submit(SOURCE, TARGET)
        assert (refused.value.status, refused.value.code) == (503, "overloaded")
        assert refused.value.retry_after is not None and refused.value.retry_after >= 1
        assert submits(seen) == [202, 503]

        answer: dict[str, object] = {}
        submitting = threading.Thread(target=lambda: answer.update(ff.submit(SOURCE, TARGET)))
        submitting.start()
        assert poll(lambda: len(submits(seen)) == 3, 30, step_s=0.01)  # refused again…
        once.cancel(str(first["id"]))  # …until the backlog is gone
        submitting.join(timeout=60)
    assert answer["status"] == "queued"
    assert submits(seen)[:3] == [202, 503, 503] and submits(seen)[-1] == 202


def test_connections_refused_for_a_moment_are_tried_again(
    database_url: str, tmp_path: Path, engine: Engine
) -> None:
    settings = make_settings(database_url, tmp_path)
    user = make_user(engine, settings)
    with fronted(create_app(settings)) as (api, front):
        with FaceFlowClient(front, user.api_key) as ff:
            job_id = str(ff.submit(SOURCE, TARGET)["id"])
            with cut_for(api, 1.0):
                assert ff.status(job_id)["id"] == job_id
            with cut_for(api, 1.0):  # nothing was sent: safe without a key too
                assert ff.submit(SOURCE, TARGET)["status"] == "queued"

        async def read() -> str:
            async with AsyncFaceFlowClient(front, user.api_key) as client:
                with cut_for(api, 1.0):
                    return str((await client.status(job_id))["id"])

        assert asyncio.run(read()) == job_id
        with (
            FaceFlowClient(front, user.api_key, retries=0) as once,
            cut_for(api, 0.5),
            pytest.raises(httpx.ConnectError),
        ):
            once.status(job_id)


def test_a_cancel_whose_answer_was_lost_gives_the_cancelled_job(
    database_url: str, tmp_path: Path, engine: Engine
) -> None:
    """A cancel served by the API whose answer never reached the client (the connection
    closed as it arrived) is sent again; the repeat's 409 ``job_not_cancellable`` is its
    own doing, so the client reads the job and gives it, cancelled. A 409 on a first try
    (or on a job that ended otherwise) stays an error."""
    settings = make_settings(database_url, tmp_path)
    app = create_app(settings)
    seen = answers_of(app)
    user = make_user(engine, settings)
    with fronted(app) as (api, front), FaceFlowClient(front, user.api_key) as ff:
        job_id = str(ff.submit(SOURCE, TARGET)["id"])
        api.lose_next_answer(b"/cancel")
        assert ff.cancel(job_id)["status"] == "cancelled"
        with pytest.raises(FaceFlowAPIError) as again:  # a cancel of a cancelled job
            ff.cancel(job_id)
        assert (again.value.status, again.value.code) == (409, "job_not_cancellable")

        async def cancel(job: str) -> str:
            async with AsyncFaceFlowClient(front, user.api_key) as client:
                return str((await client.cancel(job))["status"])

        other = str(ff.submit(SOURCE, TARGET)["id"])
        api.lose_next_answer(b"/cancel")
        assert asyncio.run(cancel(other)) == "cancelled"
    cancels = [status for method, path, status in seen if path.endswith("/cancel")]
    assert cancels == [200, 409, 409, 200, 409], seen


def test_only_requests_a_retry_cannot_harm_are_retried() -> None:
    def api_error(status: int, code: str) -> FaceFlowAPIError:
        return FaceFlowAPIError(status, code, "", 1.0)

    dropped = httpx.RemoteProtocolError("Server disconnected without sending a response.")
    refused = httpx.ConnectError("Connection refused")
    assert retry_is_safe(api_error(503, "store_unavailable"), idempotent=True)
    assert not retry_is_safe(api_error(503, "store_unavailable"), idempotent=False)
    assert not retry_is_safe(api_error(503, "transient_error"), idempotent=False)
    assert retry_is_safe(api_error(503, "overloaded"), idempotent=False)
    assert retry_is_safe(api_error(429, "quota_exceeded"), idempotent=False)
    assert not retry_is_safe(api_error(500, "internal_error"), idempotent=True)
    assert not retry_is_safe(api_error(409, "job_not_cancellable"), idempotent=True)
    assert retry_is_safe(refused, idempotent=False)
    assert retry_is_safe(dropped, idempotent=True)
    assert not retry_is_safe(dropped, idempotent=False)

    retrying = RetryPolicy(retries=3, max_retry_wait=5.0).start(idempotent=True)
    waits = [retrying.delay(FaceFlowAPIError(503, "store_unavailable", "", 2.0)) for _ in range(4)]
    assert waits[0] is not None and waits[1] is not None
    assert 2.0 <= waits[0] <= 2.2 and 2.0 <= waits[1] <= 2.2  # Retry-After, a little more
    assert waits[2] == pytest.approx(5.0 - waits[0] - waits[1])  # what the budget has left
    assert waits[3] is None
    backoff = RetryPolicy().start(idempotent=True)
    assert [round(backoff.delay(dropped) or 0, 1) for _ in range(2)] in ([0.5, 1.0], [0.5, 1.1])
    assert RetryPolicy(retries=0).start(idempotent=True).delay(dropped) is None
