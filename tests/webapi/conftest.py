"""Fixtures of the webapi tests, run against real SQLite and real PostgreSQL.

``database_url`` is module-scoped and parametrised: a SQLite file in a temp dir, and a
fresh PostgreSQL schema at 127.0.0.1:5432/test (skipped, saying why, when unreachable);
both migrated with Alembic. Every test using ``engine`` leaves the tables empty.
"""

from __future__ import annotations

import secrets
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import pytest
import sqlalchemy as sa
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy.engine import Engine

from faceflow.testing.databases import job_store, postgres_unavailable
from faceflow.testing.jobs import make_user
from faceflow.testing.net import TcpForwarder
from faceflow.testing.prefect import PrefectServer
from faceflow.testing.relay import stand_in_server
from faceflow.testing.s3 import ACCESS_KEY, REGION, SECRET_KEY, moto_server
from faceflow.testing.wait import poll
from webapi import capacity
from webapi.config import Settings
from webapi.crud import NewUser
from webapi.db import get_engine
from webapi.main import create_app
from webapi.relay.context import Relay

TABLES_CHILD_FIRST = ("webhook_deliveries", "outbox", "jobs", "api_keys", "users")
PREFECT_AUTH = f"faceflow:{secrets.token_urlsafe(32)}"
"""The credential the ``locked`` Prefect server asks for."""


@pytest.fixture(
    scope="module",
    params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)],
)
def database_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A migrated, empty job store for one test module."""
    if request.param == "postgresql" and (reason := postgres_unavailable()):
        pytest.skip(reason)
    with job_store(request.param, tmp_path_factory.mktemp("jobstore"), prefix="t") as url:
        yield url


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    """The job store's engine; every row is deleted after the test."""
    engine = get_engine(database_url)
    capacity.reset_service_time_cache()
    yield engine
    with engine.begin() as connection:
        for table in TABLES_CHILD_FIRST:
            connection.execute(sa.text(f"DELETE FROM {table}"))
    capacity.reset_service_time_cache()


def make_settings(database_url: str, tmp_path: Path, **overrides: Any) -> Settings:
    """Test settings: private URLs allowed, no in-process relay, unreachable Prefect."""
    values: dict[str, Any] = {
        "home": tmp_path,
        "database_url": database_url,
        "storage_url": (tmp_path / "storage").as_uri(),
        "allow_private_urls": True,
        "run_relay": False,
        "prefect_api_url": "http://127.0.0.1:9/api",
        "default_service_seconds": 0.5,
        # One run per job, dispatched at once: the relay's batching has its own tests
        # (tests/webapi/test_batching.py, tests/worker/test_batch_relay.py).
        "batch_max_jobs": 1,
        **overrides,
    }
    return Settings.model_validate(values)


def app_client(database_url: str, tmp_path: Path, **overrides: Any) -> TestClient:
    """A client of an app with ``make_settings`` and ``overrides``."""
    return TestClient(create_app(make_settings(database_url, tmp_path, **overrides)))


@pytest.fixture
def settings(database_url: str, tmp_path: Path) -> Settings:
    return make_settings(database_url, tmp_path)


@pytest.fixture
def user(engine: Engine, settings: Settings) -> NewUser:
    """A new user of the test's job store (``make_user``)."""
    return make_user(engine, settings)


@pytest.fixture
def app(settings: Settings, engine: Engine) -> FastAPI:
    return create_app(settings)


@pytest.fixture
def client(app: FastAPI) -> Iterator[TestClient]:
    with TestClient(app) as test_client:
        yield test_client


@contextmanager
def serve(app: FastAPI) -> Iterator[str]:
    """Run ``app`` under a real uvicorn server on a free 127.0.0.1 port; its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    poll(lambda: server.started or not thread.is_alive(), 15, step_s=0.02)
    if not server.started:
        raise RuntimeError("uvicorn did not start")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()


@pytest.fixture
def live_url(app: FastAPI) -> Iterator[str]:
    """The app served by uvicorn on loopback."""
    with serve(app) as url:
        yield url


@pytest.fixture
def forwarded_store(tmp_path: Path) -> Iterator[tuple[str, TcpForwarder]]:
    """A migrated PostgreSQL job store and its URL through a ``TcpForwarder`` to it."""
    if reason := postgres_unavailable():
        pytest.skip(reason)
    with (
        TcpForwarder(("127.0.0.1", 5432)) as forwarder,
        job_store("postgresql", tmp_path, prefix="t") as url,
    ):
        assert "@127.0.0.1:5432/" in url
        yield url.replace("@127.0.0.1:5432/", f"@127.0.0.1:{forwarder.port}/"), forwarder


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 with bucket ``faceflow``; its keys and region in the
    environment (``AWS_*``) for the session."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in (
            ("AWS_ACCESS_KEY_ID", ACCESS_KEY),
            ("AWS_SECRET_ACCESS_KEY", SECRET_KEY),
            ("AWS_DEFAULT_REGION", REGION),
        ):
            patch.setenv(name, value)
        with moto_server(tmp_path_factory.mktemp("moto"), "faceflow") as endpoint:
            yield endpoint


@pytest.fixture(scope="module")
def locked(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectServer]:
    """A Prefect server that asks for ``PREFECT_AUTH``, with the stand-in deployments (one
    per test module); this process's Prefect client holds the credential meanwhile."""
    with stand_in_server(
        tmp_path_factory.mktemp("prefect-auth"), auth_string=PREFECT_AUTH
    ) as server:
        yield server


@pytest.fixture
def locked_settings(database_url: str, tmp_path: Path, locked: PrefectServer) -> Settings:
    """Test settings whose relay talks to the ``locked`` server with its credential."""
    return make_settings(
        database_url, tmp_path, prefect_api_url=locked.api_url, prefect_api_auth_string=PREFECT_AUTH
    )


def stand_in_run(server: PrefectServer, name: str) -> dict[str, Any]:
    """A new scheduled run of the stand-in ``fuse-faces`` deployment on ``server``, with
    placeholder parameters (nothing runs it unless the test does)."""
    deployment = server.rest.call("GET", "/deployments/name/fuse-faces/fuse-faces")
    parameters = {
        "job_id": "j1",
        "owner_id": "alice",
        "source_key": "inputs/alice/source",
        "target_key": "inputs/alice/target",
        "options": {},
        "deadline_at": "2030-01-01T00:00:00+00:00",
    }
    return dict(
        server.rest.call(
            "POST",
            f"/deployments/{deployment['id']}/create_flow_run",
            {"name": name, "parameters": parameters},
        )
    )


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectServer]:
    """A real Prefect server with the stand-in deployments; this process's Prefect client
    settings point at it while the session lasts."""
    with stand_in_server(tmp_path_factory.mktemp("prefect-home")) as server:
        yield server


@pytest.fixture(scope="session")
def batch_blocks(prefect_server: PrefectServer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default blocks on the test server (storage under a session home) and the real
    ``fuse-batch`` deployment; the storage directory the flows run in-process and the relay
    share (one per session: the storage block is saved once)."""
    from prefect.deployments.runner import RunnerDeployment

    from blocks import init_default_blocks
    from flows.batch import fuse_batch
    from flows.params import BATCH_DEPLOYMENT_NAME

    home = tmp_path_factory.mktemp("batch-home")
    saved = init_default_blocks(home)
    deployment = cast(RunnerDeployment, fuse_batch.to_deployment(name=BATCH_DEPLOYMENT_NAME))
    deployment.apply()  # sync in a sync fixture
    return saved.storage_path


@pytest.fixture
def flow_relays(
    engine: Engine,
    database_url: str,
    tmp_path: Path,
    prefect_server: PrefectServer,
    batch_blocks: Path,
) -> Iterator[Callable[..., Relay]]:
    """Make relays on the test Prefect server whose store is the flows' own storage
    (``batch_blocks``), for tests that run the real flows in-process; keyword arguments are
    settings. Every relay made is closed after the test."""
    from dataclasses import replace

    from faceflow.testing.relay import FAST, SCRIPT
    from webapi.relay.runner import build_relay
    from webapi.storage import LocalObjectStore

    made: list[Relay] = []

    def make(**overrides: Any) -> Relay:
        settings = make_settings(
            database_url, tmp_path, prefect_api_url=prefect_server.api_url, **overrides
        )
        store = LocalObjectStore(batch_blocks)
        SCRIPT.storage_dir = store.basepath  # the stand-in fuse-faces flow writes there too
        made.append(
            build_relay(
                settings, engine=engine, store=store, timings=replace(FAST, running_grace_s=30.0)
            )
        )
        return made[-1]

    yield make
    for relay in made:
        relay.close()
