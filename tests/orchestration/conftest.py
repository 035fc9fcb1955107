"""Fixtures of the orchestration tests: a Prefect test harness, blocks, inputs, a real server.

``prefect_harness`` (session) runs every in-process flow test against one temporary
Prefect server; ``moto`` (session) is an S3 protocol server (moto) on 127.0.0.1 with the
bucket ``S3_BUCKET``; ``prefect_server`` (session) is a separate ``prefect server start`` in a
subprocess with its own PREFECT_HOME, for the CLI, deployment and worker tests. Tests that
use either are marked ``prefect`` automatically.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from faceflow.testing.databases import postgres_unavailable
from faceflow.testing.inputs import put_input
from faceflow.testing.prefect import PrefectServer, server_database
from faceflow.testing.s3 import moto_server

REPO_ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
S3_BUCKET = "faceflow-test"

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/orchestration/" not in item.nodeid:
            continue
        # pytest-timeout's default (signal) method installs a SIGALRM handler, which makes
        # Prefect fall back to watcher-thread task timeouts that cannot interrupt a sleep.
        item.add_marker(pytest.mark.timeout(600, method="thread"))
        fixtures = getattr(item, "fixturenames", ())
        if "prefect_harness" in fixtures or "prefect_server" in fixtures:
            item.add_marker(pytest.mark.prefect)


@dataclass(frozen=True)
class Home:
    """A FaceFlow home with saved default blocks, and a way to put inputs in its storage."""

    path: Path

    @property
    def storage(self) -> Path:
        return self.path / "storage"

    def put_input(self, data: bytes, ext: str = "jpg") -> str:
        """Store ``data`` as the webapi would and return its key."""
        return put_input(self.storage, data, ext)


@pytest.fixture(scope="session")
def prefect_harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Home]:
    """A temporary Prefect server with the default blocks saved (storage in a temp home)."""
    from prefect.testing.utilities import prefect_test_harness

    from blocks import init_default_blocks
    from faceflow.testing.relay import drain_events

    home = tmp_path_factory.mktemp("faceflow-home")
    with prefect_test_harness(server_startup_timeout=90):
        init_default_blocks(home)
        yield Home(home)
        drain_events()  # bounded: the harness's own drain waits for ever on a stuck worker


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectServer]:
    """A real Prefect server on 127.0.0.1 with a temporary PREFECT_HOME, stopped by PID.

    Its database is a fresh PostgreSQL database on 127.0.0.1:5432 (dropped afterwards), as
    in production; SQLite only when PostgreSQL is unreachable (said on stderr). On SQLite
    the worker tests' bursts of 20 runs met ``database is locked`` for over 12 s (503s past
    every client retry) in about one run of three.
    """
    why = postgres_unavailable()
    if why is not None:
        print(f"prefect_server: {why}; the Prefect server runs on SQLite", file=sys.stderr)
    workers = {"PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_WORKER_PREFETCH_SECONDS": "1"}
    root = tmp_path_factory.mktemp("prefect-server")
    with server_database("sqlite" if why else "postgresql") as database_env:
        server = PrefectServer(root, client_extra=workers, server_env=database_env)
        server.start(timeout_s=120)
        try:
            yield server
        finally:
            server.stop(grace=10)


@pytest.fixture(scope="session")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A moto S3 server for the session with the bucket ``S3_BUCKET``; its endpoint URL."""
    with moto_server(tmp_path_factory.mktemp("moto"), S3_BUCKET) as endpoint:
        yield endpoint
