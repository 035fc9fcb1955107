"""``bench/video.py --workers 1,2``: one video job fanned out over 1, 2, … warm GPU workers.

Starts ``prefect server start`` (own PREFECT_HOME, SQLite, 127.0.0.1), saves the default
blocks, stores the source photo and the clip, deploys ``video-analyse`` and
``video-render`` (``fuse-video-part``) into one ``faceflow-gpu`` pool and, per worker
count, starts that many warm workers (one child each, stopped by PID) and runs the
``fuse-video`` coordinator in this process (as the control worker would). Chunks are
deleted between counts (and analysed ranges), so each does all the work.

``--gpu-frame-ms`` makes every rendered frame's compute a fixed sleep on the workers
(``FACEFLOW_BENCH_VIDEO_FRAME_MS``, installed by ``bench/gpu_shaped_site``): decode and
encode stay real, the frame's face stages become what a GPU would leave on the CPU.
``--gpu-detect-ms`` does the same for each analysed frame's detection
(``FACEFLOW_BENCH_VIDEO_DETECT_MS``; no face found, the signature real). Prints
per worker count the probe part's time, the analysis span (first range part's start →
last one's end, from Prefect's timestamps), the plan part's time, the render span (the
same for the render parts), the whole job's wall time, the ranges and chunks each
worker child ran, and the times to first progress (the coordinator's record first showing
frames analysed, then frames done). Asserts nothing.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time
import uuid
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx

from bench import gpu_shaped
from bench.fuse_jobs import ts
from faceflow.supervisor import Service
from faceflow.testing.inputs import put_input
from faceflow.testing.net import free_port, http_ok
from faceflow.testing.prefect import PREFECT, PrefectServer, start_server
from faceflow.testing.wait import wait_for
from flows.binding import signed_parameters, worker_keys
from flows.params import (
    VIDEO_ANALYSE_DEPLOYMENT,
    VIDEO_PART_FLOW_NAME,
    VIDEO_RENDER_DEPLOYMENT,
    progress_key,
    video_parts_tag,
)

REPO = Path(__file__).resolve().parents[1]
FRAME_MS_ENV = "FACEFLOW_BENCH_VIDEO_FRAME_MS"
PART_ENTRYPOINT = "flows/video_parts.py:fuse_video_part"


def install_frame_ms(ms: float) -> None:
    """Every frame ``tasks.video.render`` fuses becomes a ``ms`` sleep (the GIL released,
    as by a GPU kernel) and passes unchanged: decode and encode stay real."""
    from collections.abc import Iterable, Iterator

    from tasks import video

    def render(frames: Iterable[tuple[int, Any]], *args: Any) -> Iterator[tuple[int, Any]]:
        for index, frame in frames:
            time.sleep(ms / 1000.0)
            yield index, frame

    video.render = render  # type: ignore[assignment]


DETECT_MS_ENV = "FACEFLOW_BENCH_VIDEO_DETECT_MS"


def install_detect_ms(ms: float) -> None:
    """Every frame ``tasks.video.analyse`` analyses becomes a ``ms`` sleep (its detection, as
    on a GPU) with no face; its signature (scene cuts) stays real, as does the decode."""
    from collections.abc import Callable, Iterable

    from tasks import video
    from tasks.video_plan import frame_signature

    def analyse(
        frames: Iterable[Any],
        options: Any,
        ctx: Any,
        analysis: Any,
        analysed: Callable[[int], None] = lambda frames: None,
    ) -> Any:
        for frame in frames:
            time.sleep(ms / 1000.0)
            analysis.faces.append([])
            analysis.signatures.append(frame_signature(frame))
            analysed(1)  # the progress
        return analysis

    video.analyse = analyse  # type: ignore[assignment]


def start_workers(
    server: PrefectServer, pool: str, count: int, home: Path, env: dict[str, str]
) -> list[Service]:
    """``count`` warm workers (one child each) on ``pool``, each ready."""
    started = []
    for index in range(count):
        port = free_port()
        worker_env = {
            **server.env,
            "PREFECT_WORKER_QUERY_SECONDS": "1",
            "PREFECT_WORKER_PREFETCH_SECONDS": "1",
            "FACEFLOW_WORKER_HEALTH_PORT": str(port),
            "FACEFLOW_WORKER_PRELOAD": json.dumps([PART_ENTRYPOINT]),
            **env,
        }
        argv = [PREFECT, "worker", "start", "--pool", pool, "--type", "faceflow-gpu"]
        argv += ["--name", f"gpu-{index}", "--limit", "1"]
        service = Service(f"worker-{index}", argv, log=home / f"worker-{count}-{index}.log",
                          env=worker_env, cwd=REPO)  # fmt: skip
        service.start()
        started.append(service)
        ready = http_ok(f"http://127.0.0.1:{port}/ready")
        wait_for(ready, 300, step_s=0.2, what="warm worker", ignore=(httpx.HTTPError,))
    return started


class FirstProgress(threading.Thread):
    """Reads a job attempt's progress record every 0.1 s: when it first showed frames
    analysed and frames done (seconds after ``started``), as the relay would copy it."""

    def __init__(self, path: Path, started: float) -> None:
        super().__init__(daemon=True)
        self.path, self.started, self.stop = path, started, threading.Event()
        self.first: dict[str, float] = {}

    def run(self) -> None:
        from flows.params import JobProgress

        while not self.stop.wait(0.1):
            try:
                record = JobProgress.model_validate_json(self.path.read_bytes())
            except (OSError, ValueError):  # not written yet, or being rewritten
                continue
            for name in ("frames_analysed", "frames_done"):
                if getattr(record, name) > 0 and name not in self.first:
                    self.first[name] = round(time.perf_counter() - self.started, 1)


def one_job(
    server: PrefectServer, keys: tuple[str, str], chunk_s: float, storage: Path
) -> dict[str, Any]:
    """The coordinator in this process on a fresh job; its figures."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.video import fuse_video_flow

    params = signed_parameters(
        {
            "job_id": str(uuid.uuid4()),
            "owner_id": "bench",
            "source_key": keys[0],
            "target_key": keys[1],
            "deadline_at": datetime.now(UTC) + timedelta(minutes=30),
        },
        worker_keys()[0],
    )
    started = time.perf_counter()
    watch = FirstProgress(storage / progress_key(params["job_id"], 1), started)
    watch.start()
    with temporary_settings({PREFECT_API_URL: server.api_url}):
        state = fuse_video_flow(**params, chunk_s=chunk_s, return_state=True)
    wall = time.perf_counter() - started
    watch.stop.set()
    if not state.is_completed():
        raise SystemExit(f"the job failed: {state.message}")
    body = {"flow_runs": {"tags": {"all_": [video_parts_tag(params["job_id"], 1)]}}, "limit": 200}
    parts = server.rest.call("POST", "/flow_runs/filter", body)
    renders = [r for r in parts if "-chunk-" in r["name"]]
    ranges = [r for r in parts if "-analyse-" in r["name"]]
    (probe,) = [r for r in parts if r["name"].endswith("-probe")]
    (plan,) = [r for r in parts if r["name"].endswith("-plan")]
    return {
        "job_s": round(wall, 1),
        "probe_s": round(ts(probe["end_time"]) - ts(probe["start_time"]), 1),
        "analysis_span_s": span(ranges),
        "plan_s": round(ts(plan["end_time"]) - ts(plan["start_time"]), 1),
        "render_span_s": span(renders),
        "ranges_per_child": per_child(ranges),
        "chunks_per_child": per_child(renders),
        "first_analysis_progress_s": watch.first.get("frames_analysed"),
        "first_progress_s": watch.first.get("frames_done"),
    }


def span(runs: list[dict[str, Any]]) -> float:
    """First run's start → last run's end, seconds (Prefect's timestamps)."""
    start = min(ts(r["start_time"]) for r in runs)
    return round(max(ts(r["end_time"]) for r in runs) - start, 1)


def per_child(runs: list[dict[str, Any]]) -> list[int]:
    """How many of ``runs`` each worker child ran (their messages end with its pid)."""
    counted = Counter(r["state"]["message"].rsplit(" ", 1)[1] for r in runs)
    return sorted(counted.values(), reverse=True)


def run(
    clip: Path,
    counts: list[int],
    chunk_s: float,
    frame_ms: float | None,
    detect_ms: float | None = None,
) -> None:
    """The fan-out bench (see the module docstring); prints one line per worker count."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from blocks import init_default_blocks
    from faceflow import samples

    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        server = start_server(home / "prefect")
        try:
            with temporary_settings(updates={PREFECT_API_URL: server.api_url}):
                saved = init_default_blocks(home / "faceflow")
            storage = saved.storage_path
            keys = (put_input(storage, samples.grace_hopper_jpeg_bytes()),
                    put_input(storage, clip.read_bytes(), "mp4"))  # fmt: skip
            pool = f"bench-video-{uuid.uuid4().hex[:6]}"
            template = json.loads((REPO / "work_pools" / "faceflow-gpu.json").read_text())
            server.rest.create_pool(pool, "faceflow-gpu", template)
            for name in (VIDEO_ANALYSE_DEPLOYMENT, VIDEO_RENDER_DEPLOYMENT):
                server.rest.deploy(VIDEO_PART_FLOW_NAME, PART_ENTRYPOINT, pool, name=name)
            env = {"PYTHONPATH": f"{REPO / 'bench' / gpu_shaped.SITE}:{REPO}"}
            if frame_ms:
                env[FRAME_MS_ENV] = str(frame_ms)
            if detect_ms:
                env[DETECT_MS_ENV] = str(detect_ms)
            results = {}
            for count in counts:
                for stored in ("video-chunks", "video-analysis"):  # each count does it all
                    shutil.rmtree(storage / stored, ignore_errors=True)
                workers = start_workers(server, pool, count, home, env)
                try:
                    results[count] = one_job(server, keys, chunk_s, storage)
                finally:
                    for worker in workers:
                        worker.stop(grace=15)
                print(f"workers={count}: {json.dumps(results[count])}", flush=True)
            if 1 in results:
                for count, figures in results.items():
                    one = results[1]
                    gains = ", ".join(
                        f"{what} {one[key] / figures[key]:.2f}x"
                        for what, key in (("analysis span", "analysis_span_s"),
                                          ("render span", "render_span_s"), ("whole job", "job_s"))
                    )  # fmt: skip
                    print(f"workers={count}: {gains} faster")
        finally:
            server.stop(grace=10)
