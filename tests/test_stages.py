"""The pipeline is one table (``tasks.stages.PIPELINE``): names, budgets, the final stage and
the model registries derive from it, and a stage added to it runs in every driver."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, cast, get_args

import pytest

from blocks.settings import (
    FusionSettings,
    default_budgets_s,
    default_expected_s,
    default_retries,
)
from flows.params import FINAL_STAGE
from tasks import pipeline, stages
from tasks.batch import Each, EveryJobFailed, EveryJobFailedPermanently, every_job_failed
from tasks.detect import DETECTORS
from tasks.errors import NoFaceFound, TransientError
from tasks.options import DetectorName, FuserName, FusionOptions
from tasks.pipeline import FUSERS, PipelineContext
from tasks.stages import (
    PIPELINE,
    STAGE_NAMES,
    InMemory,
    InProcess,
    InputBytes,
    Stage,
    Work,
    fuse_images,
    run_stages,
)
from tests import samples


def test_the_table_is_the_one_list_of_stages() -> None:
    assert tuple(s.name for s in PIPELINE) == STAGE_NAMES
    assert PIPELINE[-1].name == FINAL_STAGE  # the webapi's copy of the last stage's name
    assert {s.name: s.budget_s for s in PIPELINE} == default_budgets_s()
    assert {s.name: s.expected_s for s in PIPELINE} == default_expected_s()
    assert {s.name: s.retries for s in PIPELINE} == default_retries()
    for stage in PIPELINE:  # work started beside a stage is taken by a later one
        for side in stage.sides:
            assert STAGE_NAMES.index(side.taken_in) > STAGE_NAMES.index(stage.name)


def test_settings_fall_back_to_the_tables_defaults() -> None:
    policy = FusionSettings(stage_budgets_s={"detect": 5.0}, stage_retries={}).policy("detect")
    detect = stages.stage_named("detect")
    assert (policy.budget_s, policy.expected_s, policy.retries) == (
        5.0,
        detect.expected_s,
        detect.retries,
    )


def test_models_are_chosen_from_registries() -> None:
    assert set(DETECTORS) == set(get_args(DetectorName))
    assert set(FUSERS) == set(get_args(FuserName))


def test_every_job_failed_reads_as_the_first_error_and_is_permanent_only_if_all_are() -> None:
    ok: Each[None] = Each(None, None, 1.0)
    gone, busy = NoFaceFound(), TransientError("busy")
    every_job_failed([ok, Each(None, gone, 1.0)])  # one passed: nothing raised
    every_job_failed([])
    with pytest.raises(EveryJobFailedPermanently) as permanent:
        every_job_failed([Each(None, gone, 1.0), Each(None, NoFaceFound("other"), 2.0)])
    assert str(permanent.value) == str(gone) and permanent.value.permanent
    second = [o.error for o in permanent.value.outcomes][1]
    assert second is not None and second.public_message == "other"
    with pytest.raises(EveryJobFailed) as transient:
        every_job_failed([Each(None, gone, 1.0), Each(None, busy, 2.0)])
    assert not transient.value.permanent


def marking_stage(seen: list[str]) -> Stage:
    """A stage that is not in the product: it records the jobs it sees after postprocess."""

    def mark(works: list[Work], ctx: PipelineContext) -> list[Each[None]]:
        out: list[Each[None]] = []
        for work in works:
            assert work.image is not None and work.encoded is None  # after postprocess
            seen.append(work.options.output_format)
            out.append(Each(None, None, 0.5))
        return out

    return Stage(cast(Any, "mark"), mark, budget_s=5.0, expected_s=0.01, retries=0)


def with_stage(monkeypatch: pytest.MonkeyPatch, stage: Stage, after: str) -> None:
    """``PIPELINE`` with ``stage`` inserted after the stage named ``after``."""
    at = STAGE_NAMES.index(cast(Any, after)) + 1
    monkeypatch.setattr(stages, "PIPELINE", (*PIPELINE[:at], stage, *PIPELINE[at:]))


def test_a_stage_added_to_the_table_runs_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []
    with_stage(monkeypatch, marking_stage(seen), after="postprocess")
    result = fuse_images(samples.astronaut_jpeg_bytes(), samples.grace_hopper_jpeg_bytes())
    assert seen == ["png"]
    assert list(result.timings_ms)[-5:] == [
        "postprocess",
        "mark",
        "quality",
        "moderate_result",
        "store",
    ]


def test_a_stage_that_does_not_apply_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []
    stage = replace(marking_stage(seen), applies=lambda work, ctx: False)
    with_stage(monkeypatch, stage, after="postprocess")
    result = fuse_images(samples.astronaut_jpeg_bytes(), samples.grace_hopper_jpeg_bytes())
    assert seen == [] and "mark" not in result.timings_ms


def _meeting(
    spans: dict[str, tuple[float, float]],
    started: dict[str, threading.Event],
    fn: Callable[..., Any],
    name_of: Callable[[tuple[Any, ...]], str],
) -> Callable[..., Any]:
    """``fn``, each call named by ``name_of(args)``: it marks its name started, waits
    (bounded: calls made one after the other never see each other start) for every other
    name of ``started``, and records its span in ``spans`` (a retry's, later, is not)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        name = name_of(args)
        begin = time.perf_counter()
        started[name].set()
        for other, event in started.items():
            if other != name:
                event.wait(10.0)
        try:
            return fn(*args, **kwargs)
        finally:
            spans.setdefault(name, (begin, time.perf_counter()))

    return run


def test_the_result_is_encoded_beside_the_quality_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    """The table starts the store stage's encoding when postprocess ends, so it runs while
    the quality stage does: each of the two waits (bounded) for the other to have started,
    and their spans in one real job overlap. Run one after the other, they cannot."""
    spans: dict[str, tuple[float, float]] = {}
    started = {"quality": threading.Event(), "encode": threading.Event()}
    quality = _meeting(spans, started, pipeline.checked_stage, lambda args: "quality")
    encode = _meeting(spans, started, pipeline.marked_encode_stage, lambda args: "encode")
    monkeypatch.setattr(pipeline, "checked_stage", quality)
    monkeypatch.setattr(pipeline, "marked_encode_stage", encode)
    fuse_images(samples.astronaut_jpeg_bytes(), samples.grace_hopper_jpeg_bytes())
    (quality_start, quality_end), (encode_start, encode_end) = spans["quality"], spans["encode"]
    assert encode_start < quality_end and quality_start < encode_end


def test_a_batch_encodes_its_results_on_its_cpu_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch's side work (the results' moderation and encoding) runs on the batch's CPU
    threads: with two, the two jobs' encodings overlap, each waiting (bounded) for the other
    to have started. On a single side thread they run one after the other and cannot."""
    spans: dict[str, tuple[float, float]] = {}
    started = {"job-0": threading.Event(), "job-1": threading.Event()}
    by_job = _meeting(spans, started, pipeline.marked_encode_stage, lambda args: args[3])
    monkeypatch.setattr(pipeline, "marked_encode_stage", by_job)
    ctx = PipelineContext(cpu_threads=2)
    data = InputBytes(samples.astronaut_jpeg_bytes(), samples.grace_hopper_jpeg_bytes())
    works = [Work(InMemory(data), FusionOptions(), job_id=f"job-{i}") for i in range(2)]
    run_stages(works, ctx, InProcess(ctx))
    assert all(w.error is None and w.encoded for w in works)
    (start_0, end_0), (start_1, end_1) = spans["job-0"], spans["job-1"]
    assert start_0 < end_1 and start_1 < end_0
