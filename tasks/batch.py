"""Per-job outcomes inside a batch: one job's failure never fails its batch-mates.

A batch stage runs a function for each job (or one batched call for all of them) and
returns, per job, either the value or the typed error that ended that job. Timeouts are
not caught here: a stage that runs out of time fails as a whole (``flows.deadline``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from tasks.errors import FaceFlowError

A = TypeVar("A")
R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class Each(Generic[R]):
    """One job's outcome of a batch stage and the time spent on it (ms)."""

    value: R | None
    error: FaceFlowError | None
    ms: float

    @property
    def ok(self) -> bool:
        """Whether the job passed the stage."""
        return self.error is None


def as_error(exc: Exception) -> FaceFlowError:
    """The typed error an exception becomes for its job: a ``FaceFlowError`` as it is,
    anything else an ``internal_error`` (not permanent: another attempt may pass)."""
    if isinstance(exc, FaceFlowError):
        return exc
    return FaceFlowError(detail=type(exc).__name__)


def each(fn: Callable[[A], R], items: Sequence[A]) -> list[Each[R]]:
    """``fn`` on every item, timed; an exception ends only its own item. ``TimeoutError``
    (the stage's timeout) propagates: the stage as a whole ran out of time."""
    outcomes: list[Each[R]] = []
    for item in items:
        start = time.perf_counter()
        try:
            value = fn(item)
        except TimeoutError:
            raise
        except Exception as exc:
            outcomes.append(Each(None, as_error(exc), (time.perf_counter() - start) * 1e3))
            continue
        outcomes.append(Each(value, None, (time.perf_counter() - start) * 1e3))
    return outcomes


def shared(values: Sequence[R | FaceFlowError], ms: float) -> list[Each[R]]:
    """Outcomes of one batched call that served every item: its time split evenly."""
    share = ms / max(1, len(values))
    return [
        Each(None, v, share) if isinstance(v, FaceFlowError) else Each(v, None, share)
        for v in values
    ]
