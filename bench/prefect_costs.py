"""What Prefect itself costs per flow run and per job, and which settings change it.

The job flows run here back to back through ``prefect.flow_engine.run_flow`` in this
process (as a warm child runs them: heartbeats off), on runs created over REST against a
Prefect server on PostgreSQL, with GPU-shaped compute of 0 ms (``bench/gpu_shaped.py``:
every compute stage returns the real output it computed once), so what is measured is the
orchestration: states, task runs, artifacts, events, logs, block reads, storage I/O. Per
configuration it reports, per run and per job: wall time, CPU of this process (the
"worker side"), of the Prefect server and of PostgreSQL, and Prefect API requests.

Configurations (each on a fresh server, the server's settings need a restart):

- ``fuse-faces`` (one job per run) and ``fuse-batch`` of ``--batch`` jobs, as shipped (the
  server's task-run recorder and event persister write in batches:
  ``faceflow.prefect_server.SERVICE_WRITE_BATCHING``);
- ``unbatched-writes``: those two services with Prefect's own defaults (the recorder one
  task run per insert, the persister 20 events or every 5 s);
- ``logs-off``: ``PREFECT_LOGGING_TO_API_ENABLED=false`` in the flow's process (the run's
  logs stay in the worker's log; the UI's log tab is empty);
- ``events-off``: server ``PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED=false`` and
  ``PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED=false`` (no automations, no event feed);
- ``recorder-off``: also ``PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_ENABLED=false`` (task
  runs are no longer recorded: the UI loses the per-stage view; shown for the figure only).

And a probe flow with 0 and 10 no-op tasks gives the cost of one task run.

    .venv/bin/python bench/prefect_costs.py --runs 20 --batch 16

``--gpu-ms 30`` makes the compute GPU-shaped instead (a batch's stage timings, logged by
its run, then show how its CPU work overlaps the model stages); ``--runs-of fuse-batch``
and ``--servers shipped`` narrow it to one kind of run and one server.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.fuse_jobs import job_parameters, pool_template, prepare_inputs, requests_per_job  # noqa: E402
from faceflow.testing.prefect import PrefectRest, server_database, start_server  # noqa: E402
from faceflow.testing.procstat import (  # noqa: E402
    postgres_cpu_s,
    process_tree_cpu_s,
    wait_until_quiet,
)

SERVER_VARIANTS: dict[str, dict[str, str]] = {
    "shipped": {},
    "events-off": {
        "PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED": "false",
        "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED": "false",
    },
    "unbatched-writes": {  # Prefect's own defaults, which FaceFlow's stack changes
        "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "1",
        "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL": "5",
        "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_BATCH_SIZE": "20",
        "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_FLUSH_INTERVAL": "5",
    },
    "recorder-off": {
        "PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED": "false",
        "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED": "false",
        "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_ENABLED": "false",
    },
}


SETTLE_S = 5.5
"""Wait after the last run: longer than the longest flush interval of the services."""


def probe_flow() -> Any:
    """A flow of ``tasks`` no-op task runs (the cost of a task run, by difference)."""
    from prefect import flow, task
    from prefect.cache_policies import NO_CACHE

    @task(persist_result=False, cache_policy=NO_CACHE)
    def noop() -> None:
        return None

    @flow(name="cost-probe", persist_result=False)
    def cost_probe(tasks: int) -> None:
        for _ in range(tasks):
            noop()

    return cost_probe


Maker = Callable[[], tuple[str, dict[str, Any], str, int]]
"""Makes one run: (deployment id, parameters, flow key, jobs per run)."""


def _job(keys: tuple[str, str]) -> dict[str, Any]:
    return job_parameters(*keys, attempt=1)


def drain_client_queues() -> None:
    """Send what this process still queues for the server (events, logs): the runs' events
    are counted against the server that ran them, not the next configuration's (a backlog
    of thousands of events was seen crossing over otherwise, and hanging the exit)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=120)
    EventsWorker.drain_all(timeout=120)


def measure(
    api: PrefectRest,
    url: str,
    server_pid: int | Sequence[int] | None,
    server_log: Path,
    make: Maker,
    flows: dict[str, Any],
    runs: int,
    logs_to_api: bool,
) -> dict[str, float]:
    """``runs`` runs made by ``make`` (deployment id, parameters, flow key, jobs), run back
    to back in this process; medians and CPU per run and per job."""
    from prefect.context import SyncClientContext
    from prefect.flow_engine import run_flow
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
        PREFECT_LOGGING_TO_API_ENABLED,
        temporary_settings,
    )

    updates = {
        PREFECT_API_URL: url,
        PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None,
        PREFECT_LOGGING_TO_API_ENABLED: logs_to_api,
    }
    with temporary_settings(updates=updates), SyncClientContext.get_or_create() as ctx:

        def one() -> tuple[float, int]:
            deployment_id, parameters, key, jobs = make()
            run_id = api.create_run(deployment_id, parameters)
            flow_run = ctx.client.read_flow_run(uuid.UUID(run_id))
            start = time.perf_counter()
            state = run_flow(flows[key], flow_run=flow_run, return_type="state")
            assert state.is_completed(), state.message  # type: ignore[union-attr]
            return time.perf_counter() - start, jobs

        one()  # warm: imports, first block loads, first real compute of the shaped stages
        log_start = server_log.stat().st_size if server_log.exists() else 0
        cpu0 = (sum(os.times()[:2]), process_tree_cpu_s(server_pid), postgres_cpu_s())
        timed = [one() for _ in range(runs)]
        drain_client_queues()  # every event and log of these runs reaches this server
        time.sleep(SETTLE_S)  # the services' last timed flush counts too
        wait_until_quiet(server_pid)  # let the server finish the events of the last run
        cpu1 = (sum(os.times()[:2]), process_tree_cpu_s(server_pid), postgres_cpu_s())
    jobs = timed[0][1]
    requests = requests_per_job(server_log, log_start, runs).get("total", 0.0)
    per_run = {
        "wall_ms": statistics.median(t for t, _ in timed) * 1e3,
        "worker_cpu_ms": (cpu1[0] - cpu0[0]) * 1e3 / runs,
        "server_cpu_ms": (cpu1[1] - cpu0[1]) * 1e3 / runs,
        "postgres_cpu_ms": (cpu1[2] - cpu0[2]) * 1e3 / runs,
        "requests": float(requests),
    }
    out = {f"run_{k}": round(v, 1) for k, v in per_run.items()}
    out.update({f"job_{k}": round(v / jobs, 1) for k, v in per_run.items()})
    out["jobs_per_run"] = jobs
    return out


def _makers(
    keys: tuple[str, str], single: str, batch: str, probe_id: str, size: int
) -> dict[str, Maker]:
    """Run factories: (deployment id, parameters, flow key, jobs per run)."""

    def batch_params() -> dict[str, Any]:
        latest = (datetime.now(UTC) + timedelta(minutes=30)).isoformat()
        return {"jobs": [_job(keys) for _ in range(size)], "deadline_at": latest}

    return {
        "fuse-faces": lambda: (single, _job(keys), "fuse-faces", 1),
        f"fuse-batch x{size}": lambda: (batch, batch_params(), "fuse-batch", size),
        "probe 0 tasks": lambda: (probe_id, {"tasks": 0}, "probe", 1),
        "probe 10 tasks": lambda: (probe_id, {"tasks": 10}, "probe", 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--servers", default=",".join(SERVER_VARIANTS))
    parser.add_argument(
        "--gpu-ms",
        type=float,
        default=0.0,
        help="GPU-shaped compute per job (bench/gpu_shaped.py); 0: the orchestration alone",
    )
    parser.add_argument(
        "--runs-of",
        default="",
        help="comma-separated run kinds to measure (fuse-faces, fuse-batch, probe); all if empty",
    )
    args = parser.parse_args()
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

    from bench import gpu_shaped
    from flows.batch import fuse_batch
    from flows.fuse import fuse_faces

    gpu_shaped.install(args.gpu_ms)
    kinds = [kind for kind in args.runs_of.split(",") if kind]

    def wanted(name: str) -> bool:
        return not kinds or any(name.startswith(kind) for kind in kinds)

    flows = {"fuse-faces": fuse_faces, "fuse-batch": fuse_batch, "probe": probe_flow()}
    results: dict[str, dict[str, float]] = {}
    for variant in args.servers.split(","):
        with tempfile.TemporaryDirectory(prefix="faceflow-costs-") as tmp:
            home = Path(tmp)
            with server_database("postgresql") as database_env:
                server = start_server(
                    home, database_env, SERVER_VARIANTS[variant], count_requests=True
                )
                url = server.api_url
                try:
                    api = PrefectRest(url)
                    keys = prepare_inputs(url, home / "faceflow", gpu_shaped=True)[:2]
                    api.create_pool("costs", "faceflow-gpu", pool_template("warm"))
                    single = api.deploy("fuse-faces", "flows/fuse.py:fuse_faces", "costs")
                    batch = api.deploy("fuse-batch", "flows/batch.py:fuse_batch", "costs")
                    probe_id = api.deploy(
                        "cost-probe", "bench/prefect_costs.py:probe_flow", "costs"
                    )
                    makers = _makers(keys, single, batch, probe_id, args.batch)
                    log = home / "server.log"
                    for name, make in makers.items():
                        if not wanted(name):
                            continue
                        results[f"{variant} / {name}"] = measure(
                            api, url, server.pids, log, make, flows, args.runs, True
                        )
                    if variant == "shipped":
                        for name in ("fuse-faces", f"fuse-batch x{args.batch}"):
                            if not wanted(name):
                                continue
                            results[f"logs-off / {name}"] = measure(
                                api, url, server.pids, log, makers[name], flows, args.runs, False
                            )
                finally:
                    server.stop(grace=10)
    columns = ["run_wall_ms", "run_worker_cpu_ms", "run_server_cpu_ms", "run_postgres_cpu_ms"]
    columns += ["run_requests", "job_worker_cpu_ms", "job_server_cpu_ms", "job_requests"]
    print(f"{'configuration':40}" + "".join(f"{c:>20}" for c in columns))
    for name, row in results.items():
        print(f"{name:40}" + "".join(f"{row[c]:>20}" for c in columns))


if __name__ == "__main__":
    main()
