"""bench/celery_queue.py end to end on the local Redis, in mode sleep (no models): the
script runs as a subprocess, as a user runs it, and its ``--json`` figures are checked."""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("celery", reason="celery is not installed (bench extra: `make bench-setup`)")

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
REDIS = ("127.0.0.1", 6379)
TEST_REDIS_URL = "redis://127.0.0.1:6379/14"  # a DB index of its own (flushed by the bench)


@pytest.fixture
def redis_up() -> None:
    try:
        socket.create_connection(REDIS, timeout=2).close()
    except OSError as exc:
        pytest.skip(f"Redis is not reachable on {REDIS[0]}:{REDIS[1]}: {exc}")


@pytest.mark.usefixtures("redis_up")
def test_sleep_mode_figures_are_sane() -> None:
    argv = [sys.executable, str(REPO / "bench" / "celery_queue.py"), "--jobs", "3"]
    argv += ["--mode", "sleep", "--sleep-ms", "5", "--redis-url", TEST_REDIS_URL, "--json"]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout)
    assert figures["failed"] == 0, figures["first_failure"]
    assert figures["burst_results"] == 3
    assert isinstance(figures["burst_jobs_per_min"], float) and figures["burst_jobs_per_min"] > 0
    for key in ("seq_e2e_median_ms", "seq_queue_median_ms", "seq_compute_median_ms"):
        value = figures[key]
        assert isinstance(value, float) and math.isfinite(value) and value >= 0, key
    assert figures["seq_e2e_median_ms"] >= figures["seq_compute_median_ms"] >= 5
    cpu = [key for key in figures if key.startswith("cpu_") and key != "cpu_other_ms_per_job"]
    assert {"cpu_worker_ms_per_job", "cpu_redis_ms_per_job"} <= set(cpu)
    for key in cpu:
        assert isinstance(figures[key], float) and figures[key] >= 0, key
