"""The worker's pieces without a server: registration, template, deadlines, child specs."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from uuid import UUID

import pytest

from faceflow.worker import WORKER_TYPE, FaceFlowGpuWorker, FaceFlowJobConfiguration
from faceflow.worker.job import deployment_directory
from faceflow.worker.pool import ChildPool, PoolLimits, SlotState
from faceflow.worker.protocol import ChildSpec
from faceflow.worker.settings import WorkerSettings

REPO = Path(__file__).resolve().parents[2]


def test_prefect_finds_the_worker_type_through_the_entry_point() -> None:
    from prefect.workers.base import BaseWorker

    assert BaseWorker.get_worker_class_from_type(WORKER_TYPE) is FaceFlowGpuWorker
    assert WORKER_TYPE in BaseWorker.get_all_available_worker_types()


def test_the_pool_template_file_is_the_workers_default() -> None:
    on_disk = json.loads((REPO / "work_pools" / "faceflow-gpu.json").read_text())
    assert on_disk == FaceFlowGpuWorker.get_default_base_job_template()
    assert on_disk["variables"]["properties"]["deadline_grace_seconds"]["default"] == 2.0


def _run(**parameters: Any) -> Any:
    return SimpleNamespace(parameters=parameters)


def test_kill_time_is_the_deadline_plus_grace() -> None:
    config = FaceFlowJobConfiguration(deadline_grace_seconds=1.5)
    deadline = datetime(2030, 1, 1, tzinfo=UTC)
    expected = deadline.timestamp() + 1.5
    assert config.kill_at(_run(deadline_at=deadline.isoformat()), started=0) == expected
    assert config.kill_at(_run(deadline_at="2030-01-01T00:00:00Z"), started=0) == expected
    assert config.kill_at(_run(deadline_at=deadline), started=0) == expected
    naive = deadline.replace(tzinfo=None)  # naive deadlines are UTC
    assert config.kill_at(_run(deadline_at=naive.isoformat()), started=0) == expected


def test_kill_time_without_a_deadline() -> None:
    assert FaceFlowJobConfiguration().kill_at(_run(), started=100.0) is None
    assert FaceFlowJobConfiguration().kill_at(_run(deadline_at="soon"), started=1.0) is None
    capped = FaceFlowJobConfiguration(max_run_seconds=30)
    assert capped.kill_at(_run(), started=100.0) == 130.0
    other = FaceFlowJobConfiguration(deadline_parameter="due")
    due = datetime.now(UTC) + timedelta(seconds=5)
    assert other.kill_at(_run(due=due.isoformat()), started=0) == due.timestamp() + 2.0


def test_deployment_directory_from_path_or_pull_step(tmp_path: Path) -> None:
    step = {"prefect.deployments.steps.set_working_directory": {"directory": str(tmp_path)}}
    assert deployment_directory(SimpleNamespace(path=None, pull_steps=[step])) == tmp_path  # type: ignore[arg-type]
    assert deployment_directory(SimpleNamespace(path=str(tmp_path), pull_steps=None)) == tmp_path  # type: ignore[arg-type]
    relative = SimpleNamespace(path=".", pull_steps=[{"prefect.deployments.steps.git_clone": {}}])
    assert deployment_directory(relative) is None  # type: ignore[arg-type]


def test_children_are_pinned_one_per_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    specs = WorkerSettings(gpus="0,1").child_specs(extra_env={"PREFECT_API_URL": "http://x/api"})
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["0", "1"]
    assert all(s.env["PREFECT_API_URL"] == "http://x/api" for s in specs)
    three = WorkerSettings(gpus="2,3", children=3).child_specs()
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in three] == ["2", "3", "2"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in WorkerSettings().child_specs()] == ["5"]


def test_without_gpus_one_unpinned_child(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    specs = WorkerSettings().child_specs()
    assert len(specs) == 1 and "CUDA_VISIBLE_DEVICES" not in specs[0].env


def test_worker_limit_is_children_plus_prefetch_plus_the_priority_place() -> None:
    two = WorkerSettings(children=2, prefetch_runs=0)
    assert FaceFlowGpuWorker(work_pool_name="p", settings=two, limit=8)._limit == 2 + 1
    three = WorkerSettings(children=3, prefetch_runs=1)
    assert FaceFlowGpuWorker(work_pool_name="p", settings=three)._limit == 4 + 1
    capped = FaceFlowGpuWorker(work_pool_name="p", settings=three, limit=1)
    assert (capped._children, capped._limit) == (1, 2 + 1)  # --limit caps the executing runs


def test_a_priority_run_takes_the_next_free_child_before_runs_claimed_ahead() -> None:
    class Child:
        gone = False

    async def scenario() -> list[str]:
        pool = ChildPool([ChildSpec(index=0)], PoolLimits())
        slot = pool.slots[0]
        slot.state, slot.child = SlotState.BUSY, Child()  # type: ignore[assignment]
        order: list[str] = []

        async def take(name: str, priority: bool) -> None:
            await pool.acquire(name, timeout=5, priority=priority)
            order.append(name)

        normal = asyncio.create_task(take("normal", False))
        await asyncio.sleep(0.05)
        urgent = asyncio.create_task(take("urgent", True))
        await asyncio.sleep(0.05)
        assert (pool.waiting, pool.priority_waiting) == (2, 1)
        await pool._set_idle(slot)  # the busy run ends: the priority run, claimed last, goes
        await asyncio.wait_for(urgent, 2)
        await asyncio.sleep(0.1)
        assert not normal.done()
        await pool._set_idle(slot)
        await asyncio.wait_for(normal, 2)
        assert pool.priority_waiting == 0
        return order

    assert asyncio.run(scenario()) == ["urgent", "normal"]


def test_run_environment_is_prefects_and_follows_temporary_settings() -> None:
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.workers.base import BaseJobConfiguration

    assert FaceFlowJobConfiguration._base_environment() == BaseJobConfiguration._base_environment()
    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        env = FaceFlowJobConfiguration._base_environment()
        assert env["PREFECT_API_URL"] == "http://127.0.0.1:9/api"
        assert env == BaseJobConfiguration._base_environment()
        env["PREFECT_API_URL"] = "changed by a caller"  # each run gets its own copy
        assert (
            FaceFlowJobConfiguration._base_environment()["PREFECT_API_URL"]
            != env["PREFECT_API_URL"]
        )
    assert FaceFlowJobConfiguration._base_environment() == BaseJobConfiguration._base_environment()


def test_a_child_skips_the_rename_only_when_the_run_has_the_name_already() -> None:
    from faceflow.worker.child import WarmChild
    from flows.fuse import fuse_faces

    child = WarmChild.__new__(WarmChild)  # no connection or spec needed here
    child.variants = {}
    named = SimpleNamespace(parameters={"job_id": "job-1"}, name="job-1")
    unrenamed = child.named_already(fuse_faces, named)
    assert unrenamed is not fuse_faces and unrenamed.flow_run_name is None
    assert unrenamed.fn is fuse_faces.fn and unrenamed.name == fuse_faces.name
    assert fuse_faces.flow_run_name == "{job_id}"  # the loaded flow is left as it is
    assert child.named_already(fuse_faces, named) is unrenamed  # one copy per flow
    other = SimpleNamespace(parameters={"job_id": "job-1"}, name="brave-otter")
    assert child.named_already(fuse_faces, other) is fuse_faces
    missing = SimpleNamespace(parameters={}, name="job-1")
    assert child.named_already(fuse_faces, missing) is fuse_faces


def test_a_slot_changes_state_only_by_the_allowed_moves() -> None:
    from faceflow.worker.pool import SLOT_MOVES, Slot

    slot = Slot(ChildSpec(index=0))
    assert slot.state is SlotState.DOWN
    assert not slot.move(SlotState.BUSY, "run-1")  # a child that never started takes no run
    assert slot.move(SlotState.STARTING) and slot.move(SlotState.IDLE)
    assert slot.move(SlotState.BUSY, "run-1") and slot.flow_run_id == "run-1"
    assert slot.move(SlotState.STOPPING) and slot.flow_run_id is None
    assert not slot.move(SlotState.IDLE)  # a stopping child is never handed out again
    assert slot.state is SlotState.STOPPING
    assert slot.move(SlotState.DOWN)
    assert set(SLOT_MOVES) == set(SlotState)


def test_a_child_runs_the_flow_run_the_worker_sent_without_reading_it() -> None:
    from uuid import uuid4

    from prefect.client.schemas.objects import FlowRun

    from faceflow.worker.child import WarmChild
    from faceflow.worker.protocol import RunRequest

    sent = FlowRun(id=uuid4(), flow_id=uuid4(), name="job-1", parameters={"job_id": "job-1"})
    request = RunRequest(
        str(sent.id), "flows/fuse.py:fuse_faces", flow_run_json=sent.model_dump_json()
    )
    assert WarmChild.flow_run_of(request, client=None) == sent  # None: any read would raise

    class Reads:
        def __init__(self) -> None:
            self.ids: list[Any] = []

        def read_flow_run(self, flow_run_id: Any) -> FlowRun:
            self.ids.append(flow_run_id)
            return sent

    other, reads = (
        RunRequest(str(uuid4()), request.entrypoint, flow_run_json=request.flow_run_json),
        Reads(),
    )
    assert WarmChild.flow_run_of(other, reads) is sent  # a run that is not the one named: read
    assert reads.ids == [UUID(other.flow_run_id)]
    assert WarmChild.flow_run_of(RunRequest(str(sent.id), request.entrypoint), reads) is sent
    assert len(reads.ids) == 2


def test_a_childs_plain_console_writes_the_lines_prefects_console_handler_wrote() -> None:
    import io
    import logging

    from prefect.logging.formatters import PrefectFormatter
    from prefect.logging.handlers import PrefectConsoleHandler

    from faceflow.worker.child import plain_console

    manager = logging.Logger.manager
    loggers = [logging.getLogger()] + [
        lg for lg in list(manager.loggerDict.values()) if isinstance(lg, logging.Logger)
    ]
    saved = {lg: list(lg.handlers) for lg in loggers}
    stream = io.StringIO()
    rich = PrefectConsoleHandler(stream=stream, level=logging.INFO)
    rich.setFormatter(PrefectFormatter("%(levelname)-7s | %(name)s - %(message)s"))
    logger = logging.getLogger("faceflow.test.console")
    logger.addHandler(rich)
    logger.propagate = False
    try:
        logger.warning("stage %s took %d ms [bold]", "detect", 12)
        logger.debug("below the handler's level")
        before = stream.getvalue()
        assert plain_console() >= 1
        assert not any(isinstance(h, PrefectConsoleHandler) for h in logger.handlers)
        logger.warning("stage %s took %d ms [bold]", "detect", 12)
        logger.debug("below the handler's level")
        assert stream.getvalue() == before * 2
        assert before == "WARNING | faceflow.test.console - stage detect took 12 ms [bold]\n"
    finally:
        for lg, handlers in saved.items():
            lg.handlers = handlers
        logger.handlers, logger.propagate = [], True


def test_a_runs_bookkeeping_waits_for_its_running_event_or_its_end() -> None:
    """The worker's writes to a handed-over run (pid, labels) wait for the run's Running
    event, or for its end, or for the subscription to drop; without a live subscription
    they do not wait at all."""

    async def scenario() -> None:
        worker = FaceFlowGpuWorker(work_pool_name="p")
        run_id = UUID(int=1)
        assert not worker._events.live
        await asyncio.wait_for(worker._after_start(run_id), 1)  # no subscription: no wait
        for end in ("running", "over"):
            worker._starts[str(run_id)] = asyncio.Event()
            waiting = asyncio.create_task(worker._after_start(run_id))
            await asyncio.sleep(0.05)
            assert not waiting.done()  # handed over, not Running yet
            worker._run_started(str(run_id))  # the Running event, or run() ending
            await asyncio.wait_for(waiting, 1)
            assert str(run_id) not in worker._starts, end

    asyncio.run(scenario())


def test_the_claim_that_started_a_run_is_read_from_its_states() -> None:
    """``claiming_state``: this worker's claim by its message, another worker's by the
    claim's transition id (shared by every claimant of the run count: its child's
    ``Running`` or its ``Pending``), the earliest; a ``Running`` of another run count or no
    claim at all: none."""
    from uuid import uuid4

    from prefect.states import Pending, Running, Scheduled, State

    from faceflow.worker.protocol import RunClaim
    from faceflow.worker.start_claims import claiming_state

    claim = RunClaim(transition_id=str(uuid4()), message="Started by worker a (claim 1).")

    def running(message: str, transition_id: str) -> Any:
        state: State[Any] = Running(message=message)
        state.state_details.transition_id = UUID(transition_id)
        return state

    scheduled: State[Any] = Scheduled()
    assert claiming_state([scheduled], claim) is None
    earlier = running("Started by worker b (claim 0).", str(uuid4()))  # an earlier run count
    assert claiming_state([scheduled, earlier], claim) is None
    ours = running(claim.message, claim.transition_id)
    assert claiming_state([scheduled, ours], claim) is ours
    theirs: State[Any] = running("Started by worker b (claim 2).", claim.transition_id)
    assert claiming_state([scheduled, earlier, theirs], claim) is theirs
    late = running(claim.message, claim.transition_id)  # accepted after theirs, put back
    assert claiming_state([late, theirs, scheduled], claim) is theirs
    held: State[Any] = Pending(message="Claimed by worker c (claim 3).")  # ahead, for a busy child
    held.state_details.transition_id = UUID(claim.transition_id)
    assert claiming_state([scheduled, held], claim) is held


def test_one_idle_child_claims_on_start_one_of_the_runs_submitted_together() -> None:
    """Two runs found in one poll with one child idle: the first is claimed by its child's
    ``Running``, the second with ``Pending``. Both decided while their deployment check
    was still under way used to be claimed on start; the second then waited for the child
    still ``Scheduled``, another worker's child ran it, and the late claim left a video
    part ``Running`` in the fast suite."""
    from uuid import uuid4

    from prefect.client.schemas.objects import FlowRun

    async def scenario() -> tuple[list[str], list[str]]:
        worker = FaceFlowGpuWorker(work_pool_name="p")
        worker._claims_on_start = True
        worker._pool = SimpleNamespace(idle_count=lambda: 1)  # type: ignore[assignment]
        on_start: list[str] = []
        pending: list[str] = []

        async def check(flow_run: FlowRun) -> tuple[bool, bool]:
            await asyncio.sleep(0.05)  # the deployment read: both submissions wait here
            return False, False

        def claim_on_start(flow_run: FlowRun) -> bool:
            on_start.append(str(flow_run.id))
            worker._on_start.take(str(flow_run.id), flow_run.run_count)
            return False  # not handed over: the test ends with the claims made

        async def propose_pending(flow_run: FlowRun) -> bool:
            pending.append(str(flow_run.id))
            return False

        worker._deployment_check = check  # type: ignore[method-assign]
        worker._claim_on_start = claim_on_start  # type: ignore[method-assign]
        worker._propose_pending_state = propose_pending  # type: ignore[method-assign]
        runs = [FlowRun(id=uuid4(), flow_id=uuid4(), name=f"run-{i}") for i in range(2)]
        await asyncio.gather(*(worker._submit_run(run) for run in runs))
        return on_start, pending

    on_start, pending = asyncio.run(scenario())
    assert len(on_start) == 1 and len(pending) == 1, (on_start, pending)
    assert set(on_start) != set(pending)
