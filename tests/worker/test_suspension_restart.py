"""Regression (found by the fault suite, scenario 2): Prefect's ``FlowRunSuspendingObserver``
gives up for good after an API outage of about 30 s ("Service exceeded error threshold"),
and the warm child's shared observer then stayed dead, so external suspension failed for
the rest of the child's life. It now starts a fresh observer and re-registers the runs in
flight. The failure is delivered the way Prefect delivers it: the observer's own
``_handle_unavailable`` (what its polling fallback calls when it gives up)."""

from __future__ import annotations

import uuid

import pytest

from faceflow.testing.wait import wait_for
from faceflow.worker.suspension import SharedSuspensionObserver
from tests.worker.conftest import Api

pytestmark = pytest.mark.prefect


def test_the_shared_suspension_observer_restarts_after_prefects_gives_up(
    prefect_api: Api,
) -> None:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: prefect_api.server.api_url}):
        shared = SharedSuspensionObserver(restart_delay_s=0.1)
        assert shared.start()
    run_id = uuid.uuid4()
    with shared.observe(run_id, suspension_request=object()):
        wait_for(lambda: run_id in shared.in_flight(), 20)
        first = shared._observer
        first._handle_unavailable(RuntimeError("Service exceeded error threshold."))
        wait_for(lambda: shared._observer not in (None, first) and run_id in shared.in_flight(), 20)
        assert shared.starts == 2
    wait_for(lambda: run_id not in shared.in_flight(), 20)
