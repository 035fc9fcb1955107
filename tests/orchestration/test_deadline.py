"""Retries share the job deadline: StageGuard under a real (test-harness) Prefect server,
each stage as a task run (``StageGuard.run``) and inline (``StageGuard.call``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest
from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.states import Failed, State

from blocks.settings import StagePolicy
from flows.deadline import Deadline, StageGuard
from tasks.errors import DeadlineExceeded, NoFaceFound, TransientError
from tests.orchestration.conftest import Home
from tests.orchestration.helpers import task_runs


@task(name="flaky", task_run_name="flaky", persist_result=False, cache_policy=NO_CACHE)
def flaky(calls: list[float], work_s: float, stuck_after: int | None = None) -> str:
    """Fails transiently after ``work_s``; from call ``stuck_after`` on, blocks instead."""
    calls.append(time.monotonic())
    if stuck_after is not None and len(calls) >= stuck_after:
        time.sleep(120)
    time.sleep(work_s)
    raise TransientError("A flaky stage failed.")


@task(name="no-face", task_run_name="no-face", persist_result=False, cache_policy=NO_CACHE)
def no_face(calls: list[float]) -> str:
    calls.append(time.monotonic())
    raise NoFaceFound()


@flow(name="deadline-probe", persist_result=False)
def probe(
    which: str,
    deadline_s: float,
    policy: dict[str, Any],
    work_s: float = 0.0,
    stuck_after: int | None = None,
    inline: bool = False,
) -> Any:
    """Run one stage under a StageGuard with a deadline ``deadline_s`` after the flow's first
    line (so a slow flow start on a loaded machine does not eat the test's margins), as a task
    run or ``inline``; returns what the test inspects."""
    deadline_at = datetime.now(UTC) + timedelta(seconds=deadline_s)
    guard = StageGuard(Deadline.of(deadline_at), StagePolicy(**policy))
    calls: list[float] = []
    stage = flaky if which == "flaky" else no_face
    args = (calls, work_s, stuck_after) if which == "flaky" else (calls,)
    try:
        if inline:
            guard.call(stage.fn, *args, logger=get_run_logger())
        else:
            guard.run(stage, *args)
    except Exception as exc:
        info = {
            "error": str(exc),
            "cause": type(exc.__cause__).__name__,
            "timed_out": isinstance(exc.__cause__, TimeoutError),
            "calls": len(calls),
            "attempts": guard.attempts,
            "timeouts": guard.timeouts,
            "ended_at": datetime.now(UTC).isoformat(),
            "deadline_at": deadline_at.isoformat(),
        }
        return Failed(message=str(exc), data=info)
    return {"calls": len(calls)}


MODES = pytest.mark.parametrize("inline", [False, True], ids=["task-runs", "inline"])


def run_probe(*args: Any, **kwargs: Any) -> State[Any]:
    """``probe(...)``'s final state."""
    return cast(State[Any], probe(*args, **kwargs, return_state=True))


def stage_runs(state: State[Any], name: str, inline: bool) -> int:
    """Task runs of stage ``name`` in the probe's run: one (with its attempts as its run
    count) as a task, none inline; ``-1`` when there is none."""
    runs = task_runs(state.state_details.flow_run_id)
    assert (name not in runs) if inline else (name in runs), set(runs)
    return runs[name].run_count if name in runs else -1


def _policy(**overrides: Any) -> dict[str, Any]:
    base = {
        "stage": "detect",
        "budget_s": 30.0,
        "expected_s": 1.2,
        "retries": 5,
        "retry_delay_s": 0.0,
    }
    return {**base, **overrides}


@MODES
def test_transient_failures_with_one_second_left_are_not_retried_a_third_time(
    prefect_harness: Home, inline: bool
) -> None:
    # Each attempt works 1 s: attempt 1 ends with <= 2 s left (>= 1.2 s expected cost:
    # retry, as long as the first attempt started within 0.8 s of the flow), attempt 2 with
    # <= 1 s (stop).
    state = run_probe("flaky", 3.0, _policy(), work_s=1.0, inline=inline)
    info = state.result(raise_on_failure=False)
    assert state.is_failed() and isinstance(info, dict)
    assert info["calls"] == 2 and info["attempts"] == 2, info
    # no attempt after the first started with less than the stage's expected cost left
    assert all(left >= 1.2 for left in info["timeouts"][1:]), info
    assert info["error"].startswith("[deadline_exceeded] ")
    assert "transient_error" in info["error"]
    ended_at, deadline_at = map(datetime.fromisoformat, (info["ended_at"], info["deadline_at"]))
    assert ended_at <= deadline_at
    assert stage_runs(state, "flaky", inline) == (-1 if inline else 2)
    # the retry's timeout was recomputed from the time left, not the 30 s budget
    assert info["timeouts"][1] < 2.5


@MODES
def test_retry_timeout_is_reset_to_the_time_left(prefect_harness: Home, inline: bool) -> None:
    state = run_probe(
        "flaky",
        4.0,
        _policy(expected_s=0.5),
        work_s=1.0,
        stuck_after=2,
        inline=inline,
    )
    info = state.result(raise_on_failure=False)
    assert isinstance(info, dict) and info["calls"] == 2, info
    assert info["error"].startswith("[deadline_exceeded] ")
    ended_at, deadline_at = map(datetime.fromisoformat, (info["ended_at"], info["deadline_at"]))
    overshoot = (ended_at - deadline_at).total_seconds()
    # the stuck second attempt was interrupted at the deadline (its first timeout was ~4 s)
    assert -0.4 < overshoot < 0.4, overshoot
    assert info["timed_out"], info
    if not inline:
        assert run_state_name(state) == "TimedOut"


def run_state_name(state: Any) -> str | None:
    run = task_runs(state.state_details.flow_run_id)["flaky"]
    return run.state.name if run.state is not None else None


@MODES
def test_permanent_error_is_not_retried(prefect_harness: Home, inline: bool) -> None:
    state = run_probe("no-face", 60.0, _policy(retries=3), inline=inline)
    info = state.result(raise_on_failure=False)
    assert isinstance(info, dict) and info["calls"] == 1 and info["attempts"] == 1, info
    assert info["error"].startswith("[no_face_found] ")
    assert stage_runs(state, "no-face", inline) == (-1 if inline else 1)


@MODES
def test_a_budget_overrun_is_retried_with_time_left(prefect_harness: Home, inline: bool) -> None:
    """An attempt stuck past the stage budget is interrupted and retried (transient), the
    retries are capped by ``retries``, and the run ends with the budget overrun."""
    policy = _policy(budget_s=0.5, expected_s=0.1, retries=1)
    state = run_probe("flaky", 60.0, policy, stuck_after=1, inline=inline)
    info = state.result(raise_on_failure=False)
    assert isinstance(info, dict) and info["calls"] == 2 and info["attempts"] == 2, info
    assert info["timed_out"], info
    assert info["error"].startswith("[transient_error] The detect stage exceeded its time budget")
    ended_at, deadline_at = map(datetime.fromisoformat, (info["ended_at"], info["deadline_at"]))
    assert ended_at < deadline_at - timedelta(seconds=55)


def test_no_first_attempt_without_the_expected_time() -> None:
    guard = StageGuard(
        Deadline.of(datetime.now(UTC) + timedelta(seconds=0.5)),
        StagePolicy(**_policy(expected_s=2.0)),
    )
    with pytest.raises(DeadlineExceeded):
        guard.first_timeout()
    roomy = StageGuard(
        Deadline.of(datetime.now(UTC) + timedelta(seconds=100)), StagePolicy(**_policy())
    )
    assert roomy.first_timeout() == 30.0


def test_naive_deadline_is_utc() -> None:
    naive = datetime.now(UTC).replace(tzinfo=None) + timedelta(seconds=10)
    assert 9.0 < Deadline.of(naive).left() <= 10.0


@dataclass
class _Watched:
    """A stage input that records every read of its ``payload`` field."""

    payload: list[int]
    reads: list[str] = field(default_factory=list)

    def __getattribute__(self, name: str) -> Any:
        if name == "payload":
            object.__getattribute__(self, "reads").append(name)
        return object.__getattribute__(self, name)


@task(name="identity", task_run_name="identity", persist_result=False, cache_policy=NO_CACHE)
def identity(value: _Watched, others: list[_Watched]) -> tuple[int, list[int]]:
    return id(value), [id(v) for v in others]


@flow(name="quote-probe", persist_result=False)
def quote_probe(deadline_at: datetime) -> dict[str, Any]:
    guard = StageGuard(Deadline.of(deadline_at), StagePolicy(**_policy()))
    value, others = _Watched([1, 2, 3]), [_Watched([4]) for _ in range(3)]
    seen, seen_others = guard.run(identity, value, others=others)
    return {
        "same": seen == id(value) and seen_others == [id(v) for v in others],
        "reads": [*value.reads, *(r for v in others for r in v.reads)],
    }


def test_stage_inputs_reach_the_task_as_they_are_and_unwalked(prefect_harness: Home) -> None:
    """Prefect would walk every stage input (a batch's job lists, twice per call) looking for
    futures; the guard passes them quoted, so they arrive as the same objects, unread."""
    out = quote_probe(datetime.now(UTC) + timedelta(seconds=60))

    assert out == {"same": True, "reads": []}
