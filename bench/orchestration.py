"""Orchestration overhead of fuse-faces on one process worker (issue 3's benchmark).

Starts a Prefect server (SQLite, temporary PREFECT_HOME; or uses ``--api-url``), creates
the ``gpu`` pool from work_pools/gpu-process.json, deploys fuse-faces from prefect.yaml,
saves the default blocks, starts one process worker (``PREFECT_WORKER_QUERY_SECONDS``),
then runs ``--jobs`` sequential jobs astronaut → grace_hopper, each created over REST (a
503 from the busy SQLite server is retried with the same idempotency key) and waited for. Reports, as JSON, the median flow-run creation → flow start (the run's
RUNNING time, just before the flow's first line), the median end-to-end (creation →
COMPLETED), the same fusions through ``tasks.stages.fuse_images`` in one process, and
the ratio end-to-end / bare. Every process it starts is stopped by PID.

    .venv/bin/python bench/orchestration.py --jobs 10
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from faceflow.samples import astronaut_jpeg_bytes, grace_hopper_jpeg_bytes  # noqa: E402
from faceflow.supervisor import Service  # noqa: E402
from faceflow.testing.inputs import put_input  # noqa: E402
from faceflow.testing.prefect import PREFECT, PrefectRest, PrefectServer, client_env  # noqa: E402
from flows.binding import signed_parameters, worker_keys  # noqa: E402
from flows.params import FuseFacesParams, idempotency_key, run_tags  # noqa: E402


def parse_time(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def run_cli(env: dict[str, str], *args: str) -> None:
    subprocess.run([PREFECT, *args], cwd=REPO, env=env, check=True, capture_output=True)


def setup(env: dict[str, str], home: Path) -> None:
    """Pool, deployment and blocks on the server named by ``env``."""
    template = REPO / "work_pools" / "gpu-process.json"
    run_cli(
        env,
        "work-pool",
        "create",
        "gpu",
        "--type",
        "process",
        "--overwrite",
        "--base-job-template",
        str(template),
    )
    run_cli(env, "work-pool", "set-concurrency-limit", "gpu", "1")
    run_cli(env, "--no-prompt", "deploy", "--name", "fuse-faces")
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from blocks import init_default_blocks

    with temporary_settings(updates={PREFECT_API_URL: env["PREFECT_API_URL"]}):
        init_default_blocks(home)


def store_inputs(home: Path) -> tuple[str, str]:
    source, target = astronaut_jpeg_bytes(), grace_hopper_jpeg_bytes()
    return put_input(home / "storage", source), put_input(home / "storage", target)


def run_job(api: PrefectRest, deployment_id: str, source: str, target: str) -> dict[str, float]:
    """Create one flow run, wait until it is final; its timings in seconds."""
    job_id = str(uuid.uuid4())
    params = FuseFacesParams(
        job_id=job_id,
        owner_id="bench",
        source_key=source,
        target_key=target,
        deadline_at=datetime.now(UTC) + timedelta(minutes=5),
    ).model_dump(mode="json")
    params = signed_parameters(params, worker_keys()[0])  # as the relay binds a job
    body = {
        "parameters": params,
        "idempotency_key": idempotency_key(job_id, 1),  # a retried create makes one run
        "name": job_id,
        "tags": run_tags(job_id, "bench"),  # as the relay creates runs
    }
    run_id = api.call("POST", f"/deployments/{deployment_id}/create_flow_run", body)["id"]
    run = api.wait_final(run_id)
    if run["state"]["type"] != "COMPLETED":
        raise RuntimeError(f"job {job_id} ended {run['state']['type']}: {run['state']['message']}")
    created_at = parse_time(run["created"])
    return {
        "to_first_line_s": (parse_time(run["start_time"]) - created_at).total_seconds(),
        "end_to_end_s": (parse_time(run["end_time"]) - created_at).total_seconds(),
    }


def bare_pipeline(jobs: int) -> list[float]:
    """The same fusions in this process (models loaded once, first call included)."""
    from tasks.pipeline import PipelineContext
    from tasks.stages import fuse_images

    ctx = PipelineContext.for_this_machine()
    source, target = astronaut_jpeg_bytes(), grace_hopper_jpeg_bytes()
    times = []
    for _ in range(jobs):
        start = time.perf_counter()
        fuse_images(source, target, ctx=ctx)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=10)
    parser.add_argument("--api-url", help="use this Prefect server instead of starting one")
    parser.add_argument("--query-seconds", type=float, default=1.0)
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="faceflow-bench-"))
    home = root / "faceflow"
    workers = {
        "PREFECT_WORKER_QUERY_SECONDS": str(args.query_seconds),
        "PREFECT_WORKER_PREFETCH_SECONDS": "1",
    }
    server = None if args.api_url else PrefectServer(root, client_extra=workers)
    env = server.env if server else client_env(root, args.api_url, extra=workers)
    worker = Service(
        "worker",
        [PREFECT, "worker", "start", "--pool", "gpu", "--type", "process", "--limit", "1"],
        log=root / "worker.log",
        env=env,
        cwd=REPO,
    )
    try:
        if server is not None:
            server.start()
        setup(env, home)
        source, target = store_inputs(home)
        worker.start()
        api = PrefectRest(env["PREFECT_API_URL"])
        deployment_id = api.call("GET", "/deployments/name/fuse-faces/fuse-faces")["id"]
        runs = [run_job(api, deployment_id, source, target) for _ in range(args.jobs)]
        api.close()
    finally:
        worker.stop(grace=10)
        if server is not None:
            server.stop(grace=10)
    bare = bare_pipeline(args.jobs)
    e2e = statistics.median(r["end_to_end_s"] for r in runs)
    report: dict[str, Any] = {
        "jobs": args.jobs,
        "worker_query_seconds": args.query_seconds,
        "median_creation_to_first_line_s": round(
            statistics.median(r["to_first_line_s"] for r in runs), 3
        ),
        "median_end_to_end_s": round(e2e, 3),
        "median_bare_pipeline_s": round(statistics.median(bare), 3),
        "ratio_end_to_end_over_bare": round(e2e / statistics.median(bare), 1),
        "runs": runs,
        "logs": str(root),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
