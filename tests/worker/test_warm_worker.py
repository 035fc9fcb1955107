"""The ``faceflow-gpu`` worker against a real Prefect server: warm runs, deadlines,
cancellation, dead children. The runs execute the real pipeline in warm children."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest

from faceflow.testing.prefect import PREFECT
from faceflow.testing.wait import poll
from flows.params import result_key
from tests.worker.conftest import (
    REPO,
    Api,
    WarmWorker,
    fuse_params,
    pid_alive,
    start_warm_worker,
)
from webapi.prefect_api import PrefectAPI, StateType

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


def test_a_child_gives_a_large_run_s_freed_memory_back_to_the_os(
    warm_worker: WarmWorker,
) -> None:
    """A run that held 1,300 MB of heap and freed it under a pinned top: more than the
    child's heap keeps (``heap_keep_mb``, 1,024 MB by default), so the child trims after
    the run (``faceflow.worker.memory``)."""
    run_id = warm_worker.submit(fuse=False, heap_mb=1300)
    run = warm_worker.api.wait_final(run_id, timeout=60)
    assert run["state_type"] == "COMPLETED", run["state"]
    peak = warm_worker.report(run_id)["heap_peak_rss_mb"]
    after = warm_worker.wait_idle()["children"][0]["rss_mb"]
    assert after < peak - 1000, (peak, after)


def test_a_child_keeps_a_small_run_s_freed_memory_for_the_next(warm_worker: WarmWorker) -> None:
    """300 MB freed is under what the heap keeps: the pages stay for the next run (no
    page faults to get them again), the RSS near the run's peak."""
    run_id = warm_worker.submit(fuse=False, heap_mb=300)
    run = warm_worker.api.wait_final(run_id, timeout=60)
    assert run["state_type"] == "COMPLETED", run["state"]
    peak = warm_worker.report(run_id)["heap_peak_rss_mb"]
    after = warm_worker.wait_idle()["children"][0]["rss_mb"]
    assert after > peak - 100, (peak, after)


def test_a_run_finds_the_warm_heap_frozen(warm_worker: WarmWorker) -> None:
    """The warm-up's objects (modules, models, Prefect's client) are in the permanent
    generation before the first run (``faceflow.worker.child.freeze_heap``): a full
    collection in a run then scans only what the runs allocated."""
    run_id = warm_worker.submit(fuse=False)
    run = warm_worker.api.wait_final(run_id, timeout=60)
    assert run["state_type"] == "COMPLETED", run["state"]
    assert warm_worker.report(run_id)["gc_frozen"] > 50_000


@pytest.mark.slow
def test_twenty_fuse_faces_runs_load_each_model_once(
    warm_worker: WarmWorker, inputs: tuple[str, str]
) -> None:
    before = warm_worker.wait_idle()["children"][0]
    runs = [warm_worker.submit_fuse(*inputs) for _ in range(20)]
    finals = [warm_worker.api.wait_final(run_id, timeout=180) for run_id, _ in runs]
    assert [r["state_type"] for r in finals] == ["COMPLETED"] * 20, [r["state"] for r in finals]
    for _, job_id in runs:
        assert (warm_worker.api.home.storage / result_key(job_id, 1, "png")).is_file()
    after = warm_worker.wait_idle()["children"][0]
    assert after["pid"] == before["pid"] and after["starts"] == before["starts"]
    assert after["runs_done"] == before["runs_done"] + 20
    assert after["model_loads"], after
    assert set(after["model_loads"].values()) == {1}, after["model_loads"]  # once per child


def test_fuse_faces_runs_are_named_by_job_and_labelled_by_worker(
    warm_worker: WarmWorker, inputs: tuple[str, str]
) -> None:
    """The child skips Prefect's rename when the relay already named the run by its job id,
    and still renames a run created under another name; the worker's labels land once the
    run is Running; no ``Submitting`` state. A run that the idle child takes at once is
    claimed by its ``Running`` (no ``Pending``; the message names the worker and child); one
    claimed while the child is busy goes Pending → Running → Completed. The second run is
    created once the first left ``Scheduled``: created together, either may reach the
    worker first (their events' reads race on a loaded machine)."""
    before = warm_worker.wait_idle()["claims_on_start"]
    named, job_id = warm_worker.submit_fuse(*inputs)
    assert poll(lambda: warm_worker.api.run(named)["state_type"] != "SCHEDULED", 60, step_s=0.02)
    params = fuse_params(*inputs)
    body = {"parameters": params, "name": "not-the-job-id"}
    path = f"/deployments/{warm_worker.fuse_deployment_id}/create_flow_run"
    other = str(warm_worker.api.call("POST", path, body)["id"])
    for run_id, expected in ((named, job_id), (other, params["job_id"])):
        run = warm_worker.api.wait_final(run_id, timeout=120)
        assert run["state_type"] == "COMPLETED", run["state"]
        assert run["name"] == expected
        states = warm_worker.api.call("GET", f"/flow_run_states/?flow_run_id={run_id}")
        ordered = sorted(states, key=lambda s: s["timestamp"])
        names = [s["name"] for s in ordered]
        if run_id == named:
            assert names == ["Scheduled", "Running", "Completed"], names
            assert ordered[1]["message"].startswith("Started by faceflow-gpu worker ")
        else:
            assert names in (
                ["Scheduled", "Running", "Completed"],
                ["Scheduled", "Pending", "Running", "Completed"],
            ), names
    assert warm_worker.status()["claims_on_start"] >= before + 1
    # labels are written once the run is Running
    poll(lambda: "prefect.worker.name" in warm_worker.api.run(named)["labels"], 10, step_s=0.1)
    labels = warm_worker.api.run(named)["labels"]
    assert labels["prefect.worker.type"] == "faceflow-gpu"
    assert labels["prefect.work-pool.name"]


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
    run = warm_worker.api.wait_final(
        run_id, timeout=30, message_prefix="[deadline_exceeded] ", step_s=0.05
    )
    assert run["state_type"] == "CRASHED"
    ended = datetime.fromisoformat(run["state"]["timestamp"])
    late = (ended - deadline).total_seconds() - grace
    assert 0 <= late <= 1.0, f"killed {late:.2f} s after deadline + grace"
    assert not pid_alive(old_pid)
    next_id = warm_worker.submit()
    assert warm_worker.api.wait_final(next_id, timeout=120)["state_type"] == "COMPLETED"
    assert warm_worker.report(next_id)["pid"] != old_pid


def _cancel_a_running_child(worker: WarmWorker) -> float:
    """Set a run in a warm child Cancelling; seconds until it is Cancelled and the child
    is gone."""
    old_pid = worker.wait_idle()["children"][0]["pid"]
    run_id = worker.submit(c_sleep_s=60)
    worker.wait_started(run_id)
    worker.api.set_state(run_id, "CANCELLING", force=False)
    asked = time.monotonic()
    run = worker.api.wait_final(run_id, timeout=20)
    took = time.monotonic() - asked
    assert run["state_type"] == "CANCELLED", run["state"]
    assert not pid_alive(old_pid)
    return took


def test_cancelling_stops_the_running_child(warm_worker: WarmWorker) -> None:
    assert _cancel_a_running_child(warm_worker) < 3.0
    next_id = warm_worker.submit()
    assert warm_worker.api.wait_final(next_id, timeout=120)["state_type"] == "COMPLETED"


def test_a_cancelling_event_stops_the_child_without_waiting_for_the_state_poll(
    prefect_api: Api, tmp_path: Path
) -> None:
    """Issue 24: the worker reads a supervised run's state as its Cancelling event arrives;
    with the state poll 30 s apart only the event can stop the child within seconds."""
    worker = start_warm_worker(
        prefect_api,
        tmp_path,
        f"events-{uuid.uuid4().hex[:6]}",
        extra_env={"FACEFLOW_WORKER_WATCH_INTERVAL_S": "30"},
    )
    try:
        took = _cancel_a_running_child(worker)
        assert took < 10.0, took
        print(f"\nCancelling -> Cancelled: {took:.2f} s (state poll every 30 s)")
    finally:
        worker.service.stop(grace=15)


def test_a_scheduled_run_is_claimed_from_its_event_not_by_a_pool_poll(
    prefect_api: Api, tmp_path: Path
) -> None:
    """Issue 24: the run a pool's ``Scheduled`` event names is read and claimed at once; no
    poll of the pool stands between the event and ``Pending``. With polls 60 s apart, the
    run is claimed from its event (the worker's counts say how each run was claimed)."""
    worker = start_warm_worker(
        prefect_api,
        tmp_path,
        f"announce-{uuid.uuid4().hex[:6]}",
        extra_env={"FACEFLOW_WORKER_QUERY_SECONDS": "60"},
    )
    try:
        worker.run_claimed_from_its_event()
    finally:
        worker.service.stop(grace=15)


def test_runs_claimed_from_their_events_need_no_poll_and_a_left_one_starts_on_time(
    prefect_api: Api, tmp_path: Path
) -> None:
    """Issue 24: while every run is claimed from its ``Scheduled`` event, a run's end polls
    the pool once and its child turning idle not at all (the periodic poll is 60 s apart
    here, so the count says it all); a
    run announced while no place was open (no prefetch place) still starts as soon as the
    child is free, from the poll its end then makes, not at the next periodic poll."""
    no_prefetch = {"FACEFLOW_WORKER_QUERY_SECONDS": "60", "FACEFLOW_WORKER_PREFETCH_RUNS": "0"}
    pool = f"nopoll-{uuid.uuid4().hex[:6]}"
    worker = start_warm_worker(prefect_api, tmp_path, pool, extra_env=no_prefetch)
    try:
        worker.wait_events_settled()
        before = worker.status()
        for _ in range(3):
            # the run ends on the server before the worker frees its slot: a run submitted
            # in between finds no place (no prefetch) and the run-end poll claims it
            worker.wait_idle()
            run_id = worker.submit(fuse=False)
            assert prefect_api.wait_final(run_id, timeout=60)["state_type"] == "COMPLETED"
        worker.wait_idle()
        after = worker.status()
        assert after["claims"]["event"] == before["claims"]["event"] + 3, (before, after)
        assert after["polls"] - before["polls"] <= 3, (before["polls"], after["polls"])

        busy = worker.submit(c_sleep_s=2, fuse=False)
        worker.wait_started(busy)
        left = worker.submit(fuse=False)  # its event finds the one child busy: left for a poll
        assert prefect_api.wait_final(left, timeout=30)["state_type"] == "COMPLETED"
        gap = worker.report(left)["first_line"] - worker.report(busy)["last_line"]
        assert gap < 5.0, f"the left run started {gap:.2f} s after the child was free"
        assert worker.status()["polls"] > after["polls"]
    finally:
        worker.service.stop(grace=15)


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


def test_a_prefetched_run_waits_for_the_child_or_goes_back_to_the_queue(
    warm_worker: WarmWorker,
) -> None:
    warm_worker.wait_idle()
    before = warm_worker.status()["handovers"]
    quick = warm_worker.submit(c_sleep_s=1, fuse=False)
    warm_worker.wait_started(quick)
    waiting = warm_worker.submit(fuse=False)  # claimed ahead: starts the moment it can
    assert warm_worker.api.wait_final(quick, timeout=30)["state_type"] == "COMPLETED"
    assert warm_worker.api.wait_final(waiting, timeout=30)["state_type"] == "COMPLETED"
    gap = warm_worker.report(waiting)["first_line"] - warm_worker.report(quick)["last_line"]
    assert gap < 1.0, f"the claimed run started {gap:.2f} s after the child was free"
    # no stop event came for it (events live): handed over without reading it again
    poll(lambda: warm_worker.status()["handovers"] != before, 5)  # written once a second
    after = warm_worker.status()["handovers"]
    assert after == {"read": before["read"], "unread": before["unread"] + 1}, (before, after)

    slow = warm_worker.submit(c_sleep_s=12, fuse=False)  # longer than the acquire timeout (8 s)
    warm_worker.wait_started(slow)
    behind = warm_worker.submit(fuse=False)
    assert warm_worker.api.wait_final(behind, timeout=60)["state_type"] == "COMPLETED"
    states = warm_worker.api.call("GET", f"/flow_run_states/?flow_run_id={behind}")
    assert any("Rescheduled by the faceflow-gpu worker" in (s["message"] or "") for s in states)
    assert warm_worker.api.run(slow)["state_type"] == "COMPLETED"


@pytest.mark.parametrize("busy_s", [3, 12], ids=["child-frees", "acquire-times-out"])
def test_a_run_cancelled_while_it_waits_for_a_child_never_starts(
    warm_worker: WarmWorker, busy_s: int
) -> None:
    """A claimed run cancelled before a child was free (the relay's cancel makes a Pending
    run Cancelling) must not reach the child; nor may the acquire timeout's reschedule
    revive it (acquire timeout 8 s). It ends Cancelled and never Running."""
    warm_worker.wait_idle()
    busy = warm_worker.submit(c_sleep_s=busy_s, fuse=False)
    warm_worker.wait_started(busy)
    waiting = warm_worker.submit(fuse=False)
    # claimed ahead, waiting for the child
    claimed = poll(lambda: warm_worker.api.state(waiting) == "PENDING", 20)
    assert claimed, warm_worker.api.run(waiting)["state"]
    with PrefectAPI(warm_worker.api.url) as api:  # what the relay's cancel path does
        run = api.read_flow_runs([waiting])[waiting]
        assert api.cancel_flow_run(run, message="Cancelled by FaceFlow") is StateType.CANCELLING
    assert warm_worker.api.wait_final(busy, timeout=60)["state_type"] == "COMPLETED"
    assert warm_worker.api.wait_final(waiting, timeout=20)["state_type"] == "CANCELLED"
    time.sleep(1.0)  # nothing revives it afterwards
    types = [
        s["type"] for s in warm_worker.api.call("GET", f"/flow_run_states/?flow_run_id={waiting}")
    ]
    assert types[types.index("CANCELLING") :] == ["CANCELLING", "CANCELLED"], types
    assert not (warm_worker.out_dir / f"{waiting}.started.json").exists()


def test_a_run_forced_cancelled_while_it_waits_for_a_child_never_starts(
    warm_worker: WarmWorker,
) -> None:
    """A claimed run forced Cancelled (what the reaper does to a cancel that timed out)
    while it waits for a child: Prefect would let it go back to Running, so its Cancelled
    event must make the worker read it before the hand-over, and it never starts."""
    warm_worker.wait_idle()
    busy = warm_worker.submit(c_sleep_s=3, fuse=False)
    warm_worker.wait_started(busy)
    waiting = warm_worker.submit(fuse=False)
    claimed = poll(lambda: warm_worker.api.state(waiting) == "PENDING", 20)
    assert claimed, warm_worker.api.run(waiting)["state"]
    with PrefectAPI(warm_worker.api.url) as api:
        api.set_state(waiting, StateType.CANCELLED, message="Cancel timed out", force=True)
    assert warm_worker.api.wait_final(busy, timeout=60)["state_type"] == "COMPLETED"
    time.sleep(2.0)  # the child is free: a hand-over would have happened by now
    assert warm_worker.api.state(waiting) == "CANCELLED"
    assert not (warm_worker.out_dir / f"{waiting}.started.json").exists()
    next_id = warm_worker.submit(fuse=False)
    assert warm_worker.api.wait_final(next_id, timeout=60)["state_type"] == "COMPLETED"


def test_a_run_cancelled_as_it_ends_is_cancelled_not_left_cancelling(
    prefect_api: Api, tmp_path: Path
) -> None:
    """A cancel that lands as the run finishes, before the worker has seen it (no events,
    state poll 30 s apart): Prefect refuses the engine's Completed for a Cancelling run, so
    the child's report is what tells the worker to end it Cancelled (it stayed Cancelling
    before, and a video job's cancelled parts never became final)."""
    worker = start_warm_worker(
        prefect_api,
        tmp_path,
        f"ends-{uuid.uuid4().hex[:6]}",
        extra_env={"FACEFLOW_WORKER_WATCH_INTERVAL_S": "30", "FACEFLOW_WORKER_EVENT_PICKUP": "0"},
    )
    try:
        worker.wait_idle()
        run_id = worker.submit(fuse=False, cancel_at_end=True)
        run = worker.api.wait_final(run_id, timeout=20)
        assert run["state_type"] == "CANCELLED", run["state"]
        assert "as the faceflow-gpu child ended the run" in run["state"]["message"]
        assert worker.report(run_id)["last_line"]  # the flow did run to its end
    finally:
        worker.service.stop(grace=15)


def test_prefect_refuses_to_start_a_claimed_run_that_is_cancelling(prefect_api: Api) -> None:
    """What ``cancel_flow_run`` relies on for a Pending run: the engine's Running is
    refused, the flow's code never runs, and the engine returns the Cancelling state
    (which the worker then makes Cancelled). A Cancelled run would have started."""
    from prefect.client.orchestration import get_client
    from prefect.flow_engine import run_flow
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.states import Cancelling, Pending

    from tests.worker.probe_flow import warm_probe

    calls: list[str] = []
    probe = warm_probe.with_options(on_running=[lambda *_: calls.append("running")])
    settings = temporary_settings({PREFECT_API_URL: prefect_api.url})
    with settings, get_client(sync_client=True) as client:
        run = client.create_flow_run(probe, parameters={"out_dir": "/nonexistent"})
        client.set_flow_run_state(run.id, Pending(), force=True)
        client.set_flow_run_state(run.id, Cancelling(), force=True)
        state = run_flow(probe, flow_run=client.read_flow_run(run.id), return_type="state")
    assert state.type.value == "CANCELLING" and calls == []  # type: ignore[union-attr]
    assert prefect_api.state(str(run.id)) == "CANCELLING"


def test_faceflow_worker_status_command(warm_worker: WarmWorker) -> None:
    from typer.testing import CliRunner

    from faceflow.worker.cli import app

    warm_worker.wait_idle()
    result = CliRunner().invoke(app, ["status", "--port", str(warm_worker.health_port)])
    assert result.exit_code == 0, result.output
    assert "ready=True" in result.output and "child 0: idle" in result.output


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
    assert "memory_used_mb" in child["gpu"] and "process_memory_mb" in child["gpu"]
    if not child["gpu"]["available"]:
        assert child["gpu"]["process_memory_mb"] is None


@pytest.fixture(scope="module")
def recycling_worker(
    prefect_api: Api, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WarmWorker]:
    """A second worker, started by ``faceflow worker start``, whose child is recycled after
    two runs; the drain test stops it."""
    tmp = tmp_path_factory.mktemp("recycling")
    extra = {
        "FACEFLOW_WORKER_MAX_RUNS_PER_CHILD": "2",
        "FACEFLOW_WORKER_DRAIN_GRACE_S": "20",
        "FACEFLOW_WORKER_PREFETCH_RUNS": "0",  # so a queued run stays queued while draining
    }
    pool = f"recycle-{uuid.uuid4().hex[:6]}"
    worker = start_warm_worker(prefect_api, tmp, pool, extra, via_faceflow_cli=True)
    try:
        yield worker
    finally:
        worker.service.stop(grace=15)


@pytest.mark.slow
def test_child_is_recycled_after_max_runs(recycling_worker: WarmWorker) -> None:
    pids = []
    for _ in range(3):
        run_id = recycling_worker.submit(fuse=False)
        assert recycling_worker.api.wait_final(run_id, timeout=120)["state_type"] == "COMPLETED"
        pids.append(recycling_worker.report(run_id)["pid"])
    assert pids[0] == pids[1] != pids[2]
    assert not pid_alive(pids[0])
    assert recycling_worker.wait_idle()["children"][0]["starts"] == 2


@pytest.mark.slow
def test_sigterm_drains_the_running_run_then_exits(recycling_worker: WarmWorker) -> None:
    child_pid = recycling_worker.wait_idle()["children"][0]["pid"]
    running = recycling_worker.submit(c_sleep_s=3, fuse=False)
    recycling_worker.wait_started(running)
    queued = recycling_worker.submit(fuse=False)
    process = recycling_worker.service.process
    assert process is not None
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0  # exits on its own once the run is done
    assert recycling_worker.api.run(running)["state_type"] == "COMPLETED"
    assert recycling_worker.api.state(queued) == "SCHEDULED"  # not taken while draining
    assert not pid_alive(child_pid)


def test_prefect_cli_creates_a_faceflow_gpu_pool_from_the_template(prefect_api: Api) -> None:
    pool = f"cli-{uuid.uuid4().hex[:6]}"
    template = REPO / "work_pools" / "faceflow-gpu.json"
    argv = [PREFECT, "work-pool", "create", pool, "--type", "faceflow-gpu"]
    argv += ["--base-job-template", str(template)]
    done = subprocess.run(
        argv, env=prefect_api.server.env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    stored = prefect_api.call("GET", f"/work_pools/{pool}")
    assert stored["type"] == "faceflow-gpu"
    assert stored["base_job_template"] == json.loads(template.read_text())
