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

``StageGuard.call`` runs a stage inline instead, without a task run (what a run does when
``FusionSettings.stage_task_runs`` says so): the same rules, each attempt under Prefect's
own sync timeout (``prefect.utilities.timeout.timeout``, the scope the task engine puts
around a sync task: SIGALRM on the main thread, else a watcher thread), the retry delay
slept on this thread, and one log line per attempt (stage, attempt, ms) through the run
logger in place of the task run's states.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

from prefect import Task
from prefect.client.schemas.objects import TaskRun
from prefect.states import State
from prefect.utilities.annotations import quote
from prefect.utilities.timeout import timeout as prefect_timeout

from blocks.settings import StagePolicy
from flows.params import STAGE_DONE_LOG, STAGE_FAILED_LOG
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


class StageTimedOut(TimeoutError):
    """An inline stage attempt ran past its timeout (``StageGuard.call``)."""


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

    @property
    def attempts(self) -> int:
        """Attempts started so far: the first and each retry granted."""
        return len(self.timeouts)

    def next_timeout(self, exc: BaseException | None) -> float | None:
        """After a failed attempt (``exc``, when known): the retry's timeout, ``min(budget,
        time left after the retry delay)``, or None when the error is permanent or the time
        left after the delay is below the expected cost. Records the decision."""
        self.failures += 1
        if exc is not None and is_permanent(exc):
            return None
        left = self.deadline.left() - self.policy.retry_delay_s
        if left < self.policy.expected_s:
            self.refused_for_time = True
            return None
        timeout = min(self.policy.budget_s, left)
        self.timeouts.append(timeout)
        return timeout

    def retry_condition(self, task: Task[..., Any], task_run: TaskRun, state: State[Any]) -> bool:
        """Prefect ``retry_condition_fn``: retry only transient failures with time to spare."""
        timeout = self.next_timeout(exception_of(state))
        if timeout is None:
            return False
        task.timeout_seconds = timeout
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
        # task-run inputs: ≈ 13 ms per stage of a 32-job batch, docs/batching.md).
        try:
            return configured(*map(quote, args), **{k: quote(v) for k, v in kwargs.items()})
        except Exception as exc:
            raise self.classify(exc) from exc

    def call(
        self,
        fn: Callable[..., R],
        *args: Any,
        logger: logging.Logger | logging.LoggerAdapter[Any],
        **kwargs: Any,
    ) -> R:
        """Call ``fn`` inline (no task run) under the rules of ``run``: each attempt under
        Prefect's sync timeout scope, at most ``retries`` retries granted by
        ``next_timeout`` after the retry delay; one line per attempt on ``logger``."""
        timeout = self.first_timeout()
        self.timeouts.append(timeout)
        stage = self.policy.stage
        while True:
            start = time.perf_counter()
            try:
                with prefect_timeout(seconds=timeout, timeout_exc_type=StageTimedOut):
                    result = fn(*args, **kwargs)
            except Exception as exc:
                ms = (time.perf_counter() - start) * 1000.0
                attempt = self.attempts
                retry = self.next_timeout(exc) if attempt <= self.policy.retries else None
                logger.warning(
                    STAGE_FAILED_LOG,
                    stage, attempt, ms, exc,
                    "no retry" if retry is None else
                    f"retry in {self.policy.retry_delay_s:g} s with a {retry:.2f} s timeout",
                )  # fmt: skip
                if retry is None:
                    raise self.classify(exc) from exc
                time.sleep(self.policy.retry_delay_s)
                timeout = retry
                continue
            logger.info(
                STAGE_DONE_LOG,
                stage, self.attempts, (time.perf_counter() - start) * 1000.0,
                self.deadline.left(),
            )  # fmt: skip
            return result

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
