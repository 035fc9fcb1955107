"""A job whose warm child is SIGKILLed mid-run: the worker marks the run Crashed within
2 s, the webapi's relay re-dispatches attempt 2, and a fresh child completes it."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from faceflow.testing.wait import poll_value
from flows.params import DEPLOYMENT_NAME, FLOW_NAME, result_key
from tests.worker.conftest import FUSE_ENTRYPOINT, Api, WarmWorker, live_relay

pytestmark = [pytest.mark.prefect, pytest.mark.slow]


@pytest.fixture
def relay(prefect_api: Api, warm_worker: WarmWorker, tmp_path: Path) -> Iterator[Any]:
    """The webapi's relay on a fresh SQLite job store, sharing the flow's local storage;
    ``fuse-faces/fuse-faces`` is deployed into the warm worker's pool."""
    prefect_api.deploy(FLOW_NAME, FUSE_ENTRYPOINT, warm_worker.pool, name=DEPLOYMENT_NAME)
    with live_relay(prefect_api, tmp_path) as instance:
        yield instance


def _stop_child_while_running(api: Api, run_id: str, pid: int) -> bool:
    """Freeze the child (SIGSTOP) as soon as the run is RUNNING; False if it ended first."""
    seen = ("RUNNING", "COMPLETED", "FAILED", "CRASHED", "CANCELLED")
    state = poll_value(lambda: s if (s := api.state(run_id)) in seen else None, 60, step_s=0.005)
    if state is None:
        raise AssertionError(f"run {run_id} never started")
    if state != "RUNNING":
        return False
    os.kill(pid, signal.SIGSTOP)
    return api.state(run_id) == "RUNNING"


def test_sigkilled_child_is_crashed_then_redispatched(
    relay: Any, prefect_api: Api, warm_worker: WarmWorker
) -> None:
    from faceflow.testing.jobs import make_user
    from faceflow.testing.relay import job, submit
    from webapi.models import JobStatus
    from webapi.relay import dispatch, reap, sync

    owner = make_user(relay.engine, relay.settings, quota=100)
    for _ in range(3):  # a run too quick to catch mid-flight is simply tried again
        pid = warm_worker.wait_idle()["children"][0]["pid"]
        new = submit(relay.engine, relay.settings, relay.store, owner)
        dispatch.run_once(relay)
        first_run = str(job(relay.engine, new.id).flow_run_id)
        if _stop_child_while_running(prefect_api, first_run, pid):
            break
        prefect_api.wait_final(first_run, timeout=60)
    else:
        pytest.fail("could not catch a run mid-flight")

    os.kill(pid, signal.SIGKILL)
    killed = time.time()
    crashed = prefect_api.wait_final(first_run, timeout=10)
    assert crashed["state_type"] == "CRASHED", crashed["state"]
    assert "SIGKILL" in crashed["state"]["message"]
    ended = datetime.fromisoformat(crashed["state"]["timestamp"]).timestamp()
    assert ended - killed < 2.0

    sync.run_once(relay)
    assert reap.run_once(relay) >= 1
    assert job(relay.engine, new.id).status is JobStatus.queued
    dispatch.run_once(relay)
    second = job(relay.engine, new.id)
    assert second.attempts == 2 and str(second.flow_run_id) != first_run
    final = prefect_api.wait_final(str(second.flow_run_id), timeout=180)
    assert final["state_type"] == "COMPLETED", final["state"]
    sync.run_once(relay)
    done = job(relay.engine, new.id)
    assert done.status is JobStatus.succeeded, (done.status, done.error_code)
    assert (prefect_api.home.storage / result_key(str(new.id), 2, "png")).is_file()
