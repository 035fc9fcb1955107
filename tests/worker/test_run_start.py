"""The engine's PATCH and re-read at a run's start leave its path (``run_start``), and the
run ends as Prefect's own requests leave it: flow version, retry policy, run count, states."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import pytest
from prefect import flow
from prefect.client.orchestration import SyncPrefectClient
from prefect.context import FlowRunContext, SyncClientContext
from prefect.flow_engine import run_flow
from prefect.settings import temporary_settings
from prefect.states import Cancelling

from faceflow.worker.run_start import RunStart, engine_shape_known, start_blocked_by
from tests.worker.conftest import Api, in_process_settings

pytestmark = pytest.mark.prefect

SEEN: list[dict[str, Any]] = []


@flow(name="start-probe", persist_result=False, retries=2, retry_delay_seconds=1)
def start_probe(fail_first: bool = False) -> None:
    context = FlowRunContext.get()
    assert context is not None
    run = context.flow_run
    assert run is not None and run.state is not None
    SEEN.append(
        {
            "run_count": run.run_count,
            "flow_version": run.flow_version,
            "retries": run.empirical_policy.retries,
            "start_time": run.start_time,
            "state_id": run.state_id,
            "state_type": run.state.type.value,
        }
    )
    if fail_first and run.run_count == 1:
        raise RuntimeError("first attempt fails")


COUNTED = ("update_flow_run", "read_flow_run", "set_flow_run_state")


class Request(NamedTuple):
    """One request of the sync client: its method, its run, what it says (a state type)."""

    method: str
    run_id: Any
    label: str


def of(calls: list[Request], method: str) -> list[Any]:
    """The run ids of the ``method`` requests among ``calls``."""
    return [call.run_id for call in calls if call.method == method]


@contextmanager
def counted_requests(cancel_once_running: bool = False) -> Iterator[list[Request]]:
    """Every PATCH, read and state proposal the sync client sends, in the order sent; with
    ``cancel_once_running``, the run is forced ``Cancelling`` as soon as its ``Running`` is
    accepted (a cancellation landing before the flow's first line)."""
    calls: list[Request] = []
    originals = {name: getattr(SyncPrefectClient, name) for name in COUNTED}

    def wrap(name: str) -> Any:
        def counted(self: Any, flow_run_id: Any, *a: Any, **k: Any) -> Any:
            state = f" {a[0].type.value}" if name == "set_flow_run_state" else ""
            calls.append(Request(name, flow_run_id, name + state))
            result = originals[name](self, flow_run_id, *a, **k)
            if cancel_once_running and name == "set_flow_run_state" and a[0].is_running():
                originals[name](self, flow_run_id, Cancelling(), force=True)
            return result

        return counted

    try:
        for name in COUNTED:
            setattr(SyncPrefectClient, name, wrap(name))
        yield calls
    finally:
        for name, original in originals.items():
            setattr(SyncPrefectClient, name, original)


def deployment_run(
    api: Api, deployment_id: str, client: SyncPrefectClient, **parameters: Any
) -> Any:
    """A run of the probe's deployment as the worker hands it over (read after creation)."""
    body = {"parameters": parameters}
    run_id = api.call("POST", f"/deployments/{deployment_id}/create_flow_run", body)["id"]
    return client.read_flow_run(uuid.UUID(run_id))


@pytest.fixture(scope="module")
def probe_deployment(prefect_api: Api) -> str:
    flow_id = prefect_api.call("POST", "/flows/", {"name": "start-probe"})["id"]
    body = {"name": f"start-probe-{uuid.uuid4().hex[:6]}", "flow_id": flow_id}
    return str(prefect_api.call("POST", "/deployments/", body)["id"])


def run_both_ways(
    api: Api, deployment_id: str, cancel_once_running: bool = False, **parameters: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One run through Prefect's own start, one through ``RunStart``: for each, what the
    flow saw, what the server holds after, the client's requests for it and its states."""
    out: list[dict[str, Any]] = []
    with (
        temporary_settings(updates=in_process_settings(api)),
        SyncClientContext.get_or_create() as ctx,
    ):
        client = ctx.client  # the engine's client, as in a warm child
        for lean in (False, True):
            run = deployment_run(api, deployment_id, client, **parameters)
            SEEN.clear()
            with counted_requests(cancel_once_running) as calls:
                start = RunStart(client, run)
                with start.installed() if lean else contextlib.nullcontext():
                    state = run_flow(start_probe, flow_run=run, return_type="state")
            held = client.read_flow_run(run.id)
            history = [s.type.value for s in client.read_flow_run_states(run.id)]
            out.append(
                {
                    "state": state.type.value,  # type: ignore[union-attr]
                    "seen": SEEN[0] if SEEN else None,
                    "attempts": [(s["run_count"], s["state_type"]) for s in SEEN],
                    "held": held,
                    "history": history,
                    "sent": {n: of(calls, n).count(run.id) for n in COUNTED},
                    "sequence": [call.label for call in calls if call.run_id == run.id],
                    "start": start.sent,
                }
            )
    return out[0], out[1]


def test_the_engine_shape_is_the_one_run_start_knows() -> None:
    assert engine_shape_known()  # a Prefect release that reshapes it fails here, not in prod


def test_a_run_starts_without_the_engines_patch_and_re_read_and_ends_the_same(
    prefect_api: Api, probe_deployment: str
) -> None:
    prefect, lean = run_both_ways(prefect_api, probe_deployment)
    assert prefect["sent"]["read_flow_run"] == 1 and prefect["sent"]["update_flow_run"] == 1
    # the PATCH still goes out (beside the run), the re-read not at all
    assert lean["sent"]["read_flow_run"] == 0 and lean["sent"]["update_flow_run"] == 1
    assert lean["start"] == {"patch_skipped": 0, "patch_background": 1, "read_local": 1}
    # Prefect's PATCH precedes Running; the lean start sends it once Running is answered,
    # so the two do not meet on the server while the run is being started
    assert prefect["sequence"][:2] == ["update_flow_run", "set_flow_run_state RUNNING"]
    assert lean["sequence"][:2] == ["set_flow_run_state RUNNING", "update_flow_run"]
    for arm in (prefect, lean):
        held = arm["held"]
        assert arm["state"] == "COMPLETED" and arm["history"] == [
            "SCHEDULED",
            "RUNNING",
            "COMPLETED",
        ]
        assert held.flow_version == start_probe.version  # what Prefect sets
        assert held.empirical_policy.retries == 2 and held.empirical_policy.retry_delay == 1
        assert held.run_count == 1
        seen = arm["seen"]
        assert seen["run_count"] == 1 and seen["flow_version"] == start_probe.version
        assert seen["retries"] == 2 and seen["state_type"] == "RUNNING"
        assert seen["start_time"] == held.start_time
        assert seen["state_id"] is not None
    assert prefect["seen"].keys() == lean["seen"].keys()


def test_a_run_that_carries_its_version_and_policy_sends_no_patch(
    prefect_api: Api, probe_deployment: str
) -> None:
    with (
        temporary_settings(updates=in_process_settings(prefect_api)),
        SyncClientContext.get_or_create() as ctx,
    ):
        client = ctx.client
        run = deployment_run(prefect_api, probe_deployment, client)
        policy = run.empirical_policy.model_copy(update={"retries": 2, "retry_delay": 1})
        client.update_flow_run(run.id, flow_version=start_probe.version, empirical_policy=policy)
        run = client.read_flow_run(run.id)  # as a run dispatched again carries them
        with counted_requests() as calls:
            start = RunStart(client, run)
            with start.installed():
                state = run_flow(start_probe, flow_run=run, return_type="state")
    assert state.type.value == "COMPLETED"  # type: ignore[union-attr]
    assert of(calls, "update_flow_run") == [] and of(calls, "read_flow_run") == []
    assert start.sent == {"patch_skipped": 1, "patch_background": 0, "read_local": 1}


def test_a_run_cancelled_as_it_starts_ends_as_with_prefects_re_read(
    prefect_api: Api, probe_deployment: str
) -> None:
    """A cancellation that lands between ``Running`` and the flow's first line, where
    Prefect's re-read would read it: the run ends the same either way (the server refuses
    the engine's ``Completed``; in a warm child the worker also kills the child)."""
    prefect, lean = run_both_ways(prefect_api, probe_deployment, cancel_once_running=True)
    assert lean["start"]["read_local"] == 1
    assert prefect["held"].state_type.value == lean["held"].state_type.value
    assert prefect["history"] == lean["history"], (prefect["history"], lean["history"])
    assert prefect["state"] == lean["state"]
    assert "CANCELLING" in lean["history"]


def test_a_retried_run_counts_its_attempts_as_with_prefects_re_read(
    prefect_api: Api, probe_deployment: str
) -> None:
    """The first attempt fails: the server retries it by the policy the PATCH wrote (joined
    before ``Failed`` is proposed) and the retry's re-read goes to the server."""
    prefect, lean = run_both_ways(prefect_api, probe_deployment, fail_first=True)
    assert lean["start"]["read_local"] == 1 and lean["sent"]["read_flow_run"] == 1
    for arm in (prefect, lean):
        assert arm["state"] == "COMPLETED", arm["history"]
        assert arm["attempts"] == [(1, "RUNNING"), (2, "RUNNING")]
        assert arm["held"].run_count == 2
    assert prefect["history"] == lean["history"]


def _history(*kinds: tuple[str, str]) -> list[Any]:
    """States of one run a millisecond apart, as Prefect's server stamped them: (type,
    message) each."""
    from datetime import UTC, datetime, timedelta

    from prefect.client.schemas.objects import State, StateType

    start = datetime.now(UTC)
    return [
        State(type=StateType(kind), message=message, timestamp=start + timedelta(milliseconds=i))
        for i, (kind, message) in enumerate(kinds)
    ]


def test_a_claim_is_a_first_start_only_when_nothing_but_pending_came_since_scheduled() -> None:
    states = _history(("SCHEDULED", ""), ("PENDING", "held by a"), ("RUNNING", "claim b"))
    assert start_blocked_by(states, states[-1]) is None
    rerun = _history(
        ("SCHEDULED", ""),
        ("RUNNING", "a"),
        ("COMPLETED", "done by a"),
        ("SCHEDULED", "again"),
        ("RUNNING", "claim b"),
    )
    assert start_blocked_by(rerun, rerun[-1]) is None  # what came before the last Scheduled


def test_a_claim_stamped_before_another_child_s_end_finds_that_end() -> None:
    """The race the fast suite saw leave a video part ``Running`` for ever: B's claim was
    stamped by the server just before A's child's ``Completed`` and took the run's lock just
    after it (Prefect accepts ``Running`` after a final state without a persisted result).
    By timestamp B's ``Running`` sorts before A's end, which is still what it displaced: it
    is put back (``RunStart.first_start``), not left to A's child, which has ended."""
    states = _history(
        ("SCHEDULED", ""), ("RUNNING", "a"), ("RUNNING", "claim b"), ("COMPLETED", "done by a")
    )
    blocking = start_blocked_by(states, states[2])
    assert blocking is states[3]


def test_a_claim_stamped_before_another_child_s_start_is_no_first_start() -> None:
    """B's claim stamped just before A's child's ``Running`` and accepted just after it:
    nothing but ``Scheduled`` sorts before it, yet A's child runs the run. B's child must
    not start it again."""
    states = _history(("SCHEDULED", ""), ("RUNNING", "claim b"), ("RUNNING", "a"))
    assert start_blocked_by(states, states[1]) is states[2]


def test_a_claim_displacing_a_start_and_an_end_puts_the_end_back() -> None:
    states = _history(
        ("SCHEDULED", ""), ("RUNNING", "a"), ("COMPLETED", "done by a"), ("RUNNING", "claim b")
    )
    assert start_blocked_by(states, states[3]) is states[2]
    assert start_blocked_by(states, _history(("RUNNING", "unknown"))[0]) is None
