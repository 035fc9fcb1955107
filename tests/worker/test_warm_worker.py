"""The ``faceflow-gpu`` worker against a real Prefect server: warm runs, deadlines,
cancellation, dead children. The runs execute the real pipeline in warm children."""

from __future__ import annotations

import os
import signal
import time
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from tests.worker.conftest import WarmWorker, pid_alive

pytestmark = pytest.mark.prefect


def test_a_run_completes_in_the_warm_child(warm_worker: WarmWorker) -> None:
    before = warm_worker.wait_idle()
    child_pid = before["children"][0]["pid"]
    run_id = warm_worker.submit()
    run = warm_worker.api.wait_final(run_id, timeout=60)
    assert run["state_type"] == "COMPLETED", run["state"]
    report = warm_worker.report(run_id)
    assert report["pid"] == child_pid  # ran inside the pre-started child, not a new process
    assert (warm_worker.out_dir / f"{run_id}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    after = warm_worker.wait_idle()
    assert after["children"][0]["runs_done"] == before["children"][0]["runs_done"] + 1


def test_twenty_runs_load_each_model_once(warm_worker: WarmWorker) -> None:
    warm_worker.wait_idle()
    run_ids = [warm_worker.submit() for _ in range(20)]
    runs = [warm_worker.api.wait_final(run_id, timeout=120) for run_id in run_ids]
    assert [r["state_type"] for r in runs] == ["COMPLETED"] * 20
    reports = [warm_worker.report(run_id) for run_id in run_ids]
    assert len({r["pid"] for r in reports}) == 1
    for report in reports:
        assert report["model_loads"], report
        assert set(report["model_loads"].values()) == {1}, report["model_loads"]
    child = warm_worker.wait_idle()["children"][0]
    assert child["model_loads"] == reports[-1]["model_loads"]


@pytest.mark.parametrize("block_sigterm", [True, False], ids=["sigkill-needed", "sigterm-enough"])
def test_deadline_kills_a_child_blocked_in_c(warm_worker: WarmWorker, block_sigterm: bool) -> None:
    old_pid = warm_worker.wait_idle()["children"][0]["pid"]
    deadline = datetime.now(UTC) + timedelta(seconds=2)
    grace = 0.5
    run_id = warm_worker.submit(
        job_variables={"deadline_grace_seconds": grace},
        deadline_at=deadline.isoformat(),
        c_sleep_s=60,
        block_sigterm=block_sigterm,  # True: only SIGKILL stops it (the escalation)
    )
    warm_worker.wait_started(run_id)
    run = warm_worker.api.wait_message(run_id, "[deadline_exceeded] ", timeout=30)
    assert run["state_type"] == "CRASHED"
    ended = datetime.fromisoformat(run["state"]["timestamp"])
    late = (ended - deadline).total_seconds() - grace
    assert 0 <= late <= 1.0, f"killed {late:.2f} s after deadline + grace"
    assert not pid_alive(old_pid)
    next_id = warm_worker.submit()
    assert warm_worker.api.wait_final(next_id, timeout=120)["state_type"] == "COMPLETED"
    assert warm_worker.report(next_id)["pid"] != old_pid


def test_cancelling_stops_the_running_child(warm_worker: WarmWorker) -> None:
    old_pid = warm_worker.wait_idle()["children"][0]["pid"]
    run_id = warm_worker.submit(c_sleep_s=60)
    warm_worker.wait_started(run_id)
    warm_worker.api.set_state(run_id, "CANCELLING")
    asked = time.monotonic()
    run = warm_worker.api.wait_final(run_id, timeout=10)
    assert run["state_type"] == "CANCELLED", run["state"]
    assert time.monotonic() - asked < 3.0
    assert not pid_alive(old_pid)
    next_id = warm_worker.submit()
    assert warm_worker.api.wait_final(next_id, timeout=120)["state_type"] == "COMPLETED"


def test_a_sigkilled_child_crashes_its_run_within_2_s(warm_worker: WarmWorker) -> None:
    warm_worker.wait_idle()
    run_id = warm_worker.submit(c_sleep_s=60)
    started = warm_worker.wait_started(run_id)
    os.kill(started["pid"], signal.SIGKILL)
    killed = datetime.now(UTC)
    run = warm_worker.api.wait_final(run_id, timeout=10)
    assert run["state_type"] == "CRASHED"
    assert "SIGKILL" in run["state"]["message"]
    ended = datetime.fromisoformat(run["state"]["timestamp"])
    assert (ended - killed).total_seconds() < 2.0
    next_id = warm_worker.submit()
    assert warm_worker.api.wait_final(next_id, timeout=120)["state_type"] == "COMPLETED"


def test_health_reports_readiness_and_telemetry(warm_worker: WarmWorker) -> None:
    status = warm_worker.wait_idle()
    base = f"http://127.0.0.1:{warm_worker.health_port}"
    assert httpx.get(f"{base}/health", timeout=5).status_code == 200
    assert httpx.get(f"{base}/ready", timeout=5).json() == {"ready": True, "idle": 1}
    child = status["children"][0]
    assert child["ready"] and child["alive"]
    assert child["rss_mb"] > 50
    assert child["model_loads"]
    assert child["gpu"]["available"] in (True, False)
    assert "memory_used_mb" in child["gpu"]
