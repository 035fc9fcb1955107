"""Regression (found by the fault suite, scenario 1): a SIGKILLed faceflow-gpu worker left
its run ``Running`` in Prefect, holding the pool's only slot, so the restarted worker took
nothing until the relay reaped the run at its deadline; the job then ended
``deadline_exceeded`` instead of being retried. A worker restarted under the same name now
marks the runs its dead predecessor had claimed ``Crashed`` (``[worker_lost]``) at start:
the slot is free at once and the relay re-dispatches the job (``tests/worker/
test_relay_redispatch.py`` shows the relay's side for a ``Crashed`` run)."""

from __future__ import annotations

import signal
import time
import uuid
from pathlib import Path

import pytest

from faceflow.testing.wait import poll
from tests.worker.conftest import Api, pid_alive, start_warm_worker

pytestmark = [pytest.mark.prefect, pytest.mark.slow]


def test_a_restarted_worker_crashes_the_run_its_dead_predecessor_left(
    prefect_api: Api, tmp_path: Path
) -> None:
    pool = f"restart-{uuid.uuid4().hex[:6]}"
    env = {"FACEFLOW_WORKER_STATE_DIR": str(tmp_path / "state")}
    first = start_warm_worker(prefect_api, tmp_path, pool, env, name="gpu-host-0")
    second = None
    try:
        prefect_api.call("PATCH", f"/work_pools/{pool}", {"concurrency_limit": 1})
        stuck = first.submit(c_sleep_s=300, fuse=False)
        child_pid = first.wait_started(stuck, timeout=60)["pid"]
        first.service.kill(signal.SIGKILL)  # the worker's group; its child dies with it
        poll(lambda: not pid_alive(child_pid), 10)
        assert not pid_alive(child_pid)
        queued = first.submit(fuse=False)
        time.sleep(3)
        # What Prefect alone makes of it: the run stays Running and holds the only slot.
        assert prefect_api.state(stuck) == "RUNNING"
        assert prefect_api.state(queued) == "SCHEDULED"

        second = start_warm_worker(
            prefect_api, tmp_path, pool, env, name="gpu-host-0", create_pool=False
        )
        crashed = prefect_api.wait_final(stuck, timeout=30)
        assert crashed["state_type"] == "CRASHED", crashed["state"]
        assert crashed["state"]["message"].startswith("[worker_lost]")
        done = prefect_api.wait_final(queued, timeout=60)
        assert done["state_type"] == "COMPLETED", done["state"]
        assert not list((tmp_path / "state").glob("*.json.tmp"))
    finally:
        for worker in (second, first):
            if worker is not None:
                worker.service.stop(grace=15)
