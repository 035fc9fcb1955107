"""The deferred progress artifact is written from a timer thread with the run's Prefect
settings, also where they live only in the caller's context (``temporary_settings``: tests,
the in-process benchmark, any program embedding a flow run), not in the environment.

Regression (found in ``bench/warm_worker.py``'s in-process loop): the bare timer thread
emitted the artifact's event with the process's default settings; with no
``PREFECT_API_URL`` there Prefect started a temporary server in the process for it.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.context import FlowRunContext
from prefect.events.worker import EventsWorker
from prefect.settings import PREFECT_API_URL, get_current_settings, temporary_settings

from faceflow.testing.prefect import PrefectServer
from flows.artifacts import PROGRESS_DELAY_S, DeferredProgress

pytestmark = pytest.mark.prefect


def test_the_progress_timer_writes_with_the_callers_prefect_settings(
    prefect_server: PrefectServer,
) -> None:
    seen: list[str | None] = []

    @flow(name="progress-context", persist_result=False)
    def shows_progress() -> str:
        run = FlowRunContext.get()
        assert run is not None and run.flow_run is not None
        progress = DeferredProgress(
            get_client(sync_client=True), run.flow_run.id, "progress-context-test"
        )
        write = progress._write

        def recording_write(value: float, description: str) -> None:
            seen.append(get_current_settings().api.url)  # what this thread talks to
            write(value, description)

        progress._write = recording_write  # type: ignore[method-assign]
        progress.show(50.0, "Stage 1/2: halfway.")
        time.sleep(PROGRESS_DELAY_S + 0.5)  # the timer thread writes meanwhile
        progress.close(100.0, "Finished: succeeded.")
        return str(run.flow_run.id)

    # Prefect keeps one events worker per client type, bound to the API URL it first saw:
    # start this test with none and leave none, so events go to this test's server and the
    # harness tests after it get their own.
    EventsWorker.drain_all(timeout=5, at_exit=False)
    try:
        with temporary_settings({PREFECT_API_URL: prefect_server.api_url}):
            run_id = shows_progress()
            with get_client(sync_client=True) as client:
                artifacts: list[Any] = client.read_artifacts()
    finally:
        EventsWorker.drain_all(timeout=5, at_exit=False)
    assert seen == [prefect_server.api_url, prefect_server.api_url]  # timer, then close
    mine = [a for a in artifacts if str(a.flow_run_id) == run_id]
    assert [(a.key, a.data) for a in mine] == [("progress-context-test", 100.0)]
