"""A Prefect server for tests and benchmarks, and a REST client for any Prefect server.

``PrefectServer`` runs ``prefect server start`` on 127.0.0.1 in subprocesses with its own
PREFECT_HOME, stopped by PID (``faceflow.supervisor``) and restartable on its port, in
either of the stack's layouts (``faceflow.prefect_server``): embedded (the services in the
API process) or scale-out (one API process without services, the services in a process
of their own, messaging in Redis). ``start_server`` is the server as the benchmarks run
it, on the database ``server_database`` gives. ``PrefectRest`` talks to a server over
httpx, retrying what a busy server drops. Prefect itself is not imported.
"""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import httpx
from sqlalchemy.engine import make_url

from faceflow import prefect_server
from faceflow.prefect_server import PrefectMode
from faceflow.supervisor import Service
from faceflow.testing.databases import postgres_database
from faceflow.testing.net import free_port, http_ok
from faceflow.testing.wait import poll_value
from flows.params import run_tags
from webapi.prefect_api import auth_headers

REPO = Path(__file__).resolve().parents[2]
PREFECT = str(Path(sys.executable).with_name("prefect"))
SET_WORKING_DIRECTORY = "prefect.deployments.steps.set_working_directory"
FINAL = frozenset({"COMPLETED", "FAILED", "CRASHED", "CANCELLED"})
"""Flow-run state types a run does not leave."""
DATABASE_VAR = "PREFECT_SERVER_DATABASE_CONNECTION_URL"
BENCH_REDIS_URL = "redis://127.0.0.1:6379/9"
"""The scale-out layout's Redis database (flushed before each server start)."""


class PrefectRest:
    """A Prefect server's REST API over httpx; 503s and dropped connections (SQLite under
    load) are retried with backoff."""

    def __init__(self, url: str, headers: Mapping[str, str] | None = None) -> None:
        self.url = url
        self.http = httpx.Client(base_url=url, headers=dict(headers or {}), timeout=30)

    def call(self, method: str, path: str, body: Any = None) -> Any:
        """One request; its JSON answer (None when empty). ``httpx.HTTPStatusError`` for an
        error status other than 503."""
        for attempt in range(8):
            try:
                response = self.http.request(method, path, json=body)
                if response.status_code != 503:
                    response.raise_for_status()
                    return response.json() if response.content else None
            except (httpx.ReadError, httpx.RemoteProtocolError, httpx.ConnectError):
                if attempt == 7:
                    raise
            time.sleep(0.05 * 2**attempt)
        raise RuntimeError(f"{method} {path}: still 503")

    def close(self) -> None:
        """Close the connection pool."""
        self.http.close()

    def create_pool(self, name: str, worker_type: str, template: dict[str, Any]) -> None:
        """A work pool of ``worker_type`` with base job template ``template``."""
        body = {"name": name, "type": worker_type, "base_job_template": template}
        self.call("POST", "/work_pools/", body)

    def deploy(self, flow_name: str, entrypoint: str, pool: str, name: str | None = None) -> str:
        """A deployment of ``entrypoint`` in ``pool`` whose runs start in this checkout."""
        flow = self.call("POST", "/flows/", {"name": flow_name})
        body = {
            "name": name or f"{flow_name}-{pool}",
            "flow_id": flow["id"],
            "entrypoint": entrypoint,
            "work_pool_name": pool,
            "pull_steps": [{SET_WORKING_DIRECTORY: {"directory": str(REPO)}}],
            "enforce_parameter_schema": False,
        }
        return str(self.call("POST", "/deployments/", body)["id"])

    def create_run(
        self,
        deployment_id: str,
        parameters: dict[str, Any],
        job_variables: dict[str, Any] | None = None,
    ) -> str:
        """A run of ``deployment_id``; a ``fuse-faces`` job gets the name and tags the relay
        gives it (``webapi.prefect_api``), so the flow does what it does for real jobs."""
        body: dict[str, Any] = {"parameters": parameters, "job_variables": job_variables or {}}
        if "job_id" in parameters and "owner_id" in parameters:
            body["name"] = parameters["job_id"]
            body["tags"] = run_tags(parameters["job_id"], parameters["owner_id"])
        return str(self.call("POST", f"/deployments/{deployment_id}/create_flow_run", body)["id"])

    def run(self, run_id: str) -> dict[str, Any]:
        """The flow run as the API shows it."""
        return dict(self.call("GET", f"/flow_runs/{run_id}"))

    def state_types(self, run_ids: Iterable[str]) -> dict[str, str]:
        """Each flow run's state type, by run id."""
        return {run_id: self.run(run_id)["state_type"] for run_id in run_ids}

    def wait_final(
        self, run_id: str, timeout: float = 600, *, message_prefix: str = "", step_s: float = 0.25
    ) -> dict[str, Any]:
        """The run once its state is in ``FINAL`` with a message that starts with
        ``message_prefix`` (``AssertionError`` after ``timeout``). Latencies come from the
        server's timestamps, not from this poll every ``step_s``."""

        def final() -> dict[str, Any] | None:
            run = self.run(run_id)
            message = (run["state"] or {}).get("message") or ""
            done = run["state_type"] in FINAL and message.startswith(message_prefix)
            return run if done else None

        run = poll_value(final, timeout, step_s=step_s)
        if run is None:
            run = self.run(run_id)
            state = f"{run['state_type']} {(run['state'] or {}).get('message')!r}"
            raise AssertionError(f"run {run_id} is {state} after {timeout} s")
        return run

    def set_state(
        self, run_id: str, state_type: str, message: str | None = None, *, force: bool = True
    ) -> None:
        """Put a flow run in a state; ``force`` (default) past Prefect's orchestration
        rules, as a crashed or stopped worker leaves a run."""
        body = {"state": {"type": state_type, "message": message}, "force": force}
        self.call("POST", f"/flow_runs/{run_id}/set_state", body)

    def run_in(self, flow_id: str, state_type: str, tags: Sequence[str] = ()) -> str:
        """A new flow run of ``flow_id`` (no deployment) with ``tags``, put in
        ``state_type``: a run as a worker left it."""
        body = {"flow_id": flow_id, "tags": list(tags)}
        run_id = str(self.call("POST", "/flow_runs/", body)["id"])
        self.set_state(run_id, state_type)
        return run_id

    def report_progress(self, run_id: str, description: str) -> None:
        """A progress artifact on the run, as the flows write one per stage."""
        body = {"type": "progress", "data": 40.0, "description": description}
        self.call("POST", "/artifacts/", {**body, "flow_run_id": run_id})

    def delete_run(self, run_id: str) -> None:
        """Delete a flow run."""
        self.call("DELETE", f"/flow_runs/{run_id}")

    def runs_of_job(self, job_id: object) -> list[dict[str, Any]]:
        """Every flow run tagged ``job:<job_id>`` (50 at most)."""
        body = {"flow_runs": {"tags": {"all_": [f"job:{job_id}"]}}, "limit": 50}
        return list(self.call("POST", "/flow_runs/filter", body))


def client_env(
    root: Path,
    api_url: str,
    *,
    auth_string: str | None = None,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of a process that talks to the server at ``api_url`` (the prefect
    CLI, a worker, a flow run): this process's, with PREFECT_HOME (``root/prefect``) and
    FACEFLOW_HOME (``root/faceflow``) under ``root``, the API's URL and credential, no
    analytics, unbuffered output, then ``extra``."""
    return {
        **os.environ,
        "PREFECT_HOME": str(root / "prefect"),
        "PREFECT_API_URL": api_url,
        **({prefect_server.CLIENT_AUTH_VAR: auth_string} if auth_string else {}),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "FACEFLOW_HOME": str(root / "faceflow"),
        "PYTHONUNBUFFERED": "1",
        **(extra or {}),
    }


class PrefectServer:
    """``prefect server start`` on 127.0.0.1 under ``root`` (PREFECT_HOME ``root/prefect``,
    log ``root/server.log``), restartable on one port.

    ``env`` is the environment of its clients (``client_env`` with ``client_extra``); the
    server processes get it and ``server_env`` (its database, service settings...). ``services=False`` runs no background services (embedded layout only);
    ``layout="scale-out"`` needs a PostgreSQL database in ``server_env`` and Redis at
    ``redis_url`` (flushed at every start). With ``auth_string`` the API asks for it
    (HTTP basic auth), and ``env``, ``headers`` and ``rest`` carry it. ``api_workers``
    (scale-out only) API processes share the port, as ``--prefect-api-workers`` does."""

    def __init__(
        self,
        root: Path,
        *,
        client_extra: Mapping[str, str] | None = None,
        server_env: Mapping[str, str] | None = None,
        layout: PrefectMode = "embedded",
        services: bool = True,
        auth_string: str | None = None,
        redis_url: str = BENCH_REDIS_URL,
        api_workers: int = 1,
    ) -> None:
        self.root = root
        self.port = free_port()
        self.auth_string = auth_string
        self.headers = auth_headers(auth_string=auth_string)
        self.redis_url = redis_url
        self.env = client_env(root, self.api_url, auth_string=auth_string, extra=client_extra)
        self.server_env = {**self.env, **(server_env or {})}
        if auth_string:
            self.server_env[prefect_server.SERVER_AUTH_VAR] = auth_string
        self.services: Service | None = None
        if layout == "scale-out":
            database_url = self.server_env.get(DATABASE_VAR)
            if not database_url:
                raise ValueError(f"the scale-out layout needs a PostgreSQL {DATABASE_VAR}")
            self.server_env.update(prefect_server.scale_out_env(database_url, redis_url))
            self.services = Service(
                "prefect-services",
                prefect_server.services_argv(),
                log=root / "services.log",
                env=self.server_env,
            )
        argv = prefect_server.api_argv(self.port, layout, api_workers=api_workers)
        if not services and layout == "embedded":
            argv.append("--no-services")
        self.api = Service("prefect-server", argv, log=root / "server.log", env=self.server_env)

    @property
    def api_url(self) -> str:
        """The REST API's base URL (``…/api``)."""
        return f"http://127.0.0.1:{self.port}/api"

    @property
    def home(self) -> Path:
        """The FaceFlow home of its clients (FACEFLOW_HOME: blocks' storage)."""
        return self.root / "faceflow"

    @property
    def pids(self) -> tuple[int, ...]:
        """Every server process (for CPU figures: ``procstat`` takes several)."""
        return tuple(p.pid for p in (self.api, self.services) if p is not None and p.pid)

    @functools.cached_property
    def rest(self) -> PrefectRest:
        """A REST client of this server (with its credential)."""
        return PrefectRest(self.api_url, headers=self.headers)

    def healthy(self) -> bool:
        """Does the API answer ``/health`` now?"""
        return http_ok(f"{self.api_url}/health")()

    def start(self, timeout_s: float = 120.0) -> None:
        """Start the server (scale-out: migrations, then the services, then the API) and
        wait until the API is healthy; stopped again if it is not within ``timeout_s``."""
        if self.services is not None:
            import redis

            redis.Redis.from_url(self.redis_url).flushdb()
            subprocess.run(
                prefect_server.migrate_argv(PREFECT),
                env={**os.environ, **self.server_env},
                check=True,
                capture_output=True,
            )
            self.services.start()
        self.api.start()
        try:
            self.api.wait_ready(self.healthy, timeout_s)
        except BaseException:
            self.stop()
            raise

    def stop(self, grace: float = 10.0) -> None:
        """Stop the API processes, then the services (by PID)."""
        self.api.stop(grace=grace)
        if self.services is not None:
            self.services.stop(grace=grace)


@contextlib.contextmanager
def server_database(kind: Literal["sqlite", "postgresql"]) -> Iterator[dict[str, str]]:
    """Server environment for the Prefect server's database: its default SQLite file, or a
    fresh PostgreSQL database on 127.0.0.1:5432 (dropped afterwards), as in production."""
    if kind == "sqlite":
        yield {}
        return
    with postgres_database("prefect_bench") as url:
        asyncpg = make_url(url).set(drivername="postgresql+asyncpg")
        yield {DATABASE_VAR: asyncpg.render_as_string(hide_password=False)}


def start_server(
    root: Path,
    database_env: Mapping[str, str] | None = None,
    extra_env: Mapping[str, str] | None = None,
    count_requests: bool = False,
    layout: PrefectMode = "embedded",
) -> PrefectServer:
    """A started Prefect server as the benchmarks run it: the stack's service write
    batching (``prefect_server.SERVICE_WRITE_BATCHING``), no UI, the server logging at
    WARNING (INFO with ``count_requests``: its access log then counts the requests), then
    ``extra_env``. Embedded, or scale-out (needs ``database_env``'s PostgreSQL)."""
    server_env = {
        **(database_env or {}),
        "PREFECT_UI_ENABLED": "false",
        "PREFECT_SERVER_LOGGING_LEVEL": "INFO" if count_requests else "WARNING",
        **prefect_server.SERVICE_WRITE_BATCHING,
        **(extra_env or {}),
    }
    if layout == "scale-out" and not server_env.get(DATABASE_VAR):
        raise SystemExit("--server-layout scale-out needs --server-db postgresql")
    server = PrefectServer(root, server_env=server_env, layout=layout)
    server.start(timeout_s=180)
    return server
