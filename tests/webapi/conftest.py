"""Fixtures of the webapi tests, run against real SQLite and real PostgreSQL.

``database_url`` is module-scoped and parametrised: a SQLite file in a temp dir, and a
fresh PostgreSQL schema at 127.0.0.1:5432/test (skipped, saying why, when unreachable);
both migrated with Alembic. Every test using ``engine`` leaves the tables empty.
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy.engine import Engine

from tests.webapi.relay_harness import PrefectServer, stand_in_server
from webapi import crud
from webapi.config import Settings
from webapi.db import dispose_engines, get_engine
from webapi.main import create_app
from webapi.migrations import upgrade
from webapi.relay.context import Relay

PG_ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
TABLES_CHILD_FIRST = ("webhook_deliveries", "outbox", "jobs", "api_keys", "users")


def postgres_unavailable() -> str | None:
    """Why PostgreSQL cannot be used here, or None when it can."""
    try:
        engine = sa.create_engine(PG_ADMIN_URL, connect_args={"connect_timeout": 3})
        with engine.connect() as connection:
            connection.execute(sa.text("SELECT 1"))
        engine.dispose()
    except Exception as exc:
        return f"PostgreSQL at 127.0.0.1:5432/test is unreachable: {type(exc).__name__}: {exc}"
    return None


@pytest.fixture(
    scope="module",
    params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)],
)
def database_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A migrated, empty job store for one test module."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('jobstore') / 'jobs.db'}"
        upgrade(url)
        yield url
        dispose_engines()
        return
    reason = postgres_unavailable()
    if reason:
        pytest.skip(reason)
    schema = f"t_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(PG_ADMIN_URL)
    with admin.begin() as connection:
        connection.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    url = f"{PG_ADMIN_URL}?options=-csearch_path%3D{schema}"
    upgrade(url)
    try:
        yield url
    finally:
        dispose_engines()
        with admin.begin() as connection:
            connection.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    """The job store's engine; every row is deleted after the test."""
    engine = get_engine(database_url)
    crud.reset_service_time_cache()
    yield engine
    with engine.begin() as connection:
        for table in TABLES_CHILD_FIRST:
            connection.execute(sa.text(f"DELETE FROM {table}"))
    crud.reset_service_time_cache()


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


@pytest.fixture
def settings(database_url: str, tmp_path: Path) -> Settings:
    return make_settings(database_url, tmp_path)


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
    deadline = time.monotonic() + 15
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 with bucket ``faceflow``."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    with pytest.MonkeyPatch.context() as patch:
        for name, value in (
            ("AWS_ACCESS_KEY_ID", "testing"),
            ("AWS_SECRET_ACCESS_KEY", "testing"),
            ("AWS_DEFAULT_REGION", "us-east-1"),
        ):
            patch.setenv(name, value)
        import boto3

        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="faceflow")
        yield endpoint
    server.stop()


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
    from blocks import init_default_blocks
    from flows.batch import fuse_batch
    from flows.params import BATCH_DEPLOYMENT_NAME

    home = tmp_path_factory.mktemp("batch-home")
    saved = init_default_blocks(home)
    fuse_batch.to_deployment(name=BATCH_DEPLOYMENT_NAME).apply()
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

    from tests.webapi.relay_harness import FAST, SCRIPT
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
