"""The stack under test: started in-process with ``faceflow.stack.Stack``, with handles.

``harness(...)`` starts the whole stack on free loopback ports under a fresh home (job store
on SQLite, or on a fresh PostgreSQL database that is dropped afterwards), with fault
injection enabled for the flows, creates the load's users, a webhook receiver and an API
client, and stops everything (by PID) on exit.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from faceflow.environ import patched_environ
from faceflow.faults.load import Client, User
from faceflow.faults.receiver import Receiver
from faceflow.stack import Stack, StackConfig
from faceflow.supervisor import Service
from faceflow.testing import databases
from faceflow.testing.net import free_port, wait_http
from flows.faults import ENABLE_VAR, FILE_VAR
from webapi.prefect_api import auth_headers
from webapi.storage import ObjectStore, open_store

Database = Literal["sqlite", "postgres"]
WORKER = "worker-0"


@contextmanager
def postgres_database(admin_url: str = databases.PG_ADMIN_URL) -> Iterator[str]:
    """A fresh database ``faceflow_faults_<pid>_<hex>``; dropped (forced) on exit, after
    this process's job-store engines are disposed."""
    from webapi.db import dispose_engines

    with databases.postgres_database(f"faceflow_faults_{os.getpid()}", admin_url) as url:
        try:
            yield url
        finally:
            dispose_engines()


def restart_postgres() -> float:
    """Restart this machine's PostgreSQL cluster; returns the seconds it took."""
    versions = sorted(os.listdir("/etc/postgresql"))
    started = time.monotonic()
    subprocess.run(
        ["pg_ctlcluster", "--skip-systemctl-redirect", versions[-1], "main", "restart"],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return time.monotonic() - started


@dataclass
class Harness:
    """A running stack with its users, receiver, client and result storage."""

    stack: Stack
    database: Database
    users: list[User]
    hang_user: User
    receiver: Receiver
    client: Client
    store: ObjectStore
    held: set[str] = field(default_factory=set)
    known_jobs: set[str] = field(default_factory=set)
    restarts: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def home(self) -> Path:
        return self.stack.config.home

    @property
    def prefect_api(self) -> str:
        return self.stack.config.prefect_api_url

    @property
    def prefect_headers(self) -> dict[str, str]:
        """The Prefect API's credential as a header (the stack's own server asks for it)."""
        return auth_headers(auth_string=self.stack.config.prefect_auth_string)

    @property
    def users_by_name(self) -> dict[str, User]:
        return {u.name: u for u in [*self.users, self.hang_user]}

    @property
    def secrets(self) -> dict[str, str]:
        return {u.name: u.webhook_secret for u in self.users_by_name.values()}

    def service(self, name: str) -> Service:
        return self.stack.supervisor.get(name)

    def wait_api(self, timeout_s: float = 120.0) -> float:
        return wait_http(f"{self.stack.config.api_url}/healthz", timeout_s)

    def wait_prefect(self, timeout_s: float = 120.0) -> float:
        return wait_http(f"{self.prefect_api}/health", timeout_s)

    def take_down(self, name: str, *, kill: bool = False) -> None:
        """SIGKILL (``kill``) or stop a service; the watchdog leaves it down until
        ``bring_up``."""
        with self._lock:
            self.held.add(name)
        service = self.service(name)
        if kill:
            service.kill()
        else:
            service.stop()

    def bring_up(self, name: str) -> None:
        """Start a service taken down with ``take_down``."""
        self.service(name).start()
        with self._lock:
            self.held.discard(name)

    def revive(self) -> None:
        """Start again every service that exited on its own (as a process supervisor
        would) and note it: a service should survive the faults it is not the target of."""
        for service in self.stack.supervisor.services:
            with self._lock:
                if service.name in self.held or service.alive():
                    continue
                code = service.process.returncode if service.process else None
                self.restarts.append(f"{service.name} exited by itself (code {code}); restarted")
                service.start()

    def take_restarts(self) -> list[str]:
        """Notes of the restarts since the last call."""
        with self._lock:
            notes, self.restarts = self.restarts, []
        return notes

    @contextmanager
    def watchdog(self, interval_s: float = 1.0) -> Iterator[None]:
        """Run ``revive`` in the background for the block."""
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(interval_s):
                self.revive()

        thread = threading.Thread(target=loop, daemon=True, name="fault-watchdog")
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    def set_fault_plan(self, plan: dict[str, Any]) -> None:
        """Write the plan that ``flows.faults`` reads at every stage."""
        path = self.home / "faults.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(plan))
        tmp.replace(path)


def _settings() -> Any:
    """The webapi settings as the stack's children read them (same environment)."""
    from webapi.config import Settings

    return Settings.model_validate({})


def _create_users(names: list[str], *, quota: int) -> list[User]:
    from sqlmodel import Session

    from webapi import crud
    from webapi.db import get_engine

    settings = _settings()
    engine = get_engine(settings.database_url)
    created = []
    with Session(engine) as session:
        for name in names:
            new = crud.create_user(
                session, name=name, quota=quota, pepper=settings.api_key_pepper.get_secret_value()
            )
            created.append(
                User(
                    name=name,
                    id=str(new.user.id),
                    api_key=new.api_key,
                    webhook_secret=new.webhook_secret,
                )
            )
    return created


@contextmanager
def harness(
    home: Path,
    *,
    users: int,
    quota: int = 10,
    database: Database = "sqlite",
    worker_type: str = "faceflow-gpu",
    progress: Any = None,
) -> Iterator[Harness]:
    """Start the stack (see the module docstring); stop it and clean up on exit."""
    with _database(database) as database_url:
        env = {
            "FACEFLOW_HOME": str(home.resolve()),
            "FACEFLOW_ALLOW_PRIVATE_URLS": "true",
            ENABLE_VAR: "true",
            FILE_VAR: str((home / "faults.json").resolve()),
            "FACEFLOW_WORKER_CHILDREN": "1",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        }
        remove: tuple[str, ...] = ("PREFECT_API_URL",)
        if database_url:
            env["FACEFLOW_DATABASE_URL"] = database_url
        else:
            remove += ("FACEFLOW_DATABASE_URL",)
        with patched_environ(env, remove=remove):
            config = StackConfig(
                home=home,
                api_port=free_port(),
                prefect_port=free_port(),
                worker_type=worker_type,
                external_prefect=None,
            )
            stack = Stack(config, progress=progress)
            receiver = Receiver()
            client: Client | None = None
            try:
                stack.start()
                names = [f"load-{i}" for i in range(users)] + ["hang"]
                made = _create_users([f"{n}-{uuid.uuid4().hex[:6]}" for n in names], quota=quota)
                client = Client(config.api_url, made)
                yield Harness(
                    stack=stack,
                    database=database,
                    users=made[:-1],
                    hang_user=made[-1],
                    receiver=receiver,
                    client=client,
                    store=open_store(_settings().storage_url),
                )
            finally:
                if client is not None:
                    client.close()
                receiver.close()
                stack.stop()


@contextmanager
def _database(database: Database) -> Iterator[str | None]:
    if database == "sqlite":
        yield None
        return
    with postgres_database() as url:
        yield url
