"""A job store that cannot be reached for a moment (a PostgreSQL restart) is answered 503
``store_unavailable`` with ``Retry-After`` and one warning line, not 500 and a traceback;
the API answers again as soon as the store is back. Other database errors stay 500.

The real app runs against a real PostgreSQL reached through a loopback forwarder that the
test cuts (every open connection closed, new ones refused) and restores.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa
from fastapi import FastAPI
from fastapi.testclient import TestClient
from httpx import Response

from faceflow.testing.jobs import auth, make_user, submit
from faceflow.testing.net import TcpForwarder
from tests.webapi.conftest import make_settings
from webapi import errors
from webapi.db import get_engine
from webapi.main import create_app


@pytest.mark.postgres
def test_an_unreachable_job_store_is_503_until_it_is_back(
    forwarded_store: tuple[str, TcpForwarder], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url, forwarder = forwarded_store
    settings = make_settings(url, tmp_path)
    user = make_user(get_engine(url), settings)
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        job_id = submit(client, user)
        calls: dict[str, Callable[[], Response]] = {
            "status": lambda: client.get(f"/v1/jobs/{job_id}", headers=auth(user)),
            "list": lambda: client.get("/v1/jobs", headers=auth(user)),
            "cancel": lambda: client.post(f"/v1/jobs/{job_id}/cancel", headers=auth(user)),
        }
        assert calls["status"]().status_code == 200
        assert calls["list"]().status_code == 200

        forwarder.cut()
        try:
            caplog.clear()
            caplog.set_level(logging.WARNING)
            for name, call in calls.items():
                response = call()
                assert response.status_code == 503, (name, response.text)
                assert response.json()["error"]["code"] == "store_unavailable", name
                assert response.headers["Retry-After"] == "2", name
            store_lines = [r for r in caplog.records if r.name == errors.__name__]
            assert [r.levelno for r in store_lines] == [logging.WARNING] * len(calls)
            assert not any(r.exc_info for r in store_lines)
        finally:
            forwarder.restore()

        assert calls["status"]().status_code == 200
        assert calls["list"]().json()["data"][0]["id"] == job_id
        cancelled = calls["cancel"]()
        assert cancelled.status_code == 200, cancelled.text
        assert cancelled.json()["status"] == "cancelled"


def _raising(exc: Exception) -> TestClient:
    """A client of an app with the API's error handlers whose one route raises ``exc``."""
    app = FastAPI()
    errors.install(app)

    @app.get("/boom")
    def boom() -> None:
        raise exc

    return TestClient(app, raise_server_exceptions=False)


def _dbapi(cls: type[sa.exc.DBAPIError], *, invalidated: bool = False) -> sa.exc.DBAPIError:
    return cls("SELECT 1", {}, Exception("driver says no"), connection_invalidated=invalidated)


@pytest.mark.parametrize(
    ("exc", "status", "code"),
    [
        (_dbapi(sa.exc.OperationalError), 503, "store_unavailable"),
        (_dbapi(sa.exc.InterfaceError), 503, "store_unavailable"),
        (_dbapi(sa.exc.DBAPIError, invalidated=True), 503, "store_unavailable"),
        (_dbapi(sa.exc.IntegrityError), 500, "internal_error"),
        (_dbapi(sa.exc.ProgrammingError), 500, "internal_error"),
        (_dbapi(sa.exc.DBAPIError), 500, "internal_error"),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, Exception) else None,
)
def test_only_connection_failures_of_the_store_are_503(
    exc: Exception, status: int, code: str
) -> None:
    with _raising(exc) as client:
        response = client.get("/boom")
    assert (response.status_code, response.json()["error"]["code"]) == (status, code)
    assert ("Retry-After" in response.headers) == (status == 503)


def test_a_job_store_whose_pool_is_exhausted_is_503(tmp_path: Path) -> None:
    """Every pooled connection busy for the pool's timeout (an overloaded store): the real
    pool's ``TimeoutError`` answers 503 ``store_unavailable`` with ``Retry-After``, as a
    store that cannot be reached does, not 500 and a traceback."""
    engine = sa.create_engine(
        f"sqlite:///{tmp_path / 'busy.db'}", pool_size=1, max_overflow=0, pool_timeout=0.2
    )
    app = FastAPI()
    errors.install(app)

    @app.get("/read")
    def read() -> int:
        with engine.connect() as connection:
            return int(connection.execute(sa.text("SELECT 1")).scalar_one())

    with TestClient(app, raise_server_exceptions=False) as client:
        assert client.get("/read").json() == 1
        with engine.connect():  # the pool's one connection, held
            response = client.get("/read")
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "store_unavailable"
        assert response.headers["Retry-After"] == "2"
        assert client.get("/read").json() == 1
    engine.dispose()
