"""The polling helpers the tests and benches wait with (``faceflow.testing.wait``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from faceflow.testing.wait import poll, poll_value, wait_for


def _answers(*values: object) -> Iterator[object]:
    yield from values
    while True:
        yield None


def test_poll_value_returns_the_first_value_that_is_not_none() -> None:
    answers = _answers(None, None, 0, 5)
    assert poll_value(lambda: next(answers), 5, step_s=0.001) == 0  # falsy, but a value


def test_poll_value_is_none_once_the_time_has_passed() -> None:
    calls: list[int] = []

    def never() -> int | None:
        calls.append(1)
        return None

    assert poll_value(never, 0.05, step_s=0.01) is None
    assert len(calls) >= 2  # asked again while the time lasted


def test_an_ignored_error_counts_as_not_yet_and_any_other_one_propagates() -> None:
    answers = _answers(ConnectionError(), "up")

    def get() -> object:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert poll_value(get, 5, step_s=0.001, ignore=(ConnectionError,)) == "up"
    empty: dict[str, bool] = {}
    with pytest.raises(KeyError):
        poll(lambda: empty["missing"], 5, ignore=(ConnectionError,))


def test_wait_for_names_what_it_waited_for() -> None:
    with pytest.raises(TimeoutError, match=r"the door not met within 0\.02 s"):
        wait_for(lambda: False, 0.02, step_s=0.01, what="the door")
