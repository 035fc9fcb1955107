"""One deadline per job: stage timeouts and retries that share it.

Every stage runs as a sync Prefect task called directly on the flow's main thread, so
Prefect enforces ``timeout_seconds`` with SIGALRM (it interrupts Python code and sleeps).
``StageGuard.run`` gives each stage

- a first attempt only when the time left covers the stage's expected cost, with
  ``timeout_seconds = min(stage budget, time left)``;
- a ``retry_condition_fn`` that refuses a retry for permanent errors
  (``tasks.errors.is_permanent``) and when the time left after the retry delay is below
  the expected cost, and otherwise sets the task's ``timeout_seconds`` to
  ``min(budget, time left after the delay)`` (the engine re-reads it on every attempt);
- a typed error when the stage finally fails: the stage's own ``FaceFlowError``,
  ``DeadlineExceeded`` when time ran out, ``TransientError`` for a budget overrun.

There is deliberately no Prefect flow-level ``timeout_seconds``: it is fixed at decoration,
and an enclosing alarm makes Prefect fall back to watcher-thread timeouts for the tasks
inside it, which cannot interrupt a blocking call (measured: a 1 s task timeout around a
3 s ``time.sleep`` ended after 3.07 s under ``@flow(timeout_seconds=10)``). Since every
blocking step of the flow is a stage with a timeout no longer than the time left, the flow
as a whole ends by the deadline plus Prefect's per-task overhead.
"""

from __future__ import annotations

import signal
import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

from prefect import Task
from prefect.client.schemas.objects import TaskRun
from prefect.states import State
from prefect.utilities.annotations import quote

from blocks.settings import StagePolicy
from tasks.errors import DeadlineExceeded, FaceFlowError, TransientError, is_permanent

R = TypeVar("R")


def alarm_timeouts_available() -> bool:
    """Whether Prefect can enforce task timeouts with SIGALRM here.

    Only on the main thread and only while no other SIGALRM handler is installed (an
    enclosing flow timeout, pytest-timeout's signal method, ...); otherwise Prefect uses a
    watcher thread that cannot interrupt a blocking call.
    """
    return threading.current_thread() is threading.main_thread() and signal.getsignal(
        signal.SIGALRM
    ) in (signal.SIG_DFL, None)


TIMEOUT_SLACK_S = 0.05
"""A timeout that fires with less than this left counts as the deadline passing."""


@dataclass(frozen=True, slots=True)
class Deadline:
    """An absolute UTC deadline, read against the wall clock."""

    at: datetime

    @classmethod
    def of(cls, at: datetime) -> Deadline:
        """A deadline at ``at`` (a naive datetime is taken as UTC)."""
        return cls(at if at.tzinfo is not None else at.replace(tzinfo=UTC))

    def left(self) -> float:
        """Seconds until the deadline (negative once it passed)."""
        return (self.at - datetime.now(UTC)).total_seconds()

    def passed(self) -> bool:
        """Whether no time is left."""
        return self.left() <= 0.0


def exception_of(state: State[Any]) -> BaseException | None:
    """The exception a failed task state carries, if any."""
    data = state.data
    if isinstance(data, BaseException):
        return data
    result = state.result(raise_on_failure=False)
    return result if isinstance(result, BaseException) else None


@dataclass
class StageGuard:
    """Runs one stage's task under the job deadline; records attempts and refusals."""

    deadline: Deadline
    policy: StagePolicy
    failures: int = 0
    refused_for_time: bool = False
    timeouts: list[float] = field(default_factory=list)

    def first_timeout(self) -> float:
        """Timeout of the first attempt; ``DeadlineExceeded`` when too little time is left."""
        left = self.deadline.left()
        if left < self.policy.expected_s:
            raise DeadlineExceeded(detail=self._too_little(left, "start"))
        return min(self.policy.budget_s, left)

    def retry_condition(self, task: Task[..., Any], task_run: TaskRun, state: State[Any]) -> bool:
        """Prefect ``retry_condition_fn``: retry only transient failures with time to spare."""
        self.failures += 1
        exc = exception_of(state)
        if exc is not None and is_permanent(exc):
            return False
        left = self.deadline.left() - self.policy.retry_delay_s
        if left < self.policy.expected_s:
            self.refused_for_time = True
            return False
        task.timeout_seconds = min(self.policy.budget_s, left)
        self.timeouts.append(task.timeout_seconds)
        return True

    def run(self, stage_task: Task[..., R], *args: Any, **kwargs: Any) -> R:
        """Call ``stage_task`` (on this thread) with the deadline's timeout and retry rules."""
        timeout = self.first_timeout()
        self.timeouts.append(timeout)
        configured = stage_task.with_options(
            timeout_seconds=timeout,
            retries=self.policy.retries,
            retry_delay_seconds=self.policy.retry_delay_s,
            retry_condition_fn=self.retry_condition,
        )
        # Stage inputs are plain values (images, a batch's job lists), never futures:
        # ``quote`` spares Prefect walking them twice per call (parameter resolution and
        # task-run inputs: ≈ 13 ms per stage of a 32-job batch, docs/benchmarks.md).
        try:
            return configured(*map(quote, args), **{k: quote(v) for k, v in kwargs.items()})
        except Exception as exc:
            raise self.classify(exc) from exc

    def classify(self, exc: Exception) -> FaceFlowError:
        """The typed error a stage's final failure becomes."""
        stage = self.policy.stage
        left = self.deadline.left()
        if isinstance(exc, FaceFlowError) and exc.permanent:
            return exc
        if isinstance(exc, TimeoutError):
            if left <= TIMEOUT_SLACK_S:
                return DeadlineExceeded(detail=f"the {stage} stage was running")
            return TransientError(
                f"The {stage} stage exceeded its time budget.",
                detail=f"budget {self.policy.budget_s:g} s",
            )
        cause = exc.code if isinstance(exc, FaceFlowError) else type(exc).__name__
        if self.refused_for_time or left < self.policy.expected_s:
            return DeadlineExceeded(
                detail=f"{stage} failed ({cause}); {self._too_little(left, 'retry')}"
            )
        if isinstance(exc, FaceFlowError):
            return exc
        return FaceFlowError(detail=f"{stage}: {cause}")

    def _too_little(self, left: float, what: str) -> str:
        return (
            f"{max(left, 0.0):.2f} s left, {self.policy.stage} needs about "
            f"{self.policy.expected_s:g} s to {what}"
        )
