"""GPU-shaped stand-ins for compute functions: a function that sleeps instead of
computing and returns the real result it computed the first time it saw the same inputs
(with the caller's own objects where the real stage passes its arguments through).
``bench/gpu_shaped.py`` shapes the pipeline's stages with it."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np


def fingerprint(value: Any) -> str:
    """A cheap digest of a stage's inputs: arrays by shape, dtype and a strided sample,
    dataclasses and containers by their fields, pydantic models by their JSON, the
    pipeline context by its type only."""
    digest = hashlib.sha1()

    def visit(item: Any) -> None:
        if isinstance(item, np.ndarray):
            flat = np.ascontiguousarray(item).reshape(-1)
            digest.update(f"{item.shape}{item.dtype}".encode())
            digest.update(flat[:: max(1, flat.size // 4096)].tobytes())
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            digest.update(type(item).__name__.encode())
            if type(item).__name__ == "PipelineContext":
                return
            for f in dataclasses.fields(item):
                visit(getattr(item, f.name))
        elif hasattr(item, "model_dump_json"):
            digest.update(item.model_dump_json().encode())
        elif isinstance(item, list | tuple):
            for part in item:
                visit(part)
        elif isinstance(item, dict):
            for key in sorted(item, key=str):
                digest.update(str(key).encode())
                visit(item[key])
        elif callable(item):
            digest.update(b"callable")
        else:
            digest.update(repr(item).encode())

    visit(value)
    return digest.hexdigest()


def shaped(fn: Callable[..., Any], seconds: float) -> Callable[..., Any]:
    """``fn`` that sleeps ``seconds`` and returns its real result for the same inputs
    (computed once, the first time, also when a batch calls it on several threads: the
    later stages then see the very objects they saw before).

    What the real stage passes through stays the caller's own: where the first result is
    one of the first call's arguments, or holds one in a dataclass field (the quality
    stage's ``Checked`` keeps the image and options it was given when no retry won), a
    later call gets its own argument there. Else a later stage that asks whether it got
    the very object it started from (``tasks.pipeline.Beside``: the encoding started
    beside quality) would see another one and do its work again, as no real run does."""
    seen: dict[str, tuple[dict[str, Any], Any]] = {}
    first = threading.Lock()
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def stage(*args: Any, **kwargs: Any) -> Any:
        # Keyed on the bound arguments, defaults filled in: the flows call a stage with
        # its keyword defaults spelled out or left out (fuse-faces' detect_task passes
        # extra_sources=(), fuse-batch does not), and a call that only differs so must
        # not run the real stage again (it did: ≈ 0.8 s of real detection in a burst's
        # first batch run).
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        key = fingerprint(bound.arguments)
        if key not in seen:
            with first:
                if key not in seen:
                    result = fn(*args, **kwargs)
                    seen[key] = (dict(bound.arguments), result)
                    return result
        time.sleep(seconds)
        given, result = seen[key]
        return _passed_through(result, given, bound.arguments)

    return stage


_SHARED_VALUES = (int, float, str, bytes, bool, type(None))
"""Values Python may share between calls (small ints, interned strings): never taken for
a passed-through argument."""


def _passed_through(result: Any, given: dict[str, Any], now: dict[str, Any]) -> Any:
    """``result`` with each object that is one of the ``given`` arguments (itself, or a
    field of a dataclass result) replaced by the argument of that name in ``now``."""
    names = {id(v): name for name, v in given.items() if not isinstance(v, _SHARED_VALUES)}
    if id(result) in names:
        return now[names[id(result)]]
    if not dataclasses.is_dataclass(result) or isinstance(result, type):
        return result
    changes = {
        f.name: now[names[id(value)]]
        for f in dataclasses.fields(result)
        if id(value := getattr(result, f.name)) in names
    }
    return dataclasses.replace(result, **changes) if changes else result
