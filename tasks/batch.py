"""Per-job outcomes inside a batch: one job's failure never fails its batch-mates.

A batch stage runs a function for each job (or one batched call for all of them) and
returns, per job, either the value or the typed error that ended that job. Timeouts are
not caught here: a stage that runs out of time fails as a whole (``flows.deadline``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, Generic, TypeVar

from tasks.errors import FaceFlowError, as_job_error

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


def each(fn: Callable[[A], R], items: Sequence[A], *, threads: int = 1) -> list[Each[R]]:
    """``fn`` on every item, timed; an exception ends only its own item. ``TimeoutError``
    (the stage's timeout) propagates: the stage as a whole ran out of time.

    With ``threads`` > 1 the items run on that many threads (for work that releases the
    GIL: image decoding and encoding, storage I/O); outcomes keep the items' order. On a
    timeout the items not yet started are dropped and those running finish unobserved.
    """
    return in_flight(partial(_timed, fn), items, threads=threads)


def in_flight(fn: Callable[[A], R], items: Sequence[A], *, threads: int = 1) -> list[R]:
    """``fn`` of every item, in the items' order, ``threads`` of them at once (on this
    thread when one). An error (a timeout too) ends the call: the items not yet started
    are dropped and those running finish unobserved."""
    if threads <= 1 or len(items) <= 1:
        return [fn(item) for item in items]
    pool = ThreadPoolExecutor(min(threads, len(items)), thread_name_prefix="faceflow-each")
    try:
        futures = [pool.submit(fn, item) for item in items]
        return [future.result() for future in futures]
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def in_chunks(
    fn: Callable[[list[A]], Sequence[R]],
    items: Sequence[A],
    *,
    threads: int = 1,
    most: int | None = None,
) -> list[R]:
    """``fn`` on consecutive chunks of ``items`` (one chunk per thread, at most ``most``
    items each), ``threads`` chunks at once (``in_flight``); every chunk's results, in the
    items' order. For a model that takes a batch and returns one result per item."""
    size = -(-len(items) // max(1, threads))
    if most is not None:
        size = min(size, most)
    chunks = [list(items[start : start + size]) for start in range(0, len(items), max(1, size))]
    return [result for part in in_flight(fn, chunks, threads=threads) for result in part]


def cores() -> int:
    """The CPU cores this process may use."""
    return max(1, len(os.sched_getaffinity(0)))


def cpu_threads(setting: int, cap: int = 8) -> int:
    """Threads for per-job CPU work: ``setting``, or for 0 the CPU cores this process may
    use (at most ``cap``)."""
    if setting > 0:
        return setting
    return max(1, min(cores(), cap))


def model_threads(setting: int, device: str) -> int:
    """Model calls kept in flight (a job's images in detection, a batch's jobs in its model
    stages): ``setting``, or for 0 two on the CPU of a machine with two or more cores (one
    call's own threads leave cores idle on the small tensors of a face crop or a detector's
    later stages) and one on a GPU, whose calls take the whole batch at once."""
    if setting > 0:
        return setting
    if device != "cpu":
        return 1
    return min(2, cores())


def call_threads(model_threads: int) -> int:
    """Intra-op threads of one model call on the CPU (torch's, onnxruntime's) when
    ``model_threads`` calls are kept in flight: this process's cores shared among them, at
    least one. Two calls with two threads each on two cores wait on each other's threads."""
    return max(1, cores() // max(1, model_threads))


def _timed(fn: Callable[[A], R], item: A) -> Each[R]:
    start = time.perf_counter()
    try:
        value = fn(item)
    except TimeoutError:
        raise
    except Exception as exc:
        return Each(None, as_job_error(exc), (time.perf_counter() - start) * 1e3)
    return Each(value, None, (time.perf_counter() - start) * 1e3)


def shared(values: Sequence[R | FaceFlowError], ms: float) -> list[Each[R]]:
    """Outcomes of one batched call that served every item: its time split evenly."""
    share = ms / max(1, len(values))
    return [
        Each(None, v, share) if isinstance(v, FaceFlowError) else Each(v, None, share)
        for v in values
    ]


class EveryJobFailed(FaceFlowError):
    """Every job of a stage failed: raised so that the stage's task run ends ``Failed``
    and its retries apply, carrying each job's own outcome (``outcomes``). Reads as the
    first job's error; permanent only when every job's error is (``every_job_failed``)."""

    def __init__(self, outcomes: Sequence[Each[Any]]) -> None:
        self.outcomes: list[Each[Any]] = list(outcomes)
        first = self.outcomes[0].error
        assert first is not None
        self.first = first
        super().__init__(first.public_message, detail=first.detail)

    def __str__(self) -> str:
        return str(self.first)


class EveryJobFailedPermanently(EveryJobFailed):
    """``EveryJobFailed`` where no job may pass on a retry."""

    permanent = True


def every_job_failed(outcomes: Sequence[Each[R]]) -> None:
    """Raise ``EveryJobFailed`` when every outcome is an error (none for no outcomes)."""
    errors = [o.error for o in outcomes if o.error is not None]
    if not outcomes or len(errors) < len(outcomes):
        return
    if all(e.permanent for e in errors):
        raise EveryJobFailedPermanently(outcomes)
    raise EveryJobFailed(outcomes)
