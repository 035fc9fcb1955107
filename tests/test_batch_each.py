"""``tasks.batch.each``: per-job outcomes of a batch stage, on one thread or several."""

from __future__ import annotations

import os
import threading
import time

import pytest

from tasks.batch import call_threads, cpu_threads, each, in_chunks, model_threads
from tasks.errors import FaceFlowError, NoFaceFound


def _work(item: int) -> int:
    if item == 3:
        raise NoFaceFound("no face in item 3")
    if item == 5:
        raise KeyError("boom")
    time.sleep(0.02 * (item % 3))  # later items may finish first on another thread
    return item * 10


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_outcomes_keep_the_items_order_and_end_only_the_failed_items(threads: int) -> None:
    outcomes = each(_work, list(range(8)), threads=threads)

    assert [o.value for o in outcomes] == [0, 10, 20, None, 40, None, 60, 70]
    assert isinstance(outcomes[3].error, NoFaceFound)
    assert isinstance(outcomes[5].error, FaceFlowError) and outcomes[5].error.code == (
        "internal_error"
    )
    assert outcomes[5].error.detail == "KeyError"
    assert all(o.ms >= 0 for o in outcomes)
    assert outcomes[2].ms >= 35  # each item's own time, not the stage's


def test_threads_run_items_at_once() -> None:
    names: set[str] = set()
    started = threading.Barrier(2, timeout=5)

    def meet(_item: int) -> None:
        names.add(threading.current_thread().name)
        started.wait()  # deadlocks (BrokenBarrierError after 5 s) unless two run together

    outcomes = each(meet, [0, 1], threads=2)

    assert all(o.ok for o in outcomes)
    assert len(names) == 2


def test_a_timeout_ends_the_stage_and_drops_the_items_not_started() -> None:
    ran: list[int] = []

    def slow(item: int) -> int:
        ran.append(item)
        if item == 0:
            raise TimeoutError("the stage's time is up")
        time.sleep(0.05)
        return item

    with pytest.raises(TimeoutError):
        each(slow, list(range(20)), threads=2)
    time.sleep(0.3)

    assert len(ran) < 20


def test_model_calls_in_flight_two_on_the_cpu_one_on_a_gpu() -> None:
    assert model_threads(3, "cpu") == 3 and model_threads(3, "cuda") == 3  # the setting wins
    assert model_threads(0, "cuda") == 1  # a GPU call takes the whole batch
    assert model_threads(0, "cpu") == min(2, cpu_threads(0))


def test_the_cores_are_shared_among_the_model_calls_in_flight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert [call_threads(n) for n in (1, 2, 3, 16, 32)] == [16, 8, 5, 1, 1]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert [call_threads(n) for n in (0, 1, 2)] == [2, 2, 1]  # two calls, one core each


def test_cpu_threads_follow_the_setting_or_the_cores() -> None:
    assert cpu_threads(3) == 3
    assert 1 <= cpu_threads(0) <= 8
    assert cpu_threads(0, cap=1) == 1


def test_in_chunks_splits_one_chunk_per_thread_and_keeps_the_order() -> None:
    seen: list[list[int]] = []

    def doubled(chunk: list[int]) -> list[int]:
        seen.append(chunk)
        return [2 * item for item in chunk]

    assert in_chunks(doubled, list(range(7)), threads=2) == [0, 2, 4, 6, 8, 10, 12]
    assert sorted(seen) == [[0, 1, 2, 3], [4, 5, 6]]
    seen.clear()
    assert in_chunks(doubled, list(range(5)), threads=2, most=2) == [0, 2, 4, 6, 8]
    assert sorted(seen) == [[0, 1], [2, 3], [4]]
    assert in_chunks(doubled, [], threads=2) == []
