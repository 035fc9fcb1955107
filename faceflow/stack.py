"""``faceflow up``: the whole service on one machine, with embedded defaults.

Prefect server (SQLite under the home, unless ``PREFECT_API_URL`` names one; or with
``--prefect scale-out`` PostgreSQL + Redis, API processes and services apart) → work pool
from ``work_pools/gpu-process.json`` and its priority work queue → blocks → ``prefect
--no-prompt deploy --all`` → worker(s) → job-store migrations → webapi with its relay.
The Prefect API asks for a credential that the stack makes at its first start
(``<home>/prefect-api-auth``, mode 0600) and gives to every child. Every child runs in its
own process group with a log under ``<home>/logs/`` and is stopped by PID. While it runs, a part that exits is started again (and said so on the console);
each start is counted under ``<home>/services/`` for the API's ``/metrics``.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import httpx

from faceflow import prefect_server
from faceflow.prefect_server import PrefectMode
from faceflow.supervisor import Service, ServiceFailed, Supervisor
from flows.binding import SIGNING_KEY_ENV
from webapi import services

REPO_ROOT = Path(__file__).resolve().parents[1]
POOL_NAME = "gpu"
CONTROL_POOL = "control"
PRIORITY_QUEUE = os.environ.get("FACEFLOW_PRIORITY_WORK_QUEUE", "priority")
VIDEO_QUEUE = "video"
VIDEO_COORDINATORS = 4
"""Video jobs coordinated at once (``fuse-video`` runs on the control pool's ``video``
queue); the control worker's limit leaves room for reconcile and retention beside them."""
CONTROL_LIMIT = VIDEO_COORDINATORS + 2
POOL_TEMPLATES = {"process": "gpu-process.json", "faceflow-gpu": "faceflow-gpu.json"}
"""Base job template of the ``gpu`` pool for each supported worker type."""


@dataclass
class StackConfig:
    """Where the stack lives and listens."""

    home: Path = field(default_factory=lambda: Path(os.environ.get("FACEFLOW_HOME", ".faceflow")))
    api_host: str = "127.0.0.1"
    api_port: int = 8000
    prefect_port: int = 4200
    workers: int = 1
    worker_type: str = "faceflow-gpu"
    external_prefect: str | None = field(default_factory=lambda: os.environ.get("PREFECT_API_URL"))
    ready_timeout: float = 120.0
    prefect_mode: PrefectMode = "embedded"
    """embedded: one server process on SQLite; scale-out: PostgreSQL + Redis, API processes
    and background services apart (``faceflow.prefect_server``)."""
    prefect_api_workers: int = 2
    """API processes of the scale-out server."""
    prefect_database_url: str = field(
        default_factory=lambda: os.environ.get(
            "FACEFLOW_PREFECT_DATABASE_URL", prefect_server.DEFAULT_DATABASE_URL
        )
    )
    prefect_redis_url: str = field(
        default_factory=lambda: os.environ.get(
            "FACEFLOW_PREFECT_REDIS_URL", prefect_server.DEFAULT_REDIS_URL
        )
    )
    prefect_auth_string: str | None = field(
        default_factory=lambda: os.environ.get(prefect_server.CLIENT_AUTH_VAR), repr=False
    )
    """The Prefect API's credential: the environment's for an existing server; for the
    stack's own, the one in ``prefect_auth_file`` (set by ``Stack.start``)."""

    def __post_init__(self) -> None:
        self.home = self.home.resolve()

    @property
    def prefect_api_url(self) -> str:
        return self.external_prefect or f"http://127.0.0.1:{self.prefect_port}/api"

    @property
    def prefect_ui_url(self) -> str:
        return self.prefect_api_url.removesuffix("/api")

    @property
    def api_url(self) -> str:
        return f"http://{self.api_host}:{self.api_port}"

    @property
    def logs(self) -> Path:
        return self.home / "logs"

    @property
    def services(self) -> Path:
        """Start records of the parts (``webapi.services``; the API's default too)."""
        return self.home / "services"

    @property
    def prefect_auth_file(self) -> Path:
        """Where the stack keeps its Prefect server's credential (mode 0600)."""
        return self.home / prefect_server.AUTH_FILE

    def server_env(self) -> dict[str, str]:
        """Environment of the Prefect server's own processes: the credential it asks for,
        the services' write batching, and when scaled out, the shared database and Redis."""
        env = prefect_server.services_env()
        if self.prefect_auth_string:
            env[prefect_server.SERVER_AUTH_VAR] = self.prefect_auth_string
        if self.prefect_mode == "scale-out":
            env.update(
                prefect_server.scale_out_env(self.prefect_database_url, self.prefect_redis_url)
            )
        return env

    def run_signing_env(self) -> dict[str, str]:
        """The run-signing key (``flows.binding``) of the parts that sign or check flow runs:
        the webapi's relay, the control worker (reconcile) and the GPU workers, not the
        Prefect server. ``FACEFLOW_RUN_SIGNING_KEY`` when set, else the home's own."""
        key = os.environ.get(SIGNING_KEY_ENV) or home_secret(self.home / "run-signing.key")
        return {SIGNING_KEY_ENV: key}

    def env(self) -> dict[str, str]:
        """Environment shared by every child process (with the Prefect API's credential:
        every child is a Prefect client, the relay included)."""
        auth = self.prefect_auth_string
        return {
            **({prefect_server.CLIENT_AUTH_VAR: auth} if auth else {}),
            "FACEFLOW_HOME": str(self.home),
            "FACEFLOW_PREFECT_API_URL": self.prefect_api_url,
            "PREFECT_API_URL": self.prefect_api_url,
            "PREFECT_HOME": str(self.home / "prefect"),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_WORKER_QUERY_SECONDS": "1",
            "PREFECT_WORKER_PREFETCH_SECONDS": "1",
            "FACEFLOW_WORKER_SLOTS": str(self.workers),
            "PYTHONUNBUFFERED": "1",
        }


def home_secret(path: Path) -> str:
    """A random secret kept in ``path`` (made on first use, mode 0600, never rewritten)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_text().strip()
    with os.fdopen(fd, "w") as out:
        out.write(secrets.token_urlsafe(32))
    return path.read_text().strip()


def _bin(name: str) -> str:
    """An executable of this interpreter's environment (``.venv/bin/NAME``)."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else (shutil.which(name) or name)


def _http_ok(url: str) -> Callable[[], bool]:
    def check() -> bool:
        return httpx.get(url, timeout=2.0).status_code == 200

    return check


def webapi_argv(cfg: StackConfig) -> list[str]:
    """The webapi's command line: uvicorn with the app factory, which logs JSON lines at
    INFO (``webapi.main.create_app``), and the options of every launcher
    (``webapi.serving``: header deadline, keep-alive, no uvicorn access log: the app logs
    requests with their request id)."""
    from webapi.serving import UVICORN_OPTIONS

    return [
        _bin("uvicorn"),
        "--factory",
        "webapi.main:create_app",
        "--host",
        cfg.api_host,
        "--port",
        str(cfg.api_port),
        *UVICORN_OPTIONS,
    ]


Progress = Callable[[str], None]


class Stack:
    """The running stack; use as a context manager or call ``start()``/``stop()``."""

    def __init__(self, config: StackConfig, progress: Progress | None = None) -> None:
        self.config = config
        self.supervisor = Supervisor(records=config.services)
        self.progress = progress or (lambda message: print(message, flush=True))

    def _run_step(self, name: str, argv: list[str], env: Mapping[str, str] | None = None) -> None:
        """A one-shot setup command; ``ServiceFailed`` with its log on a non-zero exit."""
        log = self.config.logs / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("ab") as out:
            proc = subprocess.run(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.config.env(), **(env or {})},
                cwd=REPO_ROOT,
                timeout=300,
                check=False,
            )
        if proc.returncode != 0:
            raise ServiceFailed(name, f"failed with exit code {proc.returncode}", log)

    def _service(
        self, name: str, argv: list[str], extra: Mapping[str, str] | None = None
    ) -> Service:
        return Service(
            name=name,
            argv=argv,
            log=self.config.logs / f"{name}.log",
            env={**self.config.env(), **(extra or {})},
            cwd=REPO_ROOT,
        )

    def start(self) -> None:
        """Start every part, waiting for each to be ready."""
        cfg = self.config
        cfg.home.mkdir(parents=True, exist_ok=True)
        cfg.services.mkdir(parents=True, exist_ok=True)
        services.reset(cfg.services)
        prefect = _bin("prefect")
        faceflow = _bin("faceflow")
        if cfg.external_prefect:
            auth = "with" if cfg.prefect_auth_string else "without"
            self.progress(
                f"prefect: using existing server {cfg.prefect_api_url} "
                f"({auth} {prefect_server.CLIENT_AUTH_VAR})"
            )
        else:
            self.prefect_credential()
            self._start_prefect_server(prefect)
        self.progress("prefect: work pool, blocks, deployments")
        template = REPO_ROOT / "work_pools" / POOL_TEMPLATES[cfg.worker_type]
        self._run_step(
            "work-pool",
            [
                prefect,
                "work-pool",
                "create",
                POOL_NAME,
                "--type",
                cfg.worker_type,
                "--base-job-template",
                str(template),
                "--overwrite",
            ],
        )
        self._run_step(
            "work-pool-limit",
            [prefect, "work-pool", "set-concurrency-limit", POOL_NAME, str(cfg.workers)],
        )
        self._priority_queue()
        self._run_step(
            "control-pool",
            [prefect, "work-pool", "create", CONTROL_POOL, "--type", "process", "--overwrite"],
        )
        from tasks.provenance import dev_root_path  # c2pa and cv2: only when starting

        first_chain = not dev_root_path(cfg.home).is_file()
        self._run_step("blocks", [faceflow, "blocks", "init"])
        if first_chain:
            self.progress(
                f"c2pa: created a development signing chain in {dev_root_path(cfg.home).parent} "
                "(results are signed with it; no C2PA reader trusts its root: production "
                "needs a real certificate, docs/provenance.md)"
            )
        self._run_step("deploy", [prefect, "--no-prompt", "deploy", "--all"])
        self._video_queue()
        self.progress("job store: migrations")
        self._run_step("db-upgrade", [faceflow, "db", "upgrade"])
        for index in range(cfg.workers):
            name = f"worker-{index}"
            self.progress(f"worker: starting {name} on pool {POOL_NAME!r}")
            self.supervisor.start(
                self._service(
                    name,
                    [
                        prefect,
                        "worker",
                        "start",
                        "--pool",
                        POOL_NAME,
                        "--type",
                        cfg.worker_type,
                        "--name",
                        f"local-{name}",
                        "--limit",
                        "1",
                    ],
                    {
                        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", str(index)),
                        **cfg.run_signing_env(),
                    },
                )
            )
        self.progress(
            f"worker: starting the control worker (reconcile schedule) on {CONTROL_POOL!r}"
        )
        self.supervisor.start(
            self._service(
                "worker-control",
                [
                    prefect,
                    "worker",
                    "start",
                    "--pool",
                    CONTROL_POOL,
                    "--type",
                    "process",
                    "--name",
                    "local-control",
                    "--limit",
                    str(CONTROL_LIMIT),
                ],
                cfg.run_signing_env(),
            )
        )
        self.progress(f"webapi: starting on {cfg.api_url}")
        api = self.supervisor.start(
            self._service("webapi", webapi_argv(cfg), cfg.run_signing_env())
        )
        api.wait_ready(_http_ok(f"{cfg.api_url}/readyz"), cfg.ready_timeout)
        self.supervisor.check_alive()
        self.progress(f"ready: API {cfg.api_url}/docs  Prefect UI {cfg.prefect_ui_url}")

    def prefect_credential(self) -> Path:
        """The credential the stack's own Prefect server asks for, from its home (made at
        the first start, reused after): set on the config, and where it is said (never what
        it is); returns the file."""
        cfg = self.config
        log = cfg.logs / "prefect-auth.log"
        try:
            cfg.prefect_auth_string = prefect_server.ensure_auth_string(cfg.prefect_auth_file)
        except (OSError, prefect_server.AuthFileError) as exc:
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_text(f"{exc}\n")
            raise ServiceFailed("prefect-auth", f"credential unusable: {exc}", log) from exc
        self.progress(
            f"prefect: API and UI ask for the credential in {cfg.prefect_auth_file} "
            "(user:password, mode 0600; the UI's login takes the whole line)"
        )
        return cfg.prefect_auth_file

    def _start_prefect_server(self, prefect: str) -> None:
        """The Prefect server in the configured mode, waited for until healthy."""
        cfg = self.config
        server_env = cfg.server_env()
        if cfg.prefect_mode == "scale-out":
            self.progress(
                f"prefect: scale-out server on 127.0.0.1:{cfg.prefect_port}: "
                f"{cfg.prefect_api_workers} API processes, services apart, "
                f"PostgreSQL {prefect_server.redacted(cfg.prefect_database_url)}, "
                f"Redis {prefect_server.redacted(cfg.prefect_redis_url)}"
            )
            try:
                prefect_server.ensure_database(cfg.prefect_database_url)
            except Exception as exc:
                log = cfg.logs / "prefect-database.log"
                log.parent.mkdir(parents=True, exist_ok=True)
                log.write_text(f"{exc}\n")
                raise ServiceFailed("prefect-database", f"is not reachable: {exc}", log) from exc
            self._run_step("prefect-migrate", prefect_server.migrate_argv(prefect), server_env)
            self.supervisor.start(
                self._service("prefect-services", prefect_server.services_argv(), server_env)
            )
        else:
            self.progress(f"prefect: starting server on 127.0.0.1:{cfg.prefect_port}")
        argv = prefect_server.api_argv(cfg.prefect_port, cfg.prefect_mode, cfg.prefect_api_workers)
        server = self.supervisor.start(self._service("prefect-server", argv, server_env))
        server.wait_ready(_http_ok(f"{cfg.prefect_api_url}/health"), cfg.ready_timeout)

    def _priority_queue(self) -> None:
        """The priority lane: a work queue of the GPU pool that workers take first."""
        from webapi.prefect_api import PrefectAPI, PrefectError

        log = self.config.logs / "work-queue.log"
        try:
            with PrefectAPI(
                self.config.prefect_api_url, auth_string=self.config.prefect_auth_string
            ) as api:
                api.ensure_work_queue(POOL_NAME, PRIORITY_QUEUE, priority=1)
        except PrefectError as exc:
            log.write_text(f"{exc}\n")
            raise ServiceFailed("work-queue", f"could not be created: {exc}", log) from exc

    def _video_queue(self) -> None:
        """The control pool's ``video`` queue (made by ``prefect deploy``), limited to
        ``VIDEO_COORDINATORS`` runs at once."""
        from webapi.prefect_api import PrefectAPI, PrefectError

        log = self.config.logs / "work-queue.log"
        try:
            with PrefectAPI(
                self.config.prefect_api_url, auth_string=self.config.prefect_auth_string
            ) as api:
                api.limit_work_queue(CONTROL_POOL, VIDEO_QUEUE, VIDEO_COORDINATORS)
        except PrefectError as exc:
            log.write_text(f"{exc}\n")
            raise ServiceFailed("work-queue", f"could not be limited: {exc}", log) from exc

    def stop(self) -> None:
        """Stop every child by PID, workers first."""
        self.supervisor.stop_all()

    def __enter__(self) -> Stack:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_forever(stack: Stack, poll_s: float = 0.5) -> None:
    """Watch the children until SIGINT/SIGTERM, restarting any that exits (and saying so);
    then stop all, grandchildren included (this process adopts the orphans of its
    children: ``Supervisor.adopt_orphans``). One that keeps exiting ends the stack
    (``Supervisor.restart_exited``)."""
    stopping = False
    stack.supervisor.adopt_orphans()

    def _stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        while not stopping:
            for restarted in stack.supervisor.restart_exited():
                stack.progress(
                    f"restarted {restarted.name}: it had {restarted.reason} "
                    f"(restart {restarted.restarts}; log {stack.config.logs / restarted.name}.log)"
                )
            stack.supervisor.reap_orphans()
            time.sleep(poll_s)
    finally:
        stack.progress("stopping the stack")
        stack.stop()


def create_user(stack: Stack, name: str) -> tuple[str, str]:
    """Create an API user through ``faceflow users create``; returns (api key, webhook secret)."""
    log = stack.config.logs / "users.log"
    proc = subprocess.run(
        [_bin("faceflow"), "users", "create", name],
        capture_output=True,
        text=True,
        env={**os.environ, **stack.config.env()},
        cwd=REPO_ROOT,
        timeout=120,
        check=False,
    )
    if proc.returncode != 0:
        log.write_text(proc.stdout + proc.stderr)
        raise ServiceFailed("users create", f"failed with exit code {proc.returncode}", log)
    fields = dict(line.split(":", 1) for line in proc.stdout.splitlines() if ":" in line)
    return fields["api key"].strip(), fields["webhook secret"].strip()


def run_demo(stack: Stack) -> Path:
    """Create a demo user, submit astronaut → grace_hopper over HTTP, wait, save the result."""
    from faceflow import samples
    from faceflow.client import FaceFlowClient, wait_with_progress

    api_key, _secret = create_user(stack, f"demo-{int(time.time())}")
    out = stack.config.home / "demo" / "astronaut_on_grace_hopper.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    with FaceFlowClient(stack.config.api_url, api_key) as client:
        job = client.submit(samples.astronaut_jpeg_bytes(), samples.grace_hopper_path())
        stack.progress(f"demo: submitted job {job['id']}")
        job = wait_with_progress(client, job["id"], timeout=300)
        if job["status"] != "succeeded":
            error = job.get("error") or {}
            raise ServiceFailed(
                "demo job",
                f"ended {job['status']} ({error.get('code')}: {error.get('message')})",
                stack.config.logs / "webapi.log",
            )
        out.write_bytes(client.result(job["id"]))
    stack.progress(f"demo: result written to {out}")
    stack.progress(f"demo: API docs {stack.config.api_url}/docs")
    stack.progress(f"demo: Prefect UI {stack.config.prefect_ui_url}/runs")
    stack.progress(f"demo: try  FACEFLOW_API_KEY={api_key} faceflow status {job['id']}")
    return out
