"""Prefect's process worker vs the warm ``faceflow-gpu`` worker on the same jobs (issue 6).

Starts ``prefect server start`` (own PREFECT_HOME, SQLite, 127.0.0.1), saves the default
blocks, stores the sample inputs, deploys ``fuse-faces`` into one pool per worker type and
starts each worker in turn (subprocesses, stopped by PID). Per worker type, after one
untimed job:

- bare: ``tasks.stages.fuse_images`` on the same inputs in this process, ``--jobs``
  times, right before the worker's jobs (the machine is shared: load changes by the minute);
- sequential: ``--jobs`` runs one after another → median dispatch latency (flow-run
  creation → the run's ``start_time``, set as the engine enters the flow function),
  median end-to-end (creation → ``end_time``), overhead = end-to-end - bare median, and
  the same against the run's own stage timings (its ``ResultRef`` sidecar), which the
  load on the machine affects alike;
- burst: ``--jobs`` runs created at once → throughput (jobs/min, first creation → last end).

``--in-process`` (default) also runs ``fuse-faces`` back to back with ``run_flow`` in this
process: what any worker could reach with this flow (its logs stay local). Workers log at
INFO, as in production (``BENCH_WORKER_LOG_LEVEL`` changes it).

During the burst the bench also reads the CPU seconds that the server, the worker with its
children, PostgreSQL and the whole machine spent per job (/proc), and with
``--count-requests`` the Prefect API requests per job from the server's access log: on a
shared machine these show where a job's time goes. Prints figures (``--json`` for JSON);
asserts nothing.

    .venv/bin/python bench/warm_worker.py --jobs 20
    .venv/bin/python bench/warm_worker.py --jobs 5 --modes warm --no-in-process
    .venv/bin/python bench/warm_worker.py --modes warm --server-db postgresql --count-requests
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.fuse_jobs import (  # noqa: E402
    job_parameters,
    pool_template,
    prepare_inputs,
    requests_per_job,
    ts,
)
from bench.job_work import JobWork, bench_settings  # noqa: E402
from faceflow.supervisor import Service  # noqa: E402
from faceflow.testing.net import free_port, http_ok  # noqa: E402
from faceflow.testing.prefect import (  # noqa: E402
    PREFECT,
    PrefectRest,
    server_database,
    start_server,
)
from faceflow.testing.procstat import CpuMeter, wait_until_quiet  # noqa: E402
from faceflow.testing.wait import wait_for  # noqa: E402

TYPES = {"process": "process", "warm": "faceflow-gpu"}
TARGETS = {"dispatch_s": 0.5, "overhead_ms": 300.0, "throughput_share": 0.8}


def pooled(first: dict[str, float], second: dict[str, float]) -> dict[str, float]:
    """Two bare loops of the same length as one: jobs/min over both walls, mean of the
    medians and of the CPU per job."""
    return {
        "median_ms": (first["median_ms"] + second["median_ms"]) / 2,
        "jobs_per_min": 2 / (1 / first["jobs_per_min"] + 1 / second["jobs_per_min"]),
        "cpu_ms_per_job": (first["cpu_ms_per_job"] + second["cpu_ms_per_job"]) / 2,
    }


def bare_loop(
    source: bytes, target: bytes, jobs: int, *, as_job: tuple[JobWork, str, str] | None = None
) -> dict[str, float]:
    """``fuse_images`` in this process, warm: median ms and jobs/min. With ``as_job`` (the
    work and the stored inputs' keys) each iteration does a run's whole work for a job
    (``bench.job_work``: inputs read from storage, the result marked, result and sidecar
    written), as the orchestrated modes' jobs do."""
    from tasks.pipeline import PipelineContext, warm_up
    from tasks.stages import fuse_images

    if as_job is None:
        ctx = PipelineContext.for_this_machine()
        one: Callable[[], object] = lambda: fuse_images(source, target, ctx=ctx)  # noqa: E731
    else:
        work, source_key, target_key = as_job
        ctx = work.ctx
        one = lambda: work.run(source_key, target_key)  # noqa: E731
    warm_up(ctx)
    one()
    times = []
    cpu = sum(os.times()[:2])
    start = time.perf_counter()
    for _ in range(jobs):
        t0 = time.perf_counter()
        one()
        times.append((time.perf_counter() - t0) * 1e3)
    wall = time.perf_counter() - start
    return {
        "median_ms": statistics.median(times),
        "jobs_per_min": jobs / wall * 60.0,
        "cpu_ms_per_job": (sum(os.times()[:2]) - cpu) * 1e3 / jobs,
    }


def in_process_flow_loop(
    api: PrefectRest, url: str, inputs: tuple[str, str, bytes, bytes], jobs: int
) -> dict[str, Any]:
    """The upper bound for any worker: ``fuse-faces`` runs created over REST and run back
    to back by ``run_flow`` in this (warm) process, with the warm child's engine settings."""
    from uuid import UUID

    from prefect.context import SyncClientContext
    from prefect.flow_engine import run_flow
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
        PREFECT_LOGGING_TO_API_ENABLED,
        temporary_settings,
    )

    from faceflow.worker.suspension import install_shared_observer
    from flows.fuse import fuse_faces

    api.create_pool("bench-in-process", "process", pool_template("process"))  # no worker polls it
    deployment_id = api.deploy("fuse-faces", "flows/fuse.py:fuse_faces", "bench-in-process")
    updates = {
        PREFECT_API_URL: url,
        PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None,
        PREFECT_LOGGING_TO_API_ENABLED: False,
    }
    with temporary_settings(updates=updates), SyncClientContext.get_or_create() as ctx:
        install_shared_observer()

        def run_one() -> dict[str, Any]:
            run_id = api.create_run(deployment_id, job_parameters(*inputs[:2]))
            run_flow(fuse_faces, flow_run=ctx.client.read_flow_run(UUID(run_id)))
            return api.run(run_id)

        run_one()
        bare = bare_loop(inputs[2], inputs[3], jobs)
        start = time.perf_counter()
        runs = [run_one() for _ in range(jobs)]
        wall = time.perf_counter() - start
    # The shared observer's websocket outlives the loop; the server stops next.
    logging.getLogger("prefect.FlowRunSuspendingObserver").setLevel(logging.ERROR)
    failed = [r["state"]["message"] for r in runs if r["state_type"] != "COMPLETED"]
    e2e = [ts(r["end_time"]) - ts(r["created"]) for r in runs if r["end_time"]]
    return {
        "bare": bare,
        "failed": failed,
        "e2e_median_s": statistics.median(e2e),
        "jobs_per_min": jobs / wall * 60.0,
    }


def stage_timings(storage: Path, run: dict[str, Any]) -> dict[str, float]:
    """The run's stage timings in ms (load … store) from its ``ResultRef`` sidecar."""
    from flows.params import result_meta_key

    sidecar = storage / result_meta_key(run["parameters"]["job_id"], 1)
    if not sidecar.is_file():
        return {}
    return dict(json.loads(sidecar.read_text())["timings_ms"])


def start_worker(
    mode: str,
    api: PrefectRest,
    pool: str,
    env: dict[str, str],
    home: Path,
    extra_env: dict[str, str] | None = None,
    children: int = 1,
) -> tuple[Service, float]:
    """Start a worker of ``mode`` on ``pool`` and wait until it takes runs; (service, s)."""
    health_port = free_port()
    worker_env = {
        **env,
        "PREFECT_WORKER_QUERY_SECONDS": "1",
        "PREFECT_WORKER_PREFETCH_SECONDS": "1",
        # INFO as in production: the runs ship their stage logs to the API
        "PREFECT_LOGGING_LEVEL": os.environ.get("BENCH_WORKER_LOG_LEVEL", "INFO"),
        "FACEFLOW_WORKER_HEALTH_PORT": str(health_port),
        **(extra_env or {}),
    }
    limit = children if mode == "warm" else 1
    if mode == "warm":
        worker_env["FACEFLOW_WORKER_CHILDREN"] = str(children)
    argv = [PREFECT, "worker", "start", "--pool", pool, "--type", TYPES[mode]]
    argv += ["--limit", str(limit)]
    worker = Service(
        f"worker-{pool}", argv, log=home / f"worker-{pool}.log", env=worker_env, cwd=REPO
    )
    started = time.monotonic()
    worker.start()
    try:
        if mode == "warm":
            ready = http_ok(f"http://127.0.0.1:{health_port}/ready")
            wait_for(ready, 300, step_s=0.2, what="warm worker", ignore=(httpx.HTTPError,))
        else:
            workers = f"/work_pools/{pool}/workers/filter"
            wait_for(
                lambda: bool(api.call("POST", workers, {})),
                120,
                step_s=0.2,
                what="process worker",
                ignore=(httpx.HTTPError,),
            )
    except BaseException:
        worker.stop(grace=10)
        raise
    return worker, time.monotonic() - started


def bench_mode(
    mode: str,
    api: PrefectRest,
    server_pid: int | Sequence[int] | None,
    env: dict[str, str],
    home: Path,
    inputs: tuple[str, str, bytes, bytes],
    jobs: int,
    extra_env: dict[str, str] | None = None,
    children: int = 1,
) -> dict[str, Any]:
    """Create the pool and deployment, start the worker, run the jobs, stop the worker.
    The bare loop runs just before, so both see the same load on a shared machine."""
    keys = inputs[:2]
    pool = f"bench-{mode}"
    api.create_pool(pool, TYPES[mode], pool_template(mode))
    deployment_id = api.deploy("fuse-faces", "flows/fuse.py:fuse_faces", pool)
    limit = children if mode == "warm" else 1
    worker, ready_s = start_worker(mode, api, pool, env, home, extra_env, children)
    try:

        def run_one() -> dict[str, Any]:
            return api.wait_final(api.create_run(deployment_id, job_parameters(*keys)))

        run_one()  # untimed first job (first block load, first process start)
        bare = bare_loop(inputs[2], inputs[3], jobs)
        sequential = [run_one() for _ in range(jobs)]
        server_log = home / "server.log"
        log_start = server_log.stat().st_size if server_log.exists() else 0
        meter = CpuMeter({"server": server_pid, "worker": worker.pid})
        created = [api.create_run(deployment_id, job_parameters(*keys)) for _ in range(jobs)]
        burst = [api.wait_final(run_id) for run_id in created]
        burst_cpu = meter.per_job_ms(jobs)
        burst_requests = (
            requests_per_job(server_log, log_start, jobs) if server_log.exists() else {}
        )
    finally:
        worker.stop(grace=30)
    failed = [r["state"]["message"] for r in sequential + burst if r["state_type"] != "COMPLETED"]
    dispatch = [ts(r["start_time"]) - ts(r["created"]) for r in sequential if r["start_time"]]
    e2e = [ts(r["end_time"]) - ts(r["created"]) for r in sequential if r["end_time"]]
    burst_wall = max(ts(r["end_time"]) for r in burst) - min(ts(r["created"]) for r in burst)
    ordered = sorted(burst, key=lambda r: ts(r["start_time"]))
    gaps = [ts(b["start_time"]) - ts(a["end_time"]) for a, b in itertools.pairwise(ordered)]
    storage = home / "faceflow" / "storage"
    stages = [stage_timings(storage, r) for r in sequential]
    in_flow = [
        (ts(r["end_time"]) - ts(r["start_time"])) * 1e3 - sum(t.values())
        for r, t in zip(sequential, stages, strict=True)
    ]
    stage_medians = {
        name: round(statistics.median(t.get(name, 0.0) for t in stages), 1)
        for name in (stages[0] if stages else {})
    }
    in_run_overhead = [
        (ts(r["end_time"]) - ts(r["created"])) * 1e3 - sum(t.values())
        for r, t in zip(sequential, stages, strict=True)
    ]
    return {
        "bare": bare,
        "worker_ready_s": ready_s,
        "children": limit,
        "overhead_vs_own_stages_median_ms": statistics.median(in_run_overhead),
        "failed": failed,
        "dispatch_median_s": statistics.median(dispatch),
        "dispatch_p90_s": sorted(dispatch)[int(0.9 * (len(dispatch) - 1))],
        "e2e_median_s": statistics.median(e2e),
        "burst_jobs_per_min": len(burst) / burst_wall * 60.0,
        "burst_gap_median_ms": statistics.median(gaps) * 1e3 if gaps else 0.0,
        "burst_gap_max_ms": max(gaps) * 1e3 if gaps else 0.0,
        "burst_first_start_s": ts(ordered[0]["start_time"]) - min(ts(r["created"]) for r in burst),
        "burst_run_median_ms": statistics.median(
            (ts(r["end_time"]) - ts(r["start_time"])) * 1e3 for r in burst
        ),
        "flow_bookkeeping_median_ms": statistics.median(in_flow),
        "burst_cpu_ms_per_job": burst_cpu,
        "burst_requests_per_job": burst_requests,
        "stage_median_ms": stage_medians,
        "state_gaps_ms": state_gaps(api, sequential),
    }


RELAY_MODES = {"per-job": 1, "batched": None}
"""Relay modes: today's one ``fuse-faces`` run per job, and micro-batching (``--batch-size``)."""


def relay_modes(
    modes: list[str],
    api: PrefectRest,
    server_pid: int | Sequence[int] | None,
    env: dict[str, str],
    home: Path,
    inputs: tuple[str, str, bytes, bytes],
    jobs: int,
    *,
    batch_size: int,
    worker_env: dict[str, str],
    gpu_ms: float | None,
    url: str,
    apart_s: float = 0.0,
) -> dict[str, dict[str, Any]]:
    """Jobs submitted over HTTP to the webapi, dispatched by its relay to one warm worker
    shared by the modes (``bench/relay_bench.py``); the bare loop runs before and after each
    (pooled: the machine's speed drifts by minutes)."""
    from bench import gpu_shaped, relay_bench

    pool = "bench-relay"
    api.create_pool(pool, TYPES["warm"], pool_template("warm"))
    api.deploy("fuse-faces", "flows/fuse.py:fuse_faces", pool, name="fuse-faces")
    api.deploy("fuse-batch", "flows/batch.py:fuse_batch", pool, name="fuse-batch")
    extra = dict(worker_env)
    if gpu_ms is not None:
        extra[gpu_shaped.ENV] = str(gpu_ms)
        extra["PYTHONPATH"] = str(REPO / "bench" / gpu_shaped.SITE)
        gpu_shaped.install(gpu_ms)  # the bare loop in this process too
    worker, ready_s = start_worker("warm", api, pool, env, home, extra)
    results: dict[str, dict[str, Any]] = {}
    # A job's whole work (what the runs do per job), and fuse_images alone (the bare
    # loop's definition before issue 24, which left marking and storage out).
    work = JobWork.local(home / "faceflow", bench_settings(gpu_shaped=gpu_ms is not None))

    def both_loops() -> tuple[dict[str, float], dict[str, float]]:
        job = bare_loop(inputs[2], inputs[3], jobs, as_job=(work, inputs[0], inputs[1]))
        return job, bare_loop(inputs[2], inputs[3], jobs)

    try:
        for mode in modes:
            quiet_s = wait_until_quiet(server_pid)  # the last mode's events are worked off
            bare, fuse_only = both_loops()
            results[mode] = relay_bench.relay_mode(
                mode,
                batch_max_jobs=RELAY_MODES[mode] or batch_size,
                api=api,
                pids={"server": server_pid, "worker": worker.pid},
                env=env,
                home=home,
                storage=home / "faceflow" / "storage",
                prefect_url=url,
                body=relay_bench.request_body(inputs[2], inputs[3]),
                jobs=jobs,
                apart_s=apart_s,
                port=free_port(),
                server_log=home / "server.log",
            )
            wait_until_quiet(server_pid)
            after, fuse_only_after = both_loops()
            # The machine's speed drifts by minutes (±15 % between runs seen): the mode is
            # measured against the bare loop before and after it, pooled.
            results[mode]["bare"] = pooled(bare, after)
            results[mode]["bare_before_after"] = (bare["jobs_per_min"], after["jobs_per_min"])
            results[mode]["bare_fuse_images_only"] = pooled(fuse_only, fuse_only_after)
            results[mode]["server_quiet_wait_s"] = round(quiet_s, 1)
            results[mode]["worker_ready_s"] = ready_s
    finally:
        worker.stop(grace=30)
    return results


def print_relay_table(
    results: dict[str, dict[str, Any]], gpu_ms: float | None, apart_s: float = 0.0
) -> None:
    """The relay modes side by side, against their bare loops."""
    modes = list(results)
    compute = f"GPU-shaped {gpu_ms:g} ms/job" if gpu_ms else "real pipeline"
    spacing = f"{apart_s:g} s apart" if apart_s else "back to back"
    print(f"relay modes, compute: {compute}; single jobs one at a time, {spacing}")
    rows = [
        ("bare loop, a job's work (jobs/min)", lambda r: r["bare"]["jobs_per_min"], "{:.1f}"),
        (
            "  before / after the mode",
            lambda r: "{:.0f} / {:.0f}".format(*r["bare_before_after"]),
            "{}",
        ),
        ("bare median, a job's work (ms)", lambda r: r["bare"]["median_ms"], "{:.0f}"),
        ("bare, fuse_images only (jobs/min)", lambda r: _fuse_only(r)["jobs_per_min"], "{:.1f}"),
        ("bare median, fuse_images only (ms)", lambda r: _fuse_only(r)["median_ms"], "{:.0f}"),
        ("jobs per run, at most", lambda r: r["batch_max_jobs"], "{}"),
        ("dispatch median, one at a time (s)", lambda r: r["dispatch_median_s"] or 0, "{:.2f}"),
        ("dispatch p90 (s)", lambda r: r.get("dispatch_p90_s") or 0, "{:.2f}"),
        ("end-to-end median, one at a time (s)", lambda r: r["e2e_median_s"] or 0, "{:.2f}"),
        ("end-to-end p90 (s)", lambda r: r.get("e2e_p90_s") or 0, "{:.2f}"),
        ("  of which the run, start to end (s)", lambda r: r.get("run_median_s") or 0, "{:.2f}"),
        ("  and run end to job finished (s)", lambda r: r.get("notice_median_s") or 0, "{:.2f}"),
        ("server quiet wait before burst (s)", lambda r: r.get("burst_quiet_wait_s", 0), "{}"),
        ("burst throughput (jobs/min)", lambda r: r["burst_jobs_per_min"], "{:.1f}"),
        (
            "burst / bare loop (a job's work)",
            lambda r: r["burst_jobs_per_min"] / r["bare"]["jobs_per_min"],
            "{:.0%}",
        ),
        (
            "burst / bare loop (fuse_images only)",
            lambda r: r["burst_jobs_per_min"] / _fuse_only(r)["jobs_per_min"],
            "{:.0%}",
        ),
        ("burst: runs", lambda r: r["burst_runs"], "{}"),
        ("burst: jobs per run", lambda r: r["burst_jobs_per_run"], "{}"),
        ("burst CPU/job: Prefect server (ms)", lambda r: r["burst_cpu_ms_per_job"]["server"], "{}"),
        ("burst CPU/job: worker+child (ms)", lambda r: r["burst_cpu_ms_per_job"]["worker"], "{}"),
        ("burst CPU/job: webapi+relay (ms)", lambda r: r["burst_cpu_ms_per_job"]["webapi"], "{}"),
        ("burst CPU/job: postgres (ms)", lambda r: r["burst_cpu_ms_per_job"]["postgres"], "{}"),
        (
            "burst: machine busy",
            lambda r: r["burst_cpu_ms_per_job"]["machine_busy_share"],
            "{:.0%}",
        ),
        (
            "burst: Prefect requests/job",
            lambda r: r["burst_requests_per_job"].get("total", "-"),
            "{}",
        ),
    ]
    print(f"{'':38}" + "".join(f"{m:>12}" for m in modes))
    for label, get, fmt in rows:
        print(f"{label:38}" + "".join(f"{fmt.format(get(results[m])):>12}" for m in modes))
    for mode in modes:
        result = results[mode]
        runs = "; ".join(
            f"{r['jobs']} jobs c{r['created']} s{r['start_time']} e{r['end_time']}"
            for r in result.get("burst_timeline", [])
        )
        print(
            f"{mode} burst runs (s after the first job; last job created at "
            f"{result.get('burst_last_created_s')}): {runs}"
        )
    for mode in modes:
        if results[mode]["failed"]:
            print(f"{mode}: jobs not succeeded: {results[mode]['failed']}")


def _fuse_only(result: dict[str, Any]) -> dict[str, float]:
    """The bare loop of ``fuse_images`` alone (the definition before issue 24)."""
    return dict(result["bare_fuse_images_only"])


def state_gaps(api: PrefectRest, runs: list[dict[str, Any]]) -> dict[str, float]:
    """Median time between consecutive states (Scheduled → Pending → … → Completed)."""
    gaps: dict[str, list[float]] = {}
    for run in runs:
        states = api.call("GET", f"/flow_run_states/?flow_run_id={run['id']}")
        states.sort(key=lambda s: ts(s["timestamp"]))
        for before, after in itertools.pairwise(states):
            name = f"{before['type']}→{after['type']}"
            gaps.setdefault(name, []).append(
                (ts(after["timestamp"]) - ts(before["timestamp"])) * 1e3
            )
    return {name: round(statistics.median(values), 1) for name, values in gaps.items()}


def report(results: dict[str, dict[str, Any]], reference: dict[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {"modes": {}, "in_process_flow": reference, "targets": TARGETS}
    for mode, r in results.items():
        bare = r["bare"]
        overhead_ms = r["e2e_median_s"] * 1e3 - bare["median_ms"]
        share = r["burst_jobs_per_min"] / bare["jobs_per_min"]
        out["modes"][mode] = {
            **r,
            "overhead_median_ms": overhead_ms,
            "throughput_share_of_bare": share,
            "throughput_share_of_in_process_flow": (
                r["burst_jobs_per_min"] / reference["jobs_per_min"] if reference else None
            ),
            "meets_targets": {
                "dispatch": r["dispatch_median_s"] <= TARGETS["dispatch_s"],
                "overhead": overhead_ms <= TARGETS["overhead_ms"],
                "throughput": share >= TARGETS["throughput_share"],
            },
        }
    return out


def print_table(out: dict[str, Any]) -> None:
    modes = list(out["modes"])
    rows = [
        ("bare pipeline median (ms)", lambda m: m["bare"]["median_ms"], "{:.0f}"),
        ("bare pipeline (jobs/min)", lambda m: m["bare"]["jobs_per_min"], "{:.1f}"),
        ("dispatch median (s)", lambda m: m["dispatch_median_s"], "{:.2f}"),
        ("dispatch p90 (s)", lambda m: m["dispatch_p90_s"], "{:.2f}"),
        ("end-to-end median (s)", lambda m: m["e2e_median_s"], "{:.2f}"),
        ("overhead vs bare (ms)", lambda m: m["overhead_median_ms"], "{:.0f}"),
        ("overhead vs own stages (ms)", lambda m: m["overhead_vs_own_stages_median_ms"], "{:.0f}"),
        ("throughput, burst (jobs/min)", lambda m: m["burst_jobs_per_min"], "{:.1f}"),
        ("throughput / bare", lambda m: m["throughput_share_of_bare"], "{:.0%}"),
        ("burst: end → next start (ms)", lambda m: m["burst_gap_median_ms"], "{:.0f}"),
        ("burst: largest such gap (ms)", lambda m: m["burst_gap_max_ms"], "{:.0f}"),
        ("burst: creation → first start (s)", lambda m: m["burst_first_start_s"], "{:.2f}"),
        ("burst: run start → end median (ms)", lambda m: m["burst_run_median_ms"], "{:.0f}"),
        ("in flow, outside stages (ms)", lambda m: m["flow_bookkeeping_median_ms"], "{:.0f}"),
        ("worker ready (s)", lambda m: m["worker_ready_s"], "{:.1f}"),
    ]
    print(f"{'':32}" + "".join(f"{m:>12}" for m in modes))
    for label, get, fmt in rows:
        print(f"{label:32}" + "".join(f"{fmt.format(get(out['modes'][m])):>12}" for m in modes))
    ref = out["in_process_flow"]
    if ref:
        print(
            f"in-process run_flow loop: e2e median {ref['e2e_median_s']:.2f} s, "
            f"{ref['jobs_per_min']:.1f} jobs/min (bare {ref['bare']['jobs_per_min']:.1f})"
        )
    for mode in modes:
        r = out["modes"][mode]
        print(f"{mode} state gaps (median ms): {r['state_gaps_ms']}")
        print(f"{mode} stages in the flow (median ms): {r['stage_median_ms']}")
        print(f"{mode} burst CPU per job (ms) and machine busy share: {r['burst_cpu_ms_per_job']}")
        if r["burst_requests_per_job"].get("total"):
            print(f"{mode} burst Prefect API requests per job: {r['burst_requests_per_job']}")
        if r["failed"]:
            print(f"{mode} FAILED runs: {r['failed']}")


def default_batch_size() -> int:
    """The webapi's default ``batch_max_jobs`` (what a stack runs with unless set)."""
    from webapi.config import Settings

    return int(Settings.model_fields["batch_max_jobs"].default)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=20)
    parser.add_argument(
        "--modes",
        default="process,warm",
        help="comma-separated: process,warm (runs created directly), per-job,batched "
        "(jobs through the webapi and its relay)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="batched mode's FACEFLOW_BATCH_MAX_JOBS (default: the webapi's default)",
    )
    parser.add_argument(
        "--gpu-ms",
        type=float,
        default=None,
        help="GPU-shaped compute: each job's pipeline compute is a sleep of this many ms "
        "(bench/gpu_shaped.py), in the relay modes and their bare loop",
    )
    parser.add_argument(
        "--celery",
        action="store_true",
        help="also run the same jobs through Celery + Redis as a classic GPU queue "
        "(bench/celery_queue.py; needs the bench extra)",
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--server-db",
        choices=["sqlite", "postgresql"],
        default="sqlite",
        help="the Prefect server's database (production: postgresql)",
    )
    parser.add_argument(
        "--in-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time run_flow back to back in this process (the bound for any worker)",
    )
    parser.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="extra environment for the Prefect server (repeatable)",
    )
    parser.add_argument(
        "--worker-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="extra environment for the workers and their children (repeatable)",
    )
    parser.add_argument(
        "--children",
        type=int,
        default=1,
        help="warm children (runs at once) of the warm worker; the process worker runs one",
    )
    parser.add_argument(
        "--server-layout",
        choices=["embedded", "scale-out"],
        default="embedded",
        help="the Prefect server's services in its API process (embedded, the local "
        "stack's default) or in a process of their own with Redis messaging (scale-out, "
        "docs/prefect-scale-out.md; needs --server-db postgresql)",
    )
    parser.add_argument(
        "--apart-s",
        type=float,
        default=0.0,
        help="relay modes: seconds from one single job's end to the next one's submission "
        "(default 0: back to back, the next job meets the last one's work still on the "
        "Prefect server; 1: each single job alone)",
    )
    parser.add_argument(
        "--stage-task-runs",
        choices=["never", "batches", "always"],
        default=None,
        help="the runs' FusionSettings.stage_task_runs (default: the settings' default)",
    )
    parser.add_argument(
        "--count-requests",
        action="store_true",
        help="log the server's requests and report Prefect API calls per job (burst)",
    )
    args = parser.parse_args()
    server_env = dict(item.split("=", 1) for item in args.server_env)
    worker_env = dict(item.split("=", 1) for item in args.worker_env)
    modes = [m for m in args.modes.split(",") if m]
    with tempfile.TemporaryDirectory(prefix="faceflow-bench-") as tmp:
        home = Path(os.environ.get("BENCH_KEEP_DIR") or tmp)
        home.mkdir(parents=True, exist_ok=True)
        with server_database(args.server_db) as database_env:
            server = start_server(
                home, database_env, server_env, args.count_requests, args.server_layout
            )
            url, env = server.api_url, server.env
            try:
                api = PrefectRest(url)
                inputs = prepare_inputs(
                    url,
                    home / "faceflow",
                    gpu_shaped=bool(args.gpu_ms),
                    stage_task_runs=args.stage_task_runs,
                )
                results = {
                    m: bench_mode(
                        m, api, server.pids, env, home, inputs, args.jobs, worker_env, args.children
                    )
                    for m in modes
                    if m in TYPES
                }
                relay = [m for m in modes if m in RELAY_MODES]
                relay_results = (
                    relay_modes(
                        relay,
                        api,
                        server.pids,
                        env,
                        home,
                        inputs,
                        args.jobs,
                        batch_size=args.batch_size or default_batch_size(),
                        worker_env=worker_env,
                        gpu_ms=args.gpu_ms,
                        url=url,
                        apart_s=args.apart_s,
                    )
                    if relay
                    else {}
                )
                celery = celery_figures(inputs, args.jobs, args.gpu_ms) if args.celery else None
                reference = (
                    in_process_flow_loop(api, url, inputs, args.jobs) if args.in_process else None
                )
            finally:
                server.stop(grace=10)
    out = report(results, reference) if results else {}
    out["relay_modes"] = relay_results
    out["celery"] = celery
    out["gpu_ms"] = args.gpu_ms
    if args.json:
        print(json.dumps(out, indent=1, default=str))
        return
    if results:
        print_table(out)
    if relay_results:
        print_relay_table(relay_results, args.gpu_ms, args.apart_s)
    if celery:
        print(f"celery + redis (same inputs, same compute): {celery}")


def celery_figures(
    inputs: tuple[str, str, bytes, bytes], jobs: int, gpu_ms: float | None
) -> dict[str, Any]:
    """The same jobs through Celery + Redis as a classic GPU queue (bench/celery_queue.py),
    each task doing a FaceFlow job's whole work (``bench.job_work``); and, as before issue
    24, ``fuse_images`` alone (``fuse_images_only``)."""
    from bench import celery_queue  # needs the bench extra (issue 12)

    # mode "gpu": the pipeline GPU-shaped in the Celery worker, as in the relay modes
    figures = [
        celery_queue.run_celery(
            jobs,
            inputs[2],
            inputs[3],
            mode="gpu" if gpu_ms is not None else "real",
            sleep_ms=gpu_ms or 30.0,
            job_work=job_work,
        )
        for job_work in (True, False)
    ]
    return {**figures[0], "fuse_images_only": dict(figures[1])}


if __name__ == "__main__":
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    main()
