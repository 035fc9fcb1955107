"""Real services for the warm-worker tests: a Prefect server, work pools, deployments of
``tests/worker/probe_flow.py`` and ``prefect worker start`` processes (stopped by PID)."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from faceflow.supervisor import Service

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "work_pools" / "faceflow-gpu.json"
PREFECT_BIN = str(Path(sys.executable).with_name("prefect"))
PROBE_ENTRYPOINT = "tests/worker/probe_flow.py:warm_probe"
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Api:
    """The test Prefect server's REST API (plain httpx: no client state to share)."""

    url: str
    home: Path

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """One request; 503s and dropped connections (SQLite under load) are retried."""
        for attempt in range(8):
            try:
                response = httpx.request(method, f"{self.url}{path}", json=body, timeout=30)
                if response.status_code != 503:
                    response.raise_for_status()
                    return response.json() if response.content else None
            except (httpx.ReadError, httpx.RemoteProtocolError, httpx.ConnectError):
                if attempt == 7:
                    raise
            time.sleep(0.1 * 2**attempt)
        response.raise_for_status()
        return None

    def get(self, path: str) -> Any:
        return self._request("GET", path)

    def post(self, path: str, body: dict[str, Any]) -> Any:
        return self._request("POST", path, body)

    def create_pool(self, name: str, worker_type: str, template: dict[str, Any] | None) -> None:
        body: dict[str, Any] = {"name": name, "type": worker_type}
        if template is not None:
            body["base_job_template"] = template
        self.post("/work_pools/", body)

    def deploy(self, name: str, pool: str, job_variables: dict[str, Any] | None = None) -> str:
        flow = self.post("/flows/", {"name": "warm-probe"})
        body = {
            "name": name,
            "flow_id": flow["id"],
            "entrypoint": PROBE_ENTRYPOINT,
            "work_pool_name": pool,
            "job_variables": job_variables or {},
            "enforce_parameter_schema": False,
        }
        return str(self.post("/deployments/", body)["id"])

    def create_run(
        self,
        deployment_id: str,
        parameters: dict[str, Any],
        job_variables: dict[str, Any] | None = None,
    ) -> str:
        body = {"parameters": parameters, "job_variables": job_variables or {}}
        run = self.post(f"/deployments/{deployment_id}/create_flow_run", body)
        return str(run["id"])

    def run(self, run_id: str) -> dict[str, Any]:
        return dict(self.get(f"/flow_runs/{run_id}"))

    def state(self, run_id: str) -> str:
        return str(self.run(run_id)["state_type"])

    def wait_state(self, run_id: str, states: set[str], timeout: float) -> dict[str, Any]:
        end = time.monotonic() + timeout
        while True:
            run = self.run(run_id)
            if run["state_type"] in states:
                return run
            if time.monotonic() > end:
                raise AssertionError(f"run {run_id} still {run['state_type']} after {timeout} s")
            time.sleep(0.05)

    def wait_message(self, run_id: str, prefix: str, timeout: float) -> dict[str, Any]:
        """Wait until the run is final with a state message starting with ``prefix``."""
        end = time.monotonic() + timeout
        while True:
            run = self.run(run_id)
            message = run["state"]["message"] or ""
            if run["state_type"] in FINAL and message.startswith(prefix):
                return run
            if time.monotonic() > end:
                raise AssertionError(f"run {run_id}: {run['state_type']} {message!r}")
            time.sleep(0.05)

    def wait_final(self, run_id: str, timeout: float = 60) -> dict[str, Any]:
        return self.wait_state(run_id, FINAL, timeout)

    def set_state(self, run_id: str, state_type: str, force: bool = False) -> None:
        self.post(f"/flow_runs/{run_id}/set_state", {"state": {"type": state_type}, "force": force})


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    """``prefect server start`` on 127.0.0.1 (own home, SQLite), stopped by PID."""
    home = tmp_path_factory.mktemp("prefect-home")
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    server = Service(
        name="prefect-server",
        argv=[PREFECT_BIN, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        log=home / "server.log",
        env={
            "PREFECT_HOME": str(home),
            "PREFECT_API_URL": url,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_UI_ENABLED": "false",
            "PREFECT_SERVER_LOGGING_LEVEL": "WARNING",
        },
    )
    server.start()
    try:
        server.wait_ready(lambda: httpx.get(f"{url}/health", timeout=2).status_code == 200, 120)
        yield Api(url=url, home=home)
    finally:
        server.stop(grace=10)


def pool_template() -> dict[str, Any]:
    return dict(json.loads(TEMPLATE.read_text()))


@dataclass
class WarmWorker:
    """One ``prefect worker start --type faceflow-gpu`` process and its health endpoint."""

    api: Api
    pool: str
    deployment_id: str
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
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                status = self.status()
                if status["children"] and all(c["state"] == "idle" for c in status["children"]):
                    return status
            except httpx.HTTPError:
                pass
            if not self.service.alive():
                raise AssertionError(f"worker exited; log: {self.service.log.read_text()[-3000:]}")
            time.sleep(0.1)
        raise AssertionError(f"worker children not idle after {timeout} s")

    def submit(self, job_variables: dict[str, Any] | None = None, **parameters: Any) -> str:
        params = {"out_dir": str(self.out_dir), **parameters}
        return self.api.create_run(self.deployment_id, params, job_variables)

    def report(self, run_id: str, suffix: str = ".json") -> dict[str, Any]:
        return dict(json.loads((self.out_dir / f"{run_id}{suffix}").read_text()))

    def wait_started(self, run_id: str, timeout: float = 30) -> dict[str, Any]:
        path = self.out_dir / f"{run_id}.started.json"
        end = time.monotonic() + timeout
        while not path.exists():
            if time.monotonic() > end:
                raise AssertionError(f"run {run_id} did not start within {timeout} s")
            time.sleep(0.02)
        time.sleep(0.05)
        return dict(json.loads(path.read_text()))


def start_warm_worker(
    api: Api, tmp: Path, pool: str, extra_env: dict[str, str] | None = None
) -> WarmWorker:
    """Create ``pool`` (faceflow-gpu), deploy the probe into it and start a worker on it."""
    api.create_pool(pool, "faceflow-gpu", pool_template())
    deployment_id = api.deploy(f"probe-{pool}", pool)
    health_port = free_port()
    env = {
        "PREFECT_API_URL": api.url,
        "PREFECT_HOME": str(api.home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_LOGGING_LEVEL": "INFO",
        "FACEFLOW_WORKER_HEALTH_PORT": str(health_port),
        "FACEFLOW_WORKER_PRELOAD": json.dumps([PROBE_ENTRYPOINT]),
        "FACEFLOW_WORKER_WORKING_DIR": str(REPO),
        "FACEFLOW_WORKER_KILL_GRACE_S": "0.3",
        "PYTHONUNBUFFERED": "1",
        **(extra_env or {}),
    }
    service = Service(
        name=f"worker-{pool}",
        argv=[PREFECT_BIN, "worker", "start", "--pool", pool, "--type", "faceflow-gpu"],
        log=tmp / f"worker-{pool}.log",
        env=env,
        cwd=REPO,
    )
    service.start()
    worker = WarmWorker(api, pool, deployment_id, tmp / "out", service, health_port, env)
    worker.wait_idle()
    return worker


@pytest.fixture(scope="module")
def warm_worker(prefect_api: Api, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WarmWorker]:
    """A warm worker with one child on its own pool (shared by a test module)."""
    tmp = tmp_path_factory.mktemp("warm")
    worker = start_warm_worker(prefect_api, tmp, f"warm-{uuid.uuid4().hex[:6]}")
    try:
        yield worker
    finally:
        worker.service.stop(grace=15)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
