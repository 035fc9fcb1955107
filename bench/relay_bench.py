"""Jobs through the whole service, as a client sees them: webapi (with its relay) → Prefect →
warm ``faceflow-gpu`` worker → result, for ``bench/warm_worker.py``'s relay modes.

One mode = one webapi process (uvicorn, relay in-process, its own SQLite job store) with
``FACEFLOW_BATCH_MAX_JOBS`` set: 1 is today's one ``fuse-faces`` run per job, more is
micro-batching. The Prefect server, the pool with both job deployments and the warm
worker are shared by the modes of one bench run. Per mode, after one untimed job:

- sequential: ``jobs`` submits one after another, each waiting for its job to end
  (``Prefer: wait``): median dispatch (job created → its run's ``start_time``) and median
  end-to-end (job created → ``finished_at``, what a polling client sees);
- burst: ``jobs`` submits at once (8 client threads): throughput (first created → last
  finished), how many runs carried them, CPU per job of each component (server, worker
  with children, webapi with relay, PostgreSQL, machine) and Prefect API requests per job.

Every job must succeed; the figures say how many did not.
"""

from __future__ import annotations

import base64
import json
import statistics
import time
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa

from faceflow.supervisor import Service
from faceflow.testing.procstat import CpuMeter, wait_until_quiet

REPO = Path(__file__).resolve().parents[1]
TERMINAL = frozenset({"succeeded", "failed", "expired", "cancelled"})
SUBMIT_THREADS = 8


@dataclass(frozen=True)
class Client:
    """A bench user's view of one webapi: its URL, API key and the request body."""

    url: str
    api_key: str
    body: bytes

    def submit(self, http: httpx.Client, wait_s: int = 0) -> str:
        headers = {"Authorization": f"Bearer {self.api_key}", "Content-Type": "application/json"}
        if wait_s:
            headers["Prefer"] = f"wait={wait_s}"
        response = http.post(f"{self.url}/v1/jobs", content=self.body, headers=headers)
        if response.status_code not in (200, 202):
            raise RuntimeError(f"submit answered {response.status_code}: {response.text[:300]}")
        return str(response.json()["id"])


def request_body(source: bytes, target: bytes) -> bytes:
    """A JSON submit with both photos as data: URIs and generous deadlines (the bench
    measures throughput, not admission)."""
    as_uri = lambda data: "data:image/jpeg;base64," + base64.b64encode(data).decode()  # noqa: E731
    return json.dumps(
        {
            "source": as_uri(source),
            "target": as_uri(target),
            "deadline_seconds": 3600,
            "queue_timeout_seconds": 1800,
        }
    ).encode()


def make_user(database_url: str, pepper: str) -> str:
    """A bench user with room for every job (quota 100000); its API key."""
    from sqlmodel import Session

    from webapi import crud
    from webapi.db import get_engine

    with Session(get_engine(database_url)) as session:
        return crud.create_user(
            session, name=f"bench-{uuid.uuid4().hex[:6]}", quota=100_000, pepper=pepper
        ).api_key


@contextmanager
def webapi(
    home: Path,
    name: str,
    port: int,
    env: dict[str, str],
    storage: Path,
    prefect_url: str,
    batch_max_jobs: int,
) -> Iterator[tuple[Service, str, str]]:
    """A webapi process with its relay on a fresh SQLite job store; (service, url, db url)."""
    from faceflow.stack import StackConfig, webapi_argv
    from webapi.migrations import upgrade

    database_url = f"sqlite:///{home / f'jobs-{name}.db'}"
    upgrade(database_url)
    api_env = {
        **env,
        "FACEFLOW_HOME": str(storage.parent),
        "FACEFLOW_DATABASE_URL": database_url,
        "FACEFLOW_STORAGE_URL": storage.as_uri(),
        "FACEFLOW_PREFECT_API_URL": prefect_url,
        "FACEFLOW_BATCH_MAX_JOBS": str(batch_max_jobs),
        "FACEFLOW_WORKER_SLOTS": "1",
        "FACEFLOW_MAX_QUEUE_TIMEOUT_SECONDS": "3600",
    }
    cfg = StackConfig(home=home, api_port=port)
    service = Service(
        f"webapi-{name}", webapi_argv(cfg), log=home / f"webapi-{name}.log", env=api_env
    )
    service.start()
    url = f"http://127.0.0.1:{port}"
    try:
        service.wait_ready(lambda: httpx.get(f"{url}/readyz", timeout=2).status_code == 200, 120)
        yield service, url, database_url
    finally:
        service.stop(grace=15)


def read_jobs(database_url: str, ids: list[str]) -> list[dict[str, Any]]:
    """The jobs' rows (status, times, run) from the job store."""
    from webapi.db import get_engine

    wanted = [uuid.UUID(i).hex for i in ids]
    query = sa.text(
        "SELECT id, status, error_code, created_at, finished_at, flow_run_id, timings FROM jobs"
    )
    with get_engine(database_url).connect() as connection:
        rows = [dict(row._mapping) for row in connection.execute(query)]
    by_id = {uuid.UUID(str(row["id"])).hex: row for row in rows}
    return [by_id[i] for i in wanted if i in by_id]


def wait_terminal(database_url: str, ids: list[str], timeout_s: float) -> list[dict[str, Any]]:
    end = time.monotonic() + timeout_s
    while True:
        rows = read_jobs(database_url, ids)
        if len(rows) == len(ids) and all(row["status"] in TERMINAL for row in rows):
            return rows
        if time.monotonic() > end:
            raise TimeoutError(f"jobs not terminal after {timeout_s} s")
        time.sleep(0.25)


def utc_seconds(value: Any) -> float:
    """Seconds since the epoch of a timestamp from the job store (naive UTC, as a datetime
    or a string) or from Prefect (ISO 8601 with a zone)."""
    if not isinstance(value, datetime):
        value = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    return (value if value.tzinfo else value.replace(tzinfo=UTC)).timestamp()


def run_times(api: Any, run_ids: set[str]) -> dict[str, tuple[float, float | None]]:
    """``start_time`` and ``end_time`` of each flow run that started (one call per 200)."""
    wanted = sorted(run_ids)
    times: dict[str, tuple[float, float | None]] = {}
    for start in range(0, len(wanted), 200):
        chunk = wanted[start : start + 200]
        body = {"flow_runs": {"id": {"any_": chunk}}, "limit": len(chunk)}
        for run in api.call("POST", "/flow_runs/filter", body):
            if run.get("start_time"):
                end = utc_seconds(run["end_time"]) if run.get("end_time") else None
                times[str(run["id"])] = (utc_seconds(run["start_time"]), end)
    return times


def burst_timeline(api: Any, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs that carried a burst, by start: jobs, and when (seconds after the first job
    was created) the run was created, started and ended."""
    members: dict[str, int] = {}
    for row in rows:
        if (rid := _run_id(row)) is not None:
            members[rid] = members.get(rid, 0) + 1
    origin = min(utc_seconds(row["created_at"]) for row in rows)
    body = {"flow_runs": {"id": {"any_": sorted(members)}}, "limit": len(members)}
    timeline = []
    for run in api.call("POST", "/flow_runs/filter", body):
        times = {k: run.get(k) for k in ("created", "start_time", "end_time")}
        timeline.append(
            {
                "jobs": members[str(run["id"])],
                **{k: round(utc_seconds(v) - origin, 2) if v else None for k, v in times.items()},
            }
        )
    return sorted(timeline, key=lambda r: (r["start_time"] is None, r["start_time"] or 0.0))


def _run_id(row: dict[str, Any]) -> str | None:
    value = row["flow_run_id"]
    return None if value is None else str(uuid.UUID(str(value)))


def latencies(api: Any, rows: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per succeeded job: dispatch (created → run start), end-to-end (created → finished),
    and the parts after dispatch: the run (start → end) and the relay's notice (run end →
    the job's ``finished_at``)."""
    times = run_times(api, {rid for row in rows if (rid := _run_id(row))})
    out: dict[str, list[float]] = {"dispatch": [], "e2e": [], "run": [], "notice": []}
    for row in rows:
        if row["status"] != "succeeded":
            continue
        created, finished = utc_seconds(row["created_at"]), utc_seconds(row["finished_at"])
        out["e2e"].append(finished - created)
        start, end = times.get(_run_id(row) or "", (None, None))
        if start is not None:
            out["dispatch"].append(start - created)
        if start is not None and end is not None:
            out["run"].append(end - start)
            out["notice"].append(finished - end)
    return out


def relay_mode(
    name: str,
    *,
    batch_max_jobs: int,
    api: Any,
    pids: dict[str, int | Sequence[int] | None],
    env: dict[str, str],
    home: Path,
    storage: Path,
    prefect_url: str,
    body: bytes,
    jobs: int,
    port: int,
    server_log: Path | None,
    apart_s: float = 0.0,
) -> dict[str, Any]:
    """One relay mode: sequential and burst jobs through a fresh webapi. Each sequential
    job is submitted ``apart_s`` after the previous one finished (0: at once, while the
    Prefect server still works off the previous run's end: its artifacts, events, logs)."""
    from bench.fuse_jobs import requests_per_job

    with webapi(home, name, port, env, storage, prefect_url, batch_max_jobs) as (
        service,
        url,
        database_url,
    ):
        pepper = env.get("FACEFLOW_API_KEY_PEPPER", "faceflow-development-pepper")
        client = Client(url, make_user(database_url, pepper), body)
        with httpx.Client(timeout=120) as http:
            warm = client.submit(http, wait_s=60)  # untimed: first block loads, first run
            wait_terminal(database_url, [warm], 300)
            sequential = []
            for _ in range(jobs):
                sequential.append(client.submit(http, wait_s=60))
                wait_terminal(database_url, sequential[-1:], 300)
                time.sleep(apart_s)
        # The sequential runs' events are worked off first: else the server spends the
        # burst's first seconds on them, and its CPU per job counts them.
        quiet_s = wait_until_quiet(pids.get("server"))
        log_start = server_log.stat().st_size if server_log and server_log.exists() else 0
        meter = CpuMeter({**pids, "webapi": service.pid})
        with ThreadPoolExecutor(SUBMIT_THREADS) as pool, httpx.Client(timeout=120) as http:
            burst = list(pool.map(lambda _: client.submit(http), range(jobs)))
        burst_rows = wait_terminal(database_url, burst, 1800)
        cpu = meter.per_job_ms(jobs)
        requests = (
            requests_per_job(server_log, log_start, jobs)
            if server_log and server_log.exists()
            else {}
        )
        sequential_rows = read_jobs(database_url, sequential)
    seq = latencies(api, sequential_rows)
    created = [utc_seconds(r["created_at"]) for r in burst_rows]
    finished = [utc_seconds(r["finished_at"]) for r in burst_rows if r["finished_at"]]
    runs = {_run_id(r) for r in burst_rows}
    not_ok = [
        f"{r['status']}:{r['error_code']}"
        for r in [*sequential_rows, *burst_rows]
        if r["status"] != "succeeded"
    ]
    return {
        "batch_max_jobs": batch_max_jobs,
        "failed": not_ok,
        "dispatch_median_s": statistics.median(seq["dispatch"]) if seq["dispatch"] else None,
        "dispatch_p90_s": p90(seq["dispatch"]),
        "e2e_median_s": statistics.median(seq["e2e"]) if seq["e2e"] else None,
        "e2e_p90_s": p90(seq["e2e"]),
        "run_median_s": statistics.median(seq["run"]) if seq["run"] else None,
        "notice_median_s": statistics.median(seq["notice"]) if seq["notice"] else None,
        "burst_jobs_per_min": jobs / (max(finished) - min(created)) * 60.0,
        "burst_runs": len(runs),
        "burst_jobs_per_run": round(jobs / max(1, len(runs)), 1),
        "burst_timeline": burst_timeline(api, burst_rows),
        "burst_last_created_s": round(max(created) - min(created), 2),
        "burst_quiet_wait_s": round(quiet_s, 1),
        "burst_cpu_ms_per_job": cpu,
        "burst_requests_per_job": requests,
    }


def p90(values: list[float]) -> float | None:
    """The 90th percentile of ``values`` (None when there are fewer than two)."""
    return statistics.quantiles(values, n=10)[-1] if len(values) >= 2 else None
