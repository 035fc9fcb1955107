"""Peak and retained memory of a warm worker child on large-image jobs (issue 22, finding 4).

Starts ``prefect server start`` (own PREFECT_HOME, SQLite, 127.0.0.1), saves the default
blocks, stores a flat 8000 x 5000 PNG (≈ 50 KB that decodes to 40 MP, the per-image limit)
and, per job, starts a fresh warm child (``python -m faceflow.worker.child``, as the
``faceflow-gpu`` worker does: models loaded, then ``run_flow``) that runs one ``fuse-faces``
flow run of it. Reports, per job: the child's RSS when ready (models loaded), its peak RSS
during the run (``VmHWM``), its RSS after the run (what it keeps for the next job: the
child's own telemetry) and the run's outcome. Jobs:

- ``amplification``: 8 sources, 8 references and the target, all the 40 MP PNG
  (680 MP together; the finding's job);
- ``large``: source and target of 40 MP (80 MP: within every budget; the flat image has
  no face, so it fails at detection after decoding and moderating both: what a job that
  fails leaves behind).

Run it on a checkout to measure that checkout (copy it into an older one to compare):

    PYTHONPATH=$PWD .venv/bin/python bench/worker_memory.py
    PYTHONPATH=$PWD .venv/bin/python bench/worker_memory.py --jobs amplification --json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.fuse_jobs import job_parameters  # noqa: E402
from faceflow.samples import flat_png  # noqa: E402
from faceflow.testing.inputs import put_input  # noqa: E402
from faceflow.testing.prefect import PrefectRest, start_server  # noqa: E402
from faceflow.testing.procstat import peak_rss_mb  # noqa: E402
from faceflow.worker.protocol import (  # noqa: E402
    ChildSpec,
    Ready,
    RunFinished,
    RunRequest,
    Shutdown,
)
from flows.params import run_tags  # noqa: E402

ENTRYPOINT = "flows/fuse.py:fuse_faces"
JOBS = ("amplification", "large")


def parameters(job: str, key: str) -> dict[str, Any]:
    """``fuse-faces`` parameters of ``job`` (every image is ``key``), bound to the job as
    the relay binds them (``flows.binding``)."""
    if job == "amplification":
        return job_parameters(
            key,
            key,
            extra_source_keys=[key] * 7,
            reference_keys=[key] * 8,
            options={"mapping": [{"source": i, "reference": i} for i in range(8)]},
        )
    return job_parameters(key, key)


def create_run(api: PrefectRest, flow_id: str, params: dict[str, Any]) -> str:
    """A scheduled flow run of ``fuse-faces``, named and tagged as the relay does."""
    body = {
        "flow_id": flow_id,
        "parameters": params,
        "name": params["job_id"],
        "tags": run_tags(params["job_id"], params["owner_id"]),
        "state": {"type": "SCHEDULED"},
    }
    return str(api.call("POST", "/flow_runs/", body)["id"])


def run_in_fresh_child(run_id: str, env: dict[str, str], log: Path) -> dict[str, Any]:
    """Start a warm child, run ``run_id`` in it, read its memory, stop it."""
    parent_sock, child_sock = socket.socketpair()
    with log.open("ab") as out:
        child = subprocess.Popen(
            [sys.executable, "-m", "faceflow.worker.child", "--fd", str(child_sock.fileno())],
            pass_fds=(child_sock.fileno(),),
            env={**os.environ, **env, "PYTHONPATH": str(REPO)},
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    child_sock.close()
    conn = Connection(parent_sock.detach())
    try:
        conn.send(ChildSpec(index=0, working_dir=str(REPO), preload=(ENTRYPOINT,)))
        ready = conn.recv()
        if not isinstance(ready, Ready):
            raise RuntimeError(f"child did not warm up: {ready}")
        ready_peak = peak_rss_mb(child.pid)
        conn.send(RunRequest(run_id, ENTRYPOINT, working_dir=str(REPO)))
        start = time.perf_counter()
        while not isinstance(finished := conn.recv(), RunFinished):
            pass
        return {
            "ready_rss_mb": round(ready.telemetry.rss_mb, 1),
            "ready_peak_rss_mb": round(ready_peak, 1),
            "run_peak_rss_mb": round(peak_rss_mb(child.pid), 1),
            "after_rss_mb": round(finished.telemetry.rss_mb, 1),
            "run_s": round(time.perf_counter() - start, 2),
            "state": finished.state_type,
            "message": (finished.state_message or finished.error or "")[:160],
        }
    finally:
        conn.send(Shutdown())
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", nargs="+", choices=JOBS, default=list(JOBS))
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args()
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        home = Path(tmp)
        server = start_server(home)
        url, env = server.api_url, server.env
        try:
            os.environ.update(env)
            from blocks import init_default_blocks

            saved = init_default_blocks(home / "faceflow")
            data = flat_png(8000, 5000)
            key = put_input(saved.storage_path, data, "png")
            api = PrefectRest(url)
            flow_id = str(api.call("POST", "/flows/", {"name": "fuse-faces"})["id"])
            for job in args.jobs:
                run_id = create_run(api, flow_id, parameters(job, key))
                results[job] = run_in_fresh_child(run_id, env, home / f"child-{job}.log")
        finally:
            server.stop()
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"flat PNG {len(data)} bytes → 40 MP; commit {_commit()}")
    for job, figures in results.items():
        print(
            f"{job:>14}: ready {figures['ready_rss_mb']:.0f} MB, peak {figures['run_peak_rss_mb']:.0f}"
            f" MB, after {figures['after_rss_mb']:.0f} MB, {figures['run_s']:.1f} s, "
            f"{figures['state']}: {figures['message']}"
        )


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    main()
