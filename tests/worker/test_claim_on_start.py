"""A run claimed by its child's ``Running`` (``claim_on_start``): no ``Pending`` state,
against a real Prefect server through the engine a warm child runs (``run_start.RunStart``,
``claim_outcome``, ``first_start``). Two workers' claims on start never both start a run
while it is ``Scheduled``; a claim Prefect accepts late (after another worker's child
started or finished the run, or after a cancellation) puts back the state it displaced
and stops before the flow (docs/reliability.md finding 13)."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from prefect import flow
from prefect.client.orchestration import SyncPrefectClient
from prefect.context import SyncClientContext
from prefect.exceptions import Abort
from prefect.flow_engine import run_flow
from prefect.settings import temporary_settings
from prefect.states import Cancelled, Completed, Pending, Running

from faceflow.testing.wait import poll, poll_value
from faceflow.worker.protocol import RunClaim
from faceflow.worker.run_start import LATE_CLAIM, RunStart
from faceflow.worker.transitions import claim_transition, propose_shared
from faceflow.worker.worker import CLAIM_SETTLE_S
from tests.worker.conftest import Api, WarmWorker, in_process_settings, start_warm_worker

pytestmark = pytest.mark.prefect

RAN: list[str] = []
ON = {"FACEFLOW_WORKER_CLAIM_ON_START": "true"}  # the default, said where a test needs it


@flow(name="claim-probe", persist_result=False)
def claim_probe() -> None:
    RAN.append("ran")


@pytest.fixture(scope="module")
def claim_deployment(prefect_api: Api) -> str:
    flow_id = prefect_api.call("POST", "/flows/", {"name": "claim-probe"})["id"]
    body = {"name": f"claim-probe-{uuid.uuid4().hex[:6]}", "flow_id": flow_id}
    return str(prefect_api.call("POST", "/deployments/", body)["id"])


@contextmanager
def _two_workers(
    prefect_api: Api, tmp_path: Path, prefix: str, env: dict[str, str]
) -> Iterator[tuple[WarmWorker, WarmWorker, str]]:
    """Two warm workers (``gpu-a``, ``gpu-b``, one child each) on a new pool, with ``env``;
    stopped by PID when the block ends."""
    pool = f"{prefix}-{uuid.uuid4().hex[:6]}"
    first = start_warm_worker(prefect_api, tmp_path / "a", pool, env, name="gpu-a")
    try:
        second = start_warm_worker(
            prefect_api, tmp_path / "b", pool, env, name="gpu-b", create_pool=False
        )
        try:
            yield first, second, pool
        finally:
            second.service.stop(grace=15)
    finally:
        first.service.stop(grace=15)


@contextmanager
def _client(api: Api) -> Iterator[SyncPrefectClient]:
    """Prefect's sync client on the tests' server, in this process."""
    with (
        temporary_settings(updates=in_process_settings(api)),
        SyncClientContext.get_or_create() as ctx,
    ):
        yield ctx.client


def _claim(worker: str) -> RunClaim:
    return RunClaim(transition_id=str(uuid.uuid4()), message=f"Started by {worker}.")


def _new_run(api: Api, deployment_id: str, client: SyncPrefectClient) -> Any:
    run_id = api.call("POST", f"/deployments/{deployment_id}/create_flow_run", {})["id"]
    return client.read_flow_run(uuid.UUID(run_id))


def _propose(client: SyncPrefectClient, run: Any, claim: RunClaim) -> Any:
    """A ``Running`` proposal as another worker's child makes its claim."""
    return propose_shared(client, run.id, Running(message=claim.message), claim.transition_id)


def _start(client: SyncPrefectClient, run: Any, claim: RunClaim) -> Any:
    """Run ``claim_probe`` as a warm child does with a claim; the final state."""
    RAN.clear()
    with RunStart(client, run, claim).installed():
        return run_flow(claim_probe, flow_run=run, return_type="state")


def _history(client: SyncPrefectClient, run: Any) -> list[tuple[str, str | None]]:
    states = sorted(client.read_flow_run_states(run.id), key=lambda s: s.timestamp)
    return [(s.type.value, s.message) for s in states]


def _starts(api: Api, run_id: str) -> list[str]:
    """The messages of the run's ``Running`` states that started it: every one but those
    a late claim made, after which the state before them is put back as it was."""
    found = api.call("GET", f"/flow_run_states/?flow_run_id={run_id}")
    ordered = [(s["type"], s["name"], s["message"]) for s in sorted(found, key=_at)]
    return [
        message
        for i, (kind, _name, message) in enumerate(ordered)
        if kind == "RUNNING" and not (0 < i < len(ordered) - 1 and ordered[i - 1] == ordered[i + 1])
    ]


def _at(state: dict[str, Any]) -> str:
    return str(state["timestamp"])


def test_a_run_claimed_on_start_goes_from_scheduled_to_running(
    prefect_api: Api, claim_deployment: str
) -> None:
    claim = _claim("worker a, child pid 1")
    with _client(prefect_api) as client:
        run = _new_run(prefect_api, claim_deployment, client)
        state = _start(client, run, claim)
        history = _history(client, run)
        held = client.read_flow_run(run.id)
    assert state.type.value == "COMPLETED" and RAN == ["ran"]
    assert [t for t, _ in history] == ["SCHEDULED", "RUNNING", "COMPLETED"], history
    assert history[1][1] == claim.message  # the UI shows which worker and child started it
    assert held.run_count == 1
    assert held.flow_version == claim_probe.version  # the PATCH, sent once the claim won


@pytest.mark.parametrize(
    ("held", "refusal"),
    [(Running, "another worker started the run first"), (Pending, "claimed the run first")],
)
def test_a_run_another_worker_claimed_first_is_not_started_again(
    prefect_api: Api, claim_deployment: str, held: Any, refusal: str
) -> None:
    """Two workers claim one run (both saw it ``Scheduled``): the same transition id, their
    own messages. The first claimed it by its child's ``Running``, or by the ``Pending`` a
    worker holds a run with for a busy child. The second claim is refused and the engine
    stops before the flow's first line; the first claim stays the run's state."""
    first = _claim("worker a, child pid 1")
    second = RunClaim(transition_id=first.transition_id, message="Started by worker b.")
    with _client(prefect_api) as client:
        run = _new_run(prefect_api, claim_deployment, client)
        claimed = propose_shared(client, run.id, held(message=first.message), first.transition_id)
        assert claimed.status.value == "ACCEPT"
        with pytest.raises(Abort, match=refusal):
            _start(client, run, second)
        history = _history(client, run)
        held_run = client.read_flow_run(run.id)
    assert RAN == []
    assert history[1:] == [(claimed.state.type.value, first.message)], history
    assert held_run.flow_version is None  # the loser's engine did not PATCH the run


def test_a_claim_sent_again_after_its_answer_was_lost_is_its_own(
    prefect_api: Api, claim_deployment: str
) -> None:
    """The claim reached the server but its answer did not (the client sends it again):
    Prefect refuses the repeat with the run's ``Running``, which carries this claim's own
    message, so the run goes on."""
    claim = _claim("worker a, child pid 1")
    with _client(prefect_api) as client:
        run = _new_run(prefect_api, claim_deployment, client)
        _propose(client, run, claim)
        state = _start(client, run, claim)
        history = _history(client, run)
    assert state.type.value == "COMPLETED" and RAN == ["ran"]
    assert [t for t, _ in history] == ["SCHEDULED", "RUNNING", "COMPLETED"], history


def test_a_claim_accepted_after_the_run_was_cancelled_puts_it_back(
    prefect_api: Api, claim_deployment: str
) -> None:
    """Prefect accepts ``Running`` after ``Cancelled`` (a rerun): a cancellation that lands
    between the worker's read of a ``Scheduled`` run and its child's claim lets the claim
    through. The child reads the run's states, puts ``Cancelled`` back and stops before the
    flow's first line."""
    claim = _claim("worker a, child pid 1")
    with _client(prefect_api) as client:
        run = _new_run(prefect_api, claim_deployment, client)
        client.set_flow_run_state(run.id, Cancelled(message="cancelled"), force=True)
        with pytest.raises(
            Abort, match=f"{LATE_CLAIM}: the run was (Completed|Cancelled) before .* put back"
        ):
            _start(client, run, claim)
        history = _history(client, run)
    assert RAN == []
    assert [t for t, _ in history] == ["SCHEDULED", "CANCELLED", "RUNNING", "CANCELLED"]
    assert history[-1] == history[1] == ("CANCELLED", "cancelled"), history


def test_a_claim_accepted_after_another_child_finished_the_run_puts_it_back(
    prefect_api: Api, claim_deployment: str
) -> None:
    """Another worker's child started the run with the same claim's transition id and
    finished it before this claim reached Prefect, which accepts ``Running`` after a
    ``Completed`` state without a persisted result (the late claim's transition id is no
    longer the current state's). The late child puts ``Completed`` back and never runs the
    flow."""
    first = _claim("worker a, child pid 1")
    late = RunClaim(transition_id=first.transition_id, message="Started by worker b.")
    with _client(prefect_api) as client:
        run = _new_run(prefect_api, claim_deployment, client)
        assert _start(client, run, first).type.value == "COMPLETED"
        with pytest.raises(
            Abort, match=f"{LATE_CLAIM}: the run was (Completed|Cancelled) before .* put back"
        ):
            _start(client, run, late)
        assert RAN == []
        history = _history(client, run)
    assert [t for t, _ in history] == ["SCHEDULED", "RUNNING", "COMPLETED", "RUNNING", "COMPLETED"]
    assert history[3][1] == late.message and history[-1] == history[2], history


def test_a_claim_accepted_while_another_child_runs_the_run_leaves_it_to_that_child(
    prefect_api: Api, claim_deployment: str
) -> None:
    """Worker X claimed the run ahead (``Pending`` with the claims' transition id) and its
    child started it (the engine's ``Running``, a fresh transition id); worker Y's claim on
    start reaches Prefect after that and is accepted. Y's child stops before the flow and
    writes nothing more: a put-back ``Running`` could land after X's child ended the run
    and leave it ``Running`` for ever (the fast suite saw a video part stuck so). X's end
    is accepted from Y's ``Running``."""
    held = _claim("worker x")
    late = RunClaim(transition_id=held.transition_id, message="Started by worker y.")
    with _client(prefect_api) as client:
        run = _new_run(prefect_api, claim_deployment, client)
        propose_shared(client, run.id, Pending(message=held.message), held.transition_id)
        client.set_flow_run_state(run.id, Running())  # X's child's engine
        with pytest.raises(Abort, match=f"{LATE_CLAIM}: the run was Running before .* left"):
            _start(client, run, late)
        assert RAN == []
        after_claim = _history(client, run)
        client.set_flow_run_state(run.id, Completed())  # X's child ends the run
        history = _history(client, run)
    assert [t for t, _ in after_claim] == ["SCHEDULED", "PENDING", "RUNNING", "RUNNING"]
    assert after_claim[-1][1] == late.message, after_claim
    assert [t for t, _ in history][-1] == "COMPLETED", history


@pytest.mark.slow
def test_two_workers_claiming_every_run_start_each_once(prefect_api: Api, tmp_path: Path) -> None:
    """Two warm workers on one pool, each with an idle child: both claim every run from its
    ``Scheduled`` event by their child's ``Running``. Each run runs once (one start in its
    states, the winner's; a late claim is put back), the losers' children stop before the
    flow, and the
    losers write neither their pid nor their labels on the winner's run."""
    with _two_workers(prefect_api, tmp_path, "pair", ON) as (first, second, _pool):
        second.wait_idle()
        runs = []
        for _ in range(12):
            run_id = first.submit(fuse=False)
            assert prefect_api.wait_final(run_id, timeout=60)["state_type"] == "COMPLETED"
            runs.append(run_id)
            first.wait_idle(), second.wait_idle()
        statuses = [first.status(), second.status()]
        for run_id in runs:
            (winner,) = _starts(prefect_api, run_id)
            assert winner.startswith("Started by faceflow-gpu worker gpu-"), winner
            labels = prefect_api.run(run_id)["labels"]
            name = labels.get("prefect.worker.name")
            assert name is None or f"worker {name}," in winner, (labels, winner)
        assert sum(s["claims_on_start"] for s in statuses) >= len(runs)
        # both workers saw every run idle: most runs were claimed twice, once in vain
        assert sum(s["claims_lost"] for s in statuses) >= 1, statuses


@pytest.mark.slow
def test_a_run_cancelled_between_its_read_and_its_claim_does_not_run(
    prefect_api: Api, tmp_path: Path
) -> None:
    """The run is cancelled while the child it was handed to still loads its flow: Prefect
    makes a ``Scheduled`` run ``Cancelled`` at once (no infrastructure), then accepts the
    child's claiming ``Running`` (a rerun). The child finds the cancellation before its
    ``Running`` in the run's states, puts ``Cancelled`` back and never runs the body. The
    worker's event stream is off and its first state read comes after the claim (4 s), so
    nothing else catches the cancellation first (with the stream up, the stop event kills
    the child before its claim)."""
    pool = f"late-cancel-{uuid.uuid4().hex[:6]}"
    quiet = {"FACEFLOW_WORKER_EVENT_PICKUP": "false", "FACEFLOW_WORKER_WATCH_INTERVAL_S": "4", **ON}
    worker = start_warm_worker(prefect_api, tmp_path, pool, extra_env=quiet)
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    try:
        entrypoint = "tests/worker/slow_start_probe.py:slow_start_probe"
        deployment = prefect_api.deploy("slow-start-probe", entrypoint, pool)
        run_id = prefect_api.create_run(deployment, {"out_dir": str(out)})
        handed = poll(lambda: bool(worker.holding(run_id)), 20)
        assert handed and prefect_api.state(run_id) == "SCHEDULED"  # the child imports
        # what an unforced Cancelling makes of a Scheduled run without a pid (the relay's)
        prefect_api.set_state(run_id, "CANCELLED", "cancelled by the test")

        def ended_again() -> list[dict[str, Any]] | None:
            states = prefect_api.call("GET", f"/flow_run_states/?flow_run_id={run_id}")
            ordered = sorted(states, key=lambda s: s["timestamp"])
            types = [s["type"] for s in ordered]
            return ordered if types[-2:] == ["RUNNING", "CANCELLED"] else None

        ordered = poll_value(ended_again, 30, step_s=0.1)
        assert ordered is not None, prefect_api.call(
            "GET", f"/flow_run_states/?flow_run_id={run_id}"
        )
        assert ordered[-1]["message"] == "cancelled by the test", ordered[-1]
        time.sleep(6.0)  # as long as the body: it would have finished by now
        assert not (out / f"{run_id}.done").exists()
        assert prefect_api.state(run_id) == "CANCELLED"
        worker.wait_idle()  # a fresh child took the stopped one's place
    finally:
        worker.service.stop(grace=15)


@pytest.mark.slow
def test_a_child_that_dies_before_its_claim_ends_only_a_run_nobody_started(
    prefect_api: Api, tmp_path: Path
) -> None:
    """A child handed a run dies while it loads the flow, before its claim. When another
    worker's child started the run meanwhile (a ``Running`` with the claim's transition id:
    every worker's claim of the run carries it), the worker leaves the run to that one:
    it stays ``Running`` (ending it ``Crashed``, as the worker did, ended a run that
    another child runs). When nobody started it, the worker ends it ``Crashed``, as a
    ``Pending`` run whose child died."""
    pool = f"dead-claimant-{uuid.uuid4().hex[:6]}"
    worker = start_warm_worker(prefect_api, tmp_path, pool, ON)
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    try:
        entrypoint = "tests/worker/slow_start_probe.py:slow_start_probe"
        deployment = prefect_api.deploy("slow-start-probe", entrypoint, pool)

        def handed(run_id: str) -> int:
            """The pid of the child the run was handed to, while it still loads the flow."""

            pid = poll_value(lambda: next(iter(worker.holding(run_id)), None), 20)
            assert pid is not None and prefect_api.state(run_id) == "SCHEDULED"
            return pid

        def states(run_id: str) -> list[dict[str, Any]]:
            found = prefect_api.call("GET", f"/flow_run_states/?flow_run_id={run_id}")
            return sorted(found, key=lambda s: s["timestamp"])

        theirs = prefect_api.create_run(deployment, {"out_dir": str(out)})
        pid = handed(theirs)
        other = "Started by faceflow-gpu worker gpu-other, child pid 1 (claim 0badc0de)."
        transition = claim_transition(theirs, 0)  # a new run's run count
        state = {"type": "RUNNING", "message": other,
                 "state_details": {"transition_id": transition}}  # fmt: skip
        prefect_api.call("POST", f"/flow_runs/{theirs}/set_state", {"state": state})
        os.kill(pid, signal.SIGKILL)
        worker.wait_idle()  # a fresh child took the dead one's place
        time.sleep(2 * CLAIM_SETTLE_S)
        assert [(s["type"], s["message"]) for s in states(theirs)][-1] == ("RUNNING", other)

        nobodys = prefect_api.create_run(deployment, {"out_dir": str(out)})
        os.kill(handed(nobodys), signal.SIGKILL)
        assert poll(lambda: prefect_api.state(nobodys) == "CRASHED", 20), states(nobodys)
        assert "during the run" in states(nobodys)[-1]["message"]
    finally:
        worker.service.stop(grace=15)


@pytest.mark.slow
def test_with_the_event_stream_down_only_the_winners_worker_writes_on_the_run(
    prefect_api: Api, tmp_path: Path
) -> None:
    """Both workers poll (event streams off) and hand one run to their idle child while it
    loads a flow whose import takes 2 s; one claim wins, and the run's body runs once (a
    claim that reached Prefect after the run ended was put back). Only the winner's worker writes
    the run's infrastructure pid and its labels: with no ``Running`` event to wait for, a
    worker reads the run's states for the claim first (both wrote at the hand-over, and
    the worker that polled second, whose child mostly lost, wrote last)."""
    quiet = {"FACEFLOW_WORKER_EVENT_PICKUP": "false", **ON}
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    with _two_workers(prefect_api, tmp_path, "pair-quiet", quiet) as (first, second, pool):
        entrypoint = "tests/worker/slow_start_probe.py:slow_start_probe"
        deployment = prefect_api.deploy("slow-start-probe", entrypoint, pool)
        run_id = prefect_api.create_run(deployment, {"out_dir": str(out), "body_s": 0.5})
        workers = (first, second)

        seen: set[int] = set()

        def both_handed() -> bool:
            seen.update(pid for w in workers for pid in w.holding(run_id))
            return len(seen) >= 2

        assert poll(both_handed, 20), seen  # else the claims never met: it proves nothing
        assert prefect_api.wait_final(run_id, timeout=60)["state_type"] == "COMPLETED"
        first.wait_idle(), second.wait_idle()
        (winner,) = _starts(prefect_api, run_id)
        assert (out / f"{run_id}.done").read_text().count("\n") == 1
        run = prefect_api.run(run_id)
        assert f"child pid {run['infrastructure_pid']} " in winner, (run, winner)
        assert f"worker {run['labels']['prefect.worker.name']}," in winner, (run, winner)


def _never_started_twice(
    prefect_api: Api, tmp_path: Path, env: dict[str, str]
) -> tuple[list[str], list[str], int]:
    """Two workers on one pool; worker X's child busy (4 s), worker Y's idle. A run whose
    flow takes 2 s to import is scheduled: X claims it ahead (``Pending``: it prefetches
    one), Y's idle child is handed it (with claims on start, Y's child claims it by its
    ``Running`` once its import is done). X's child takes it when it is free. The types of
    the run's states in order, the messages of its starts, and how often its body ran."""
    out = tmp_path / "out"
    out.mkdir(parents=True, exist_ok=True)
    with _two_workers(prefect_api, tmp_path, "mixed", env) as (first, second, pool):
        first.wait_events_settled()
        second.wait_events_settled()
        busy = first.submit(c_sleep_s=4, fuse=False)
        first.wait_started(busy)
        entrypoint = "tests/worker/slow_start_probe.py:slow_start_probe"
        deployment = prefect_api.deploy("slow-start-probe", entrypoint, pool)
        run_id = prefect_api.create_run(deployment, {"out_dir": str(out), "body_s": 0.5})
        assert prefect_api.wait_final(busy, timeout=60)["state_type"] == "COMPLETED"
        assert prefect_api.wait_final(run_id, timeout=60)["state_type"] == "COMPLETED"
        first.wait_idle(), second.wait_idle()
        time.sleep(3.0)  # a second start would have begun by now (its import takes 2 s)
        first.wait_idle(), second.wait_idle()
        states = prefect_api.call("GET", f"/flow_run_states/?flow_run_id={run_id}")
        types = [s["type"] for s in sorted(states, key=lambda s: s["timestamp"])]
        ran = (out / f"{run_id}.done").read_text().count("\n")
        return types, _starts(prefect_api, run_id), ran


@pytest.mark.slow
def test_a_run_claimed_ahead_by_one_worker_is_not_started_by_another(
    prefect_api: Api, tmp_path: Path
) -> None:
    """One worker claims a run ahead for its busy child (``Pending``), another has an idle
    child: the run starts once. With claims on start the idle
    child's ``Running`` was once accepted from the other worker's ``Pending`` and the busy
    worker's child ran the run again after it was ``Completed`` (Prefect accepts ``Running``
    after a ``Completed`` state without a persisted result, finding 13): the ``Pending``
    now carries the claims' transition id, which refuses the idle child's claim. Both
    ways: claims on start, and the ``Pending`` claims alone."""
    for way, env in enumerate((ON, {"FACEFLOW_WORKER_CLAIM_ON_START": "false"})):
        types, starts, ran = _never_started_twice(prefect_api, tmp_path / str(way), env)
        assert types == ["SCHEDULED", "PENDING", "RUNNING", "COMPLETED"], (env, types)
        assert len(starts) == 1 and ran == 1, (env, starts, ran)
