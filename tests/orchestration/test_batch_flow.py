"""The fuse-batch flow in-process under a real (test-harness) Prefect server: one run, several
jobs, each with its own outcome."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from blocks.settings import FusionSettings
from blocks.storage import read_bytes, write_bytes
from flows.batch import fuse_batch
from flows.binding import signed_parameters, worker_keys
from flows.params import (
    DEFAULT_SETTINGS_BLOCK,
    DEFAULT_STORAGE_BLOCK,
    FuseBatchParams,
    result_error_key,
    result_meta_key,
    stop_marker_key,
)
from tasks.batch import cpu_threads
from tests import samples
from tests.onnx_builders import build_tiny_gfpgan
from tests.orchestration.conftest import Home
from tests.orchestration.helpers import (
    STAGE_MODES,
    STAGE_RUNS,
    TIMED_STAGES,
    batch_outcomes,
    job_params,
    probe_overlap,
    result_pixels,
    run_artifacts,
    stage_settings,
    stages_seen,
    stored_failure,
    stored_result,
    table_rows,
    task_runs,
)


def _batch(*jobs: dict[str, Any], settings_block: str = DEFAULT_SETTINGS_BLOCK) -> dict[str, Any]:
    """A ``fuse-batch`` run's parameters, each job bound to the run's blocks."""
    for job in jobs:
        job.setdefault("attempt", 1)
        job.update(signed_parameters(job, worker_keys()[0], settings_block=settings_block))
    params = {
        "jobs": list(jobs),
        "deadline_at": max(j["deadline_at"] for j in jobs),
        "settings_block": settings_block,
    }
    FuseBatchParams.model_validate(params)  # what the test sends is what the relay sends
    return params


def _exists(key: str) -> bool:
    try:
        read_bytes(DEFAULT_STORAGE_BLOCK, key)
    except Exception:
        return False
    return True


def test_mixed_batch_ends_each_job_on_its_own(prefect_harness: Home) -> None:
    """Good jobs succeed beside a no-face job, a job whose deadline is about to pass, a job
    the relay stopped and one moderation blocks; with ``stage_task_runs="batches"`` one
    task run per stage for the batch."""
    astronaut = prefect_harness.put_input(samples.astronaut_jpeg_bytes())
    grace = prefect_harness.put_input(samples.grace_hopper_jpeg_bytes())
    no_face = prefect_harness.put_input(samples.no_face_jpeg_bytes())
    wheel = prefect_harness.put_input(samples.encode(samples.colorwheel_rgb(), "PNG"), "png")
    good = job_params(astronaut, grace)
    blocked = job_params(astronaut, wheel)
    good_jpeg = job_params(grace, astronaut, options={"output_format": "jpeg"}, attempt=2)
    faceless = job_params(no_face, grace)
    late = job_params(astronaut, grace, seconds=0.3)  # below detect's expected cost
    stopped = job_params(astronaut, grace)
    write_bytes(DEFAULT_STORAGE_BLOCK, stop_marker_key(stopped["job_id"], 1), b"cancelled")

    batch = _batch(
        good,
        good_jpeg,
        faceless,
        late,
        stopped,
        blocked,
        settings_block=stage_settings(inline=False, mode="batches"),
    )
    state = fuse_batch(**batch, return_state=True)

    assert state.is_completed(), state.message
    outcomes = state.result()
    assert outcomes == {
        good["job_id"]: "succeeded",
        good_jpeg["job_id"]: "succeeded",
        faceless["job_id"]: "no_face_found",
        late["job_id"]: "deadline_exceeded",
        stopped["job_id"]: "stopped",
        blocked["job_id"]: "content_blocked",
    }
    ref = stored_result(good["job_id"])
    image = result_pixels(ref)
    target = samples.grace_hopper_rgb()
    assert image.shape == target.shape and ref.faces_replaced == 1
    assert np.abs(image.astype(int) - target.astype(int)).mean() > 0.5
    assert set(ref.timings_ms) == TIMED_STAGES
    assert ref.moderation == []
    assert ref.quality is not None and ref.quality.faces_lost == 0
    ref2 = stored_result(good_jpeg["job_id"], 2)
    assert ref2.content_type == "image/jpeg" and ref2.key.endswith("attempt-2.jpeg")

    failure = stored_failure(faceless["job_id"])
    assert (failure.code, failure.retryable, failure.stage) == ("no_face_found", False, "detect")
    blocked_failure = stored_failure(blocked["job_id"])
    assert (blocked_failure.code, blocked_failure.retryable, blocked_failure.stage) == (
        "content_blocked",
        False,
        "moderate_inputs",
    )
    late_failure = stored_failure(late["job_id"])
    assert late_failure.code == "deadline_exceeded" and not late_failure.retryable
    for job in (stopped, late, faceless):
        assert not _exists(result_meta_key(job["job_id"], 1))
    assert not _exists(result_error_key(stopped["job_id"], 1))

    run_id = state.state_details.flow_run_id
    stage_runs = task_runs(run_id)
    assert set(stage_runs) == STAGE_RUNS
    by_type = run_artifacts(run_id)
    assert sorted(by_type) == ["markdown", "progress", "table"]
    by_job = {row["job"]: row for row in table_rows(by_type["table"])}
    assert by_job[good["job_id"]]["outcome"] == "succeeded"
    assert by_job[good["job_id"]]["result"].endswith(ref.key)
    assert by_job[faceless["job_id"]]["stage"] == "detect"
    assert by_job[stopped["job_id"]]["outcome"] == "stopped"
    assert by_type["progress"].data == 100.0
    assert "2 succeeded" in str(by_type["markdown"].data)


@STAGE_MODES
def test_a_batch_whose_every_job_fails_still_completes(prefect_harness: Home, inline: bool) -> None:
    no_face = prefect_harness.put_input(samples.no_face_jpeg_bytes())
    grace = prefect_harness.put_input(samples.grace_hopper_jpeg_bytes())
    jobs = [job_params(no_face, grace), job_params(grace, "inputs/missing/nothing.jpg")]
    state = fuse_batch(**_batch(*jobs, settings_block=stage_settings(inline)), return_state=True)
    assert state.is_completed(), state.message
    assert state.result() == {
        jobs[0]["job_id"]: "no_face_found",
        jobs[1]["job_id"]: "invalid_input",
    }
    assert stages_seen(state.state_details.flow_run_id, inline) == {
        "load": (1, "Completed"),
        "moderate_inputs": (1, "Completed"),
        "detect": (1, "Failed"),
    }


def test_a_batch_that_cannot_load_its_settings_fails_as_a_whole(prefect_harness: Home) -> None:
    grace = prefect_harness.put_input(samples.grace_hopper_jpeg_bytes())
    params = _batch(job_params(grace, grace), settings_block="fusion-settings/absent")
    state = fuse_batch(**params, return_state=True)
    assert state.is_failed()
    assert state.message is not None and state.message.startswith("[")


@pytest.mark.parametrize("seconds", [-1.0])
def test_a_batch_past_every_deadline_spends_nothing(prefect_harness: Home, seconds: float) -> None:
    grace = prefect_harness.put_input(samples.grace_hopper_jpeg_bytes())
    job = job_params(grace, grace, seconds=seconds)
    params = _batch(job)
    params["deadline_at"] = datetime.now(UTC) + timedelta(seconds=seconds)
    state = fuse_batch(**params, return_state=True)
    assert state.is_completed(), state.message
    assert state.result() == {job["job_id"]: "deadline_exceeded"}
    assert task_runs(state.state_details.flow_run_id) == {}


def test_only_the_jobs_that_chose_an_enhancer_are_enhanced(
    prefect_harness: Home, tmp_path: Path
) -> None:
    """A batch with an enhancer job and one without: the enhance stage runs for the first
    only (its timing, its pixels); the other's result is what it would be alone."""
    tiny = build_tiny_gfpgan(tmp_path / "models", gain=1.3)
    # Unmarked: each job's watermark carries its own id, and the pixels are compared.
    FusionSettings(model_dir=str(tiny.path.parent), model_pins=tiny.pins, marking="off").save(
        "test-batch-enhancer", overwrite=True
    )
    astronaut = prefect_harness.put_input(samples.astronaut_jpeg_bytes())
    grace = prefect_harness.put_input(samples.grace_hopper_jpeg_bytes())
    plain = job_params(astronaut, grace)
    enhanced = job_params(astronaut, grace, options={"enhancer": "gfpgan", "enhancer_blend": 1.0})
    params = _batch(plain, enhanced, settings_block="fusion-settings/test-batch-enhancer")

    state = fuse_batch(**params, return_state=True)

    assert state.is_completed(), state.message
    assert state.result() == {plain["job_id"]: "succeeded", enhanced["job_id"]: "succeeded"}
    refs = {job["job_id"]: stored_result(job["job_id"]) for job in (plain, enhanced)}
    assert "enhance" in refs[enhanced["job_id"]].timings_ms
    assert "enhance" not in refs[plain["job_id"]].timings_ms
    pixels = {job_id: result_pixels(ref) for job_id, ref in refs.items()}
    alone = fuse_batch(
        **_batch(job_params(astronaut, grace), settings_block=params["settings_block"]),
        return_state=True,
    )
    (alone_id,) = batch_outcomes(alone)
    alone_pixels = result_pixels(stored_result(alone_id))

    def diff(a: np.ndarray, b: np.ndarray) -> float:
        return float(np.abs(a.astype(int) - b.astype(int)).mean())

    # Not bit-equal: MTCNN's batched forward moves a landmark by float noise.
    assert diff(pixels[plain["job_id"]], alone_pixels) < 0.01  # seen: 8e-5
    assert diff(pixels[enhanced["job_id"]], alone_pixels) > 0.2  # seen: 0.47 (the face only)


def test_identity_references_moderation_and_encoding_run_beside_other_stages(
    prefect_harness: Home, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch's CPU threads beside its stages: each job's identity reference starts
    while align runs, each result's moderation and encoding while the quality stage runs,
    on the side pool's threads (as many as ``batch_cpu_threads`` gives: one per core)."""
    astronaut = prefect_harness.put_input(samples.astronaut_jpeg_bytes())
    grace = prefect_harness.put_input(samples.grace_hopper_jpeg_bytes())
    first, second = job_params(astronaut, grace), job_params(grace, astronaut)
    overlap = probe_overlap(monkeypatch)

    state = fuse_batch(**_batch(first, second), return_state=True)

    assert state.is_completed(), state.message
    assert state.result() == {first["job_id"]: "succeeded", second["job_id"]: "succeeded"}
    assert overlap.waited == {"align_stage": [True, True], "checked_stage": [True, True]}
    side = {f"faceflow-stage_{i}" for i in range(cpu_threads(0))}
    for work in ("reference_stage", "moderate_result_stage", "marked_encode_stage"):
        assert overlap.threads[work] and overlap.threads[work] <= side, work


def test_on_the_cpu_two_jobs_are_moderated_and_checked_at_once(
    prefect_harness: Home, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``model_threads`` model calls in flight: two jobs' input moderation and two
    jobs' quality checks run at the same time (each call waits for the other to start);
    with one at a time (``model_threads=1``) none meets another."""
    from tasks import pipeline

    met: dict[str, list[bool]] = {}

    def meeting(name: str, real: Any, barrier: threading.Barrier) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            try:
                barrier.wait()
                met.setdefault(name, []).append(True)
            except threading.BrokenBarrierError:
                met.setdefault(name, []).append(False)
            return real(*args, **kwargs)

        return run

    astronaut = prefect_harness.put_input(samples.astronaut_jpeg_bytes())
    grace = prefect_harness.put_input(samples.grace_hopper_jpeg_bytes())
    real = {name: getattr(pipeline, name) for name in ("moderate_inputs_stage", "checked_stage")}
    for threads, wait_s in ((2, 20.0), (1, 0.5)):
        block = f"test-model-threads-{threads}"  # one block each: the flows cache settings
        FusionSettings(model_threads=threads).save(block, overwrite=True)
        met.clear()
        for name, stage in real.items():
            barrier = threading.Barrier(2, timeout=wait_s)
            monkeypatch.setattr(pipeline, name, meeting(name, stage, barrier))
        first, second = job_params(astronaut, grace), job_params(grace, astronaut)
        params = _batch(first, second, settings_block=f"fusion-settings/{block}")

        state = fuse_batch(**params, return_state=True)

        assert state.is_completed(), state.message
        assert state.result() == {first["job_id"]: "succeeded", second["job_id"]: "succeeded"}
        expected = [True, True] if threads == 2 else [False, False]
        assert met == {"moderate_inputs_stage": expected, "checked_stage": expected}
