"""End to end on the scale-out Prefect server: ``faceflow up --prefect scale-out``.

PostgreSQL (a database of its own, dropped after) and Redis (a database number of its own,
flushed after) on loopback; two API processes and the background services in a process
of their own. Jobs submitted over HTTP must end as on the embedded server, their flow runs
must be in PostgreSQL, and their events must have gone API → Redis → services →
PostgreSQL (the path that only works when Redis messaging is really in use). Skipped,
saying why, when PostgreSQL or Redis is unreachable.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psycopg
import pytest
import redis
from psycopg import sql

from faceflow.testing.databases import postgres_unavailable
from faceflow.testing.jobs import data_uri
from faceflow.testing.net import free_port
from faceflow.testing.wait import poll
from tests import samples
from tests.e2e.harness import (
    StackClient,
    create_user,
    pid_of,
    pids_with_home,
    prefect_client,
    start_stack,
    stop_stack,
    watch,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.postgres]

PG = {"host": "127.0.0.1", "port": 5432, "user": "postgres", "connect_timeout": 3}
REDIS_DB = 11  # out of the way of a developer's own Redis data in database 0


def _unavailable() -> str | None:
    if why := postgres_unavailable():
        return why
    try:
        redis.Redis(host="127.0.0.1", port=6379, socket_connect_timeout=3).ping()
    except redis.RedisError as exc:
        return f"Redis at 127.0.0.1:6379 is unreachable: {exc}"
    return None


def _drop_database(name: str) -> None:
    with psycopg.connect(dbname="postgres", autocommit=True, **PG) as conn:  # type: ignore[arg-type]
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


@dataclass
class ScaleOutStack(StackClient):
    home: Path
    api: str
    prefect_api: str
    api_key: str
    database: str
    redis: redis.Redis
    process: object

    def query(self, statement: str, *params: object) -> list[tuple[object, ...]]:
        with psycopg.connect(dbname=self.database, **PG) as conn:  # type: ignore[arg-type]
            return conn.execute(statement, params).fetchall()


@pytest.fixture(scope="module")
def scale_out(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ScaleOutStack]:
    why = _unavailable()
    if why:
        pytest.skip(why)
    home = tmp_path_factory.mktemp("scale-out") / "home"
    database = f"faceflow_prefect_{uuid.uuid4().hex[:10]}"
    broker = redis.Redis(host="127.0.0.1", port=6379, db=REDIS_DB)
    broker.flushdb()
    api_port, prefect_port = free_port(), free_port()
    env = {
        **os.environ,
        "FACEFLOW_HOME": str(home),
        "FACEFLOW_PREFECT_DATABASE_URL": f"postgresql+asyncpg://postgres@127.0.0.1:5432/{database}",
        "FACEFLOW_PREFECT_REDIS_URL": f"redis://127.0.0.1:6379/{REDIS_DB}",
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("PREFECT_API_URL", None)
    args = ["--api-port", str(api_port), "--prefect-port", str(prefect_port)]
    args += ["--prefect", "scale-out", "--prefect-api-workers", "2"]
    proc = start_stack(home, args, env)
    try:
        yield ScaleOutStack(
            home=home,
            api=f"http://127.0.0.1:{api_port}",
            prefect_api=f"http://127.0.0.1:{prefect_port}/api",
            api_key=create_user(env, "scale")["api key"],
            database=database,
            redis=broker,
            process=proc,
        )
    finally:
        stop_stack(proc)
        poll(lambda: not pids_with_home(home), 15, step_s=0.5)
        leftovers = pids_with_home(home)
        with contextlib.suppress(psycopg.Error):
            _drop_database(database)
        broker.flushdb()
        assert leftovers == [], f"processes left behind: {leftovers}"


def _children(pid: int) -> list[int]:
    tasks = Path(f"/proc/{pid}/task")
    found: list[int] = []
    for task in tasks.iterdir():
        with contextlib.suppress(OSError):
            found += [int(c) for c in (task / "children").read_text().split()]
    return found


def test_the_server_runs_as_api_processes_and_services_on_postgres(
    scale_out: ScaleOutStack,
) -> None:
    server = pid_of(scale_out.home, b"--no-services")
    assert len(_children(server)) >= 2, "two API worker processes under the server"
    assert pid_of(scale_out.home, b"services") > 0  # prefect server services start
    assert not list((scale_out.home / "prefect").glob("*.db")), "no SQLite server database"
    assert httpx.get(f"{scale_out.prefect_api}/health", timeout=10).json() is True
    # Every API process asks for the stack's credential (issue 22).
    for _ in range(4):  # the processes share one socket: a few requests reach both
        anonymous = httpx.post(f"{scale_out.prefect_api}/flow_runs/filter", json={}, timeout=10)
        assert anonymous.status_code == 401
    with prefect_client(scale_out.home, scale_out.prefect_api) as prefect:
        assert prefect.post("/flow_runs/filter", json={"limit": 1}).status_code == 200
    (version,) = scale_out.query("SELECT version_num FROM alembic_version")[0]
    assert version, "the migrations ran against the PostgreSQL database"
    log = (scale_out.home / "logs" / "prefect-server.log").read_text()
    assert "2 worker processes" in log


def test_jobs_run_and_their_events_travel_through_redis(scale_out: ScaleOutStack) -> None:
    body = {
        "source": data_uri(samples.astronaut_jpeg_bytes()),
        "target": data_uri(samples.grace_hopper_jpeg_bytes()),
    }
    with scale_out.client() as client:
        ids = []
        for _ in range(3):  # at once: the relay may batch them into one fuse-batch run
            response = client.post("/v1/jobs", json=body)
            assert response.status_code == 202, response.text
            ids.append(response.json()["id"])
        jobs = [watch(client, job_id, timeout=600)[0] for job_id in ids]
        assert [job["status"] for job in jobs] == ["succeeded"] * 3, jobs
        for job_id in ids:
            assert client.get(f"/v1/jobs/{job_id}/result").status_code == 200
    runs = scale_out.query(
        "SELECT id, state_type FROM flow_run WHERE tags ?| %s", [f"job:{i}" for i in ids]
    )
    assert runs and {state for _, state in runs} == {"COMPLETED"}, runs
    # Events: published by the API processes to Redis, consumed by the services process,
    # persisted to PostgreSQL. With in-memory messaging across processes none would arrive.
    run_resources = [f"prefect.flow-run.{run_id}" for run_id, _ in runs]
    query = "SELECT DISTINCT event FROM events WHERE resource_id = ANY(%s)"
    completed = ("prefect.flow-run.Completed",)
    poll(lambda: completed in scale_out.query(query, run_resources), 60, step_s=1)
    events = scale_out.query(query, run_resources)
    assert ("prefect.flow-run.Completed",) in events, events
    assert scale_out.redis.dbsize() > 0, "Prefect's streams and caches live in Redis"
    keys = {key.decode() for key in scale_out.redis.scan_iter(count=1000)}
    assert "events" in keys, sorted(keys)[:20]
