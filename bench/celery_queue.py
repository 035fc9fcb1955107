"""The same pipeline function under Celery + Redis as a classic GPU queue (issue 12).

Starts one Celery worker (``celery -A bench.celery_app worker --concurrency 1
--prefetch-multiplier 1 -O fair``: acks late, prefetch 1, a hard time limit, reject on
worker lost; see ``bench/celery_app.py``) on Redis at 127.0.0.1, broker and result
backend in a DB index of its own that it flushes before and after. Inputs are written
once to a temp dir and the messages carry their paths (the storage keys of a real queue);
each task writes its result there and returns the path and its own timings.

After one untimed job (the worker's start to its result, and the pool process's model
load as it starts, are reported apart):

- sequential: ``--jobs`` tasks one after another → median end-to-end (submit → result
  seen here), median queue latency (submit → the task body starts), the task's own
  compute (``fuse_images`` or the sleep) and overhead = end-to-end - compute per job;
- burst: ``--jobs`` tasks submitted at once → throughput (jobs/min, first submit → last
  result), the gap between a task's end and the next one's start, and CPU ms per job of
  the worker's process tree, redis-server, this process and the rest of the machine
  (/proc, ``faceflow/testing/procstat.py``), with Redis commands per job.

Mode ``gpu`` runs ``fuse_images`` GPU-shaped (``bench/gpu_shaped.py``: each compute stage
a sleep of its share of ``--sleep-ms``, decode and encode real), the same compute as
``bench/warm_worker.py --gpu-ms``; mode ``sleep`` replaces ``fuse_images`` with
``time.sleep(--sleep-ms)`` (no decode, no encode): the queue's own cost per job, as on a
GPU whose kernel leaves the CPU free. Redis is the machine's
shared server: its CPU and command counts include anyone else's traffic. Needs the bench
extra (``make bench-setup``). Prints figures (``--json`` for JSON); asserts nothing.

    .venv/bin/python bench/celery_queue.py --jobs 50 --mode real
    .venv/bin/python bench/celery_queue.py --jobs 50 --mode sleep --sleep-ms 30
    .venv/bin/python bench/celery_queue.py --jobs 50 --mode gpu --sleep-ms 100
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from faceflow.supervisor import Service  # noqa: E402
from faceflow.testing.procstat import CpuMeter  # noqa: E402

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/15"
RESULT_TIMEOUT_S = 600.0

Figures = dict[str, float | int | str]


def _cpu_figures(per_job_ms: dict[str, float]) -> Figures:
    """``cpu_<component>_ms_per_job`` (``worker``, ``redis``, ``bench``, ``other``: the
    rest of the machine) and the machine's busy share of all cores."""
    share = per_job_ms.pop("machine_busy_share")
    out: Figures = {f"cpu_{k}_ms_per_job": v for k, v in per_job_ms.items()}
    out["machine_busy_share"] = share
    return out


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 1) if values else float("nan")


def _p90(values: list[float]) -> float:
    return round(sorted(values)[int(0.9 * (len(values) - 1))], 1) if values else float("nan")


def _command_calls(store: Any) -> dict[str, int]:
    """Calls so far per Redis command (``INFO commandstats``), all clients of the server."""
    return {
        name.removeprefix("cmdstat_"): int(stats["calls"])
        for name, stats in store.info("commandstats").items()
    }


def _log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def run_celery(
    jobs: int,
    source: bytes,
    target: bytes,
    *,
    mode: Literal["real", "gpu", "sleep"],
    sleep_ms: float = 30.0,
    redis_url: str = DEFAULT_REDIS_URL,
    torch_threads: int | None = None,
    time_limit_s: float = 120.0,
    keep_dir: Path | None = None,
    job_work: bool = False,
) -> Figures:
    """Start one Celery worker, run one untimed job, ``jobs`` sequential jobs and a burst
    of ``jobs``, stop the worker by PID and return the figures (times in ms unless named
    ``_s``). The worker's log is in ``keep_dir`` when given (a temp dir otherwise).
    ``job_work`` (modes ``real`` and ``gpu``): each task does a FaceFlow job's whole work
    (``bench.job_work``) on inputs stored in a FaceFlow home's local storage there."""
    import redis

    from bench.celery_app import (
        GPU_MS_ENV,
        HOME_ENV,
        MODE_ENV,
        REDIS_URL_ENV,
        TASK_NAME,
        THREADS_ENV,
        TIME_LIMIT_ENV,
        make_app,
    )

    store = redis.Redis.from_url(redis_url)
    store.ping()
    store.flushdb()  # this DB index only
    redis_pid = int(store.info("server")["process_id"])
    client = make_app(redis_url, time_limit_s)
    load_before = os.getloadavg()[0]

    with tempfile.TemporaryDirectory(prefix="faceflow-celery-") as tmp:
        home = keep_dir or Path(tmp)
        out_dir = home / "results"
        out_dir.mkdir(parents=True, exist_ok=True)
        (home / "source.jpg").write_bytes(source)
        (home / "target.jpg").write_bytes(target)
        job = {
            "source": str(home / "source.jpg"),
            "target": str(home / "target.jpg"),
            "out_dir": str(out_dir),
            "mode": mode,
            "sleep_ms": sleep_ms,
        }
        env = {
            REDIS_URL_ENV: redis_url,
            MODE_ENV: mode,
            TIME_LIMIT_ENV: str(time_limit_s),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            "PYTHONUNBUFFERED": "1",
        }
        if torch_threads:
            env[THREADS_ENV] = str(torch_threads)
        if mode == "gpu":
            env[GPU_MS_ENV] = str(sleep_ms)
        if job_work and mode != "sleep":
            from faceflow.testing.inputs import put_input

            storage = home / "faceflow" / "storage"
            job["source_key"], job["target_key"] = (put_input(storage, d) for d in (source, target))
            env[HOME_ENV] = str(home / "faceflow")
        argv = [sys.executable, "-m", "celery", "-A", "bench.celery_app", "worker"]
        argv += ["--concurrency", "1", "--prefetch-multiplier", "1", "-O", "fair"]
        argv += ["--hostname", f"faceflow-bench-{os.getpid()}@%h", "--loglevel", "WARNING"]
        log = home / "celery-worker.log"
        worker = Service("celery-worker", argv, log=log, env=env, cwd=REPO)

        failures: list[str] = []

        def submit() -> tuple[float, Any]:
            return time.time(), client.send_task(TASK_NAME, args=[job])

        def result_of(pending: Any) -> tuple[float, dict[str, Any] | None]:
            value = pending.get(timeout=RESULT_TIMEOUT_S, propagate=False)
            seen = time.time()
            if not isinstance(value, dict):
                failures.append(f"{pending.state}: {value!r}")
                return seen, None
            return seen, value

        started = time.time()
        worker.start()
        try:
            _, first = result_of(submit()[1])
            if first is None or not worker.alive():
                raise RuntimeError(
                    f"first Celery job failed: {failures}; worker log {log}:\n{_log_tail(log)}"
                )
            ready_s = time.time() - started

            e2e, queue, compute, task, overhead, result_lag = [], [], [], [], [], []
            for _ in range(jobs):
                sent, pending = submit()
                seen, r = result_of(pending)
                if r is None:
                    continue
                e2e.append((seen - sent) * 1e3)
                queue.append((r["started"] - sent) * 1e3)
                compute.append(r["compute_ms"])
                task.append(r["task_ms"])
                overhead.append((seen - sent) * 1e3 - r["compute_ms"])
                result_lag.append((seen - r["ended"]) * 1e3)

            calls_before = _command_calls(store)
            meter = CpuMeter({"worker": worker.pid, "redis": redis_pid}, postgres=False)
            sent_burst = [submit() for _ in range(jobs)]
            burst = [result_of(pending) for _, pending in sent_burst]
            cpu = _cpu_figures(meter.per_job_ms(jobs))
            calls_after = _command_calls(store)
        finally:
            worker.stop(grace=30)
            store.flushdb()
            store.close()
            client.close()

    first_sent = sent_burst[0][0]
    done = sorted((r for _, r in burst if r is not None), key=lambda r: r["started"])
    wall_s = max(seen for seen, _ in burst) - first_sent
    gaps = [(b["started"] - a["ended"]) * 1e3 for a, b in itertools.pairwise(done)]
    calls = {k: n - calls_before.get(k, 0) for k, n in calls_after.items()}
    calls.pop("info", None)  # this bench's own reads of the counters
    top = sorted(calls.items(), key=lambda item: -item[1])[:6]
    figures: Figures = {
        "mode": mode,
        "jobs": jobs,
        "inputs": "keys in a FaceFlow home's local storage"
        if HOME_ENV in env
        else "file paths in a temp dir (storage keys)",
        "work": "a FaceFlow job's (marked, stored)" if HOME_ENV in env else "fuse_images",
        "torch_threads": int(first["torch_threads"]) if mode != "sleep" else "n/a",
        "worker_start_to_first_result_s": round(ready_s, 2),
        "warm_up_ms": round(float(first["warm_up_ms"]), 1),
        "first_task_ms": round(float(first["task_ms"]), 1),
        "seq_e2e_median_ms": _median(e2e),
        "seq_e2e_p90_ms": _p90(e2e),
        "seq_queue_median_ms": _median(queue),
        "seq_queue_p90_ms": _p90(queue),
        "seq_compute_median_ms": _median(compute),
        "seq_task_median_ms": _median(task),
        "seq_overhead_median_ms": _median(overhead),
        "seq_result_lag_median_ms": _median(result_lag),
        "burst_results": len(done),
        "burst_jobs_per_min": round(len(done) / wall_s * 60.0, 1),
        "burst_wall_s": round(wall_s, 2),
        "burst_first_start_ms": round((done[0]["started"] - first_sent) * 1e3, 1) if done else -1,
        "burst_gap_median_ms": _median(gaps),
        "burst_gap_max_ms": round(max(gaps), 1) if gaps else 0.0,
        "burst_compute_median_ms": _median([r["compute_ms"] for r in done]),
        **cpu,
        "redis_commands_per_job": round(sum(calls.values()) / jobs, 1),
        "redis_commands_per_s": round(sum(calls.values()) / wall_s, 1),
        "redis_top_commands_per_job": ", ".join(f"{k} {n / jobs:.1f}" for k, n in top),
        "failed": len(failures),
        "first_failure": failures[0] if failures else "",
        "load_1m_before": round(load_before, 2),
        "load_1m_after": round(os.getloadavg()[0], 2),
    }
    if mode != "real":
        figures["sleep_ms"] = sleep_ms
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=50)
    parser.add_argument("--mode", choices=["real", "gpu", "sleep"], default="real")
    parser.add_argument(
        "--sleep-ms", type=float, default=30.0, help="modes gpu and sleep: compute ms per job"
    )
    parser.add_argument("--redis-url", default=DEFAULT_REDIS_URL, help="flushed before and after")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch threads in the worker (default: torch's)",
    )
    parser.add_argument("--time-limit", type=float, default=120.0, help="hard task time limit (s)")
    parser.add_argument("--keep-dir", type=Path, default=None, help="keep inputs, results, log")
    parser.add_argument(
        "--job-work",
        action="store_true",
        help="modes real and gpu: each task does a FaceFlow job's whole work (inputs read "
        "from storage, result marked, result and sidecar written: bench/job_work.py)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    # SIGTERM (``timeout``, a CI kill) unwinds like Ctrl-C: the worker is stopped by PID
    # and the DB index flushed on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    from faceflow import samples

    figures = run_celery(
        args.jobs,
        samples.astronaut_jpeg_bytes(),
        samples.grace_hopper_jpeg_bytes(),
        mode=args.mode,
        sleep_ms=args.sleep_ms,
        redis_url=args.redis_url,
        torch_threads=args.torch_threads,
        time_limit_s=args.time_limit,
        keep_dir=args.keep_dir,
        job_work=args.job_work,
    )
    if args.json:
        print(json.dumps(figures, indent=1))
    else:
        for key, value in figures.items():
            print(f"{key:34}{value}")


if __name__ == "__main__":
    main()
