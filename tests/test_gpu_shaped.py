"""The benchmarks' GPU-shaped stages (``faceflow.testing.shaped``, which
``bench/gpu_shaped.py`` applies): the real stage runs once per distinct inputs, however
the caller spells its arguments; later calls only sleep."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from faceflow.testing.shaped import shaped


def test_a_shaped_stage_runs_the_real_one_once_per_inputs_however_it_is_called() -> None:
    calls: list[int] = []

    def stage(image: np.ndarray, scale: int, *, extra: tuple[int, ...] = ()) -> int:
        calls.append(scale)
        return int(image.sum()) * scale + len(extra)

    fast = shaped(stage, 0.0)
    image = np.arange(12, dtype=np.uint8).reshape(3, 4)
    first = fast(image, 2)
    assert fast(image, 2, extra=()) == first  # the default spelled out: same inputs
    assert fast(image, scale=2) == first
    assert fast(image.copy(), 2) == first  # equal pixels, another array
    assert calls == [2]
    assert fast(image, 3) == int(image.sum()) * 3  # other inputs: the real stage again
    assert fast(image, 2, extra=(1,)) == first + 1
    assert calls == [2, 3, 2]


def test_a_shaped_stage_passes_the_callers_own_arguments_through() -> None:
    @dataclass(frozen=True)
    class Checked:
        image: np.ndarray
        options: dict[str, int]
        score: int

    def stage(image: np.ndarray, options: dict[str, int]) -> Checked:
        return Checked(image, options, int(image.sum()))

    fast = shaped(stage, 0.0)
    image = np.arange(12, dtype=np.uint8).reshape(3, 4)
    fast(image, {"q": 1})
    mine, options = image.copy(), {"q": 1}
    later = fast(mine, options)  # same inputs: no real call, but the caller's objects
    assert later.image is mine and later.options is options
    assert later.score == int(image.sum())
    same = shaped(lambda image: image, 0.0)
    same(image)
    assert same(mine) is mine
