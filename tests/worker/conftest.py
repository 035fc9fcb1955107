"""Real services for the warm-worker tests: a Prefect server, work pools, deployments of
``tests/worker/probe_flow.py`` and ``prefect worker start`` processes (stopped by PID)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from faceflow.supervisor import Service
from faceflow.testing.net import free_port
from faceflow.testing.prefect import PREFECT, PrefectRest, PrefectServer
from faceflow.testing.wait import poll, poll_value
from faceflow.worker.pool_events import EVENTS_SETTLE_S
from flows.binding import signed_parameters, worker_keys
from tests.orchestration.conftest import Home, prefect_server

__all__ = ["prefect_server"]  # the orchestration tests' server fixture, shared here

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "work_pools" / "faceflow-gpu.json"
PROBE_ENTRYPOINT = "tests/worker/probe_flow.py:warm_probe"
FUSE_ENTRYPOINT = "flows/fuse.py:fuse_faces"


class Api(PrefectRest):
    """The test Prefect server's REST API and its FaceFlow home."""

    def __init__(self, server: PrefectServer) -> None:
        super().__init__(server.api_url)
        self.server = server

    @property
    def home(self) -> Home:
        """FaceFlow's home of the server: storage of inputs and results."""
        return Home(self.server.home)

    def state(self, run_id: str) -> str:
        return str(self.run(run_id)["state_type"])


@pytest.fixture(scope="session")
def prefect_api(prefect_server: PrefectServer) -> Api:
    """The orchestration tests' ``prefect server start`` (session), with FaceFlow's default
    blocks saved (local storage under the server's FaceFlow home)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from blocks import init_default_blocks

    with temporary_settings(updates={PREFECT_API_URL: prefect_server.api_url}):
        init_default_blocks(prefect_server.home)
    return Api(prefect_server)


def fuse_params(source_key: str, target_key: str, **extra: Any) -> dict[str, Any]:
    """``fuse-faces`` parameters of a fresh job (deadline ten minutes away: 2 busy cores),
    bound to the job as the relay binds them (``flows.binding``: the workers started here
    hold this process's key)."""
    deadline = datetime.now(UTC) + timedelta(minutes=10)
    params = {
        "job_id": str(uuid.uuid4()),
        "owner_id": "owner-1",
        "source_key": source_key,
        "target_key": target_key,
        "deadline_at": deadline.isoformat(),
        **extra,
    }
    return signed_parameters(params, worker_keys()[0])


@pytest.fixture(scope="session")
def inputs(prefect_api: Api) -> tuple[str, str]:
    """Storage keys of the sample source (astronaut) and target (Grace Hopper) photos."""
    from tests.samples import astronaut_jpeg_bytes, grace_hopper_jpeg_bytes

    home = prefect_api.home
    return home.put_input(astronaut_jpeg_bytes()), home.put_input(grace_hopper_jpeg_bytes())


def pool_template() -> dict[str, Any]:
    return dict(json.loads(TEMPLATE.read_text()))


def probe_pool(api: Api, prefix: str) -> tuple[str, str]:
    """A fresh faceflow-gpu pool ``<prefix>-<hex>`` with the probe deployed in it, for a
    worker driven in-process: (pool name, deployment id)."""
    pool = f"{prefix}-{uuid.uuid4().hex[:6]}"
    api.create_pool(pool, "faceflow-gpu", pool_template())
    return pool, api.deploy("warm-probe", PROBE_ENTRYPOINT, pool)


def in_process_settings(api: Api) -> dict[Any, Any]:
    """Prefect settings for a worker driven in this process (``temporary_settings``): the
    test server's API, no logs sent to it."""
    from prefect.settings import PREFECT_API_URL, PREFECT_LOGGING_TO_API_ENABLED

    return {PREFECT_API_URL: api.server.api_url, PREFECT_LOGGING_TO_API_ENABLED: False}


@dataclass
class WarmWorker:
    """One ``prefect worker start --type faceflow-gpu`` process and its health endpoint."""

    api: Api
    pool: str
    deployment_id: str
    fuse_deployment_id: str
    out_dir: Path
    service: Service
    health_port: int
    env: dict[str, str] = field(default_factory=dict)

    def status(self) -> dict[str, Any]:
        response = httpx.get(f"http://127.0.0.1:{self.health_port}/status", timeout=5)
        response.raise_for_status()
        return dict(response.json())

    def ready(self) -> bool:
        response = httpx.get(f"http://127.0.0.1:{self.health_port}/ready", timeout=2)
        return response.status_code == 200

    def wait_idle(self, timeout: float = 120) -> dict[str, Any]:
        """Wait until every child is warm and idle; the status then."""

        def idle() -> dict[str, Any] | None:
            with contextlib.suppress(httpx.HTTPError):
                status = self.status()
                if status["children"] and all(c["state"] == "idle" for c in status["children"]):
                    return status
            if not self.service.alive():
                raise AssertionError(f"worker exited; log: {self.service.log.read_text()[-3000:]}")
            return None

        status = poll_value(idle, timeout, step_s=0.1)
        if status is None:
            raise AssertionError(f"worker children not idle after {timeout} s")
        return status

    def holding(self, run_id: str) -> list[int]:
        """The pids of this worker's children that hold flow run ``run_id`` now."""
        children = self.status()["children"]
        return [int(c["pid"]) for c in children if c["flow_run_id"] == run_id and c["pid"]]

    def submit(self, job_variables: dict[str, Any] | None = None, **parameters: Any) -> str:
        params = {"out_dir": str(self.out_dir), **parameters}
        return self.api.create_run(self.deployment_id, params, job_variables)

    def wait_events_settled(self, timeout: float = 60) -> None:
        """Wait until the worker's event stream is up and the polls it makes on connecting
        are behind it (the second comes ``EVENTS_SETTLE_S`` later): from then on a
        ``Scheduled`` run is claimed from its event, and the poll counts stay still."""
        assert poll(lambda: self.status()["events_live"], timeout, step_s=0.1)
        time.sleep(EVENTS_SETTLE_S + 1.0)

    def run_claimed_from_its_event(self, timeout: float = 60) -> str:
        """Submit a run, wait until it is ``Completed`` and check that the worker claimed it
        from its ``Scheduled`` event, not by a poll of the pool: its id."""
        self.wait_events_settled()
        before = self.status()["claims"]
        run_id = self.submit()
        assert self.api.wait_final(run_id, timeout=timeout)["state_type"] == "COMPLETED"
        after = self.status()["claims"]
        assert after == {"event": before["event"] + 1, "poll": before["poll"]}, (before, after)
        return run_id

    def submit_fuse(self, source_key: str, target_key: str, **extra: Any) -> tuple[str, str]:
        """One ``fuse-faces`` job run; returns (flow run id, job id)."""
        params = fuse_params(source_key, target_key, **extra)
        return self.api.create_run(self.fuse_deployment_id, params), params["job_id"]

    def report(self, run_id: str, suffix: str = ".json") -> dict[str, Any]:
        return dict(json.loads((self.out_dir / f"{run_id}{suffix}").read_text()))

    def wait_started(self, run_id: str, timeout: float = 30) -> dict[str, Any]:
        path = self.out_dir / f"{run_id}.started.json"
        if not poll(path.exists, timeout, step_s=0.02):
            raise AssertionError(f"run {run_id} did not start within {timeout} s")
        time.sleep(0.05)
        return dict(json.loads(path.read_text()))


def start_warm_worker(
    api: Api,
    tmp: Path,
    pool: str,
    extra_env: dict[str, str] | None = None,
    via_faceflow_cli: bool = False,
    name: str | None = None,
    create_pool: bool = True,
) -> WarmWorker:
    """Create ``pool`` (faceflow-gpu), deploy the probe and ``fuse-faces`` into it and start
    a worker on it: ``prefect worker start --type faceflow-gpu`` or ``faceflow worker start``
    (named ``name``; ``create_pool=False``: the pool exists, the deployments are found)."""
    if create_pool:
        api.create_pool(pool, "faceflow-gpu", pool_template())
    deployment_id = api.deploy("warm-probe", PROBE_ENTRYPOINT, pool)
    fuse_id = api.deploy("fuse-faces", FUSE_ENTRYPOINT, pool)
    health_port = free_port()
    env = {
        **api.server.env,
        "FACEFLOW_WORKER_HEALTH_PORT": str(health_port),
        "FACEFLOW_WORKER_PRELOAD": json.dumps([PROBE_ENTRYPOINT, FUSE_ENTRYPOINT]),
        "FACEFLOW_WORKER_KILL_GRACE_S": "0.3",
        "FACEFLOW_WORKER_ACQUIRE_TIMEOUT_S": "8",
        **(extra_env or {}),
    }
    argv = (
        [sys.executable, "-m", "faceflow.worker.cli", "start", "--pool", pool]
        if via_faceflow_cli
        else [PREFECT, "worker", "start", "--pool", pool, "--type", "faceflow-gpu"]
    )
    if name is not None:
        argv += ["--name", name]
    service = Service(
        name=f"worker-{pool}",
        argv=argv,
        log=tmp / f"worker-{pool}.log",
        env=env,
        cwd=REPO,
    )
    service.start()
    worker = WarmWorker(api, pool, deployment_id, fuse_id, tmp / "out", service, health_port, env)
    worker.wait_idle()
    return worker


@pytest.fixture(scope="session")
def warm_worker(prefect_api: Api, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WarmWorker]:
    """A warm worker with one child on its own pool, shared by the session (tests that kill
    its child wait for the fresh one: ``wait_idle``)."""
    tmp = tmp_path_factory.mktemp("warm")
    worker = start_warm_worker(prefect_api, tmp, f"warm-{uuid.uuid4().hex[:6]}")
    try:
        yield worker
    finally:
        worker.service.stop(grace=15)


@contextmanager
def live_relay(prefect_api: Api, tmp_path: Path, **overrides: Any) -> Iterator[Any]:
    """The webapi's relay on a fresh SQLite job store in ``tmp_path``, sharing the flows'
    local storage (``overrides``: further settings); closed when the block ends."""
    from faceflow.testing.relay import FAST
    from tests.webapi.conftest import make_settings
    from webapi.db import dispose_engines, get_engine
    from webapi.migrations import upgrade
    from webapi.relay.runner import build_relay
    from webapi.storage import LocalObjectStore

    url = f"sqlite:///{tmp_path / 'jobs.db'}"
    upgrade(url)
    storage = prefect_api.home.storage
    settings = make_settings(
        url, tmp_path, prefect_api_url=prefect_api.url, storage_url=storage.as_uri(), **overrides
    )
    timings = dataclasses.replace(FAST, pending_timeout_s=120.0, running_grace_s=30.0)
    instance = build_relay(
        settings, engine=get_engine(url), store=LocalObjectStore(storage), timings=timings
    )
    try:
        yield instance
    finally:
        instance.close()
        dispose_engines()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
