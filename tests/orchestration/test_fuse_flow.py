"""The fuse-faces flow in-process under a real (test-harness) Prefect server."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

import cv2
import numpy as np
import pytest
from prefect.client.orchestration import get_client
from prefect.runtime import flow_run
from prefect.settings import PREFECT_API_URL

from blocks.settings import FusionSettings
from blocks.signing import load_credentials, make_chain, save_credentials
from blocks.storage import read_bytes
from faceflow.faults.observe import inline_stages, prefect_writers
from flows.fuse import fuse_faces
from flows.params import (
    DEFAULT_SIGNING_BLOCK,
    DEFAULT_STORAGE_BLOCK,
    FuseFacesParams,
    ResultRef,
)
from tasks import pipeline, watermark
from tasks.models import MODEL_CACHE
from tasks.options import ModerationPolicy
from tasks.provenance import Credentials, dev_root_path, inspect_file
from tests import samples
from tests.orchestration.conftest import Home
from tests.orchestration.helpers import (
    STAGE_MODES,
    STAGE_RUNS,
    TIMED_STAGES,
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


@STAGE_MODES
def test_fuses_astronaut_into_grace_hopper(prefect_harness: Home, inline: bool) -> None:
    params = job_params(
        prefect_harness.put_input(samples.astronaut_jpeg_bytes()),
        prefect_harness.put_input(samples.grace_hopper_jpeg_bytes()),
        settings_block=stage_settings(inline),
    )
    FuseFacesParams.model_validate(params)  # what the test sends is what the webapi sends
    state = fuse_faces(**params, return_state=True)
    assert state.is_completed(), state.message
    ref = ResultRef.model_validate(state.result())

    image = result_pixels(ref)
    target = samples.grace_hopper_rgb()
    assert image.shape == target.shape
    assert (ref.width, ref.height, ref.content_type) == (
        target.shape[1],
        target.shape[0],
        "image/png",
    )
    assert ref.faces_replaced == 1
    assert np.abs(image.astype(int) - target.astype(int)).mean() > 0.5  # the face changed
    marks = inspect_file(
        read_bytes(DEFAULT_STORAGE_BLOCK, ref.key),
        dev_root_path(prefect_harness.path).read_text(),
    )
    assert marks.manifest.valid and marks.manifest.trusted and marks.manifest.ours
    assert marks.watermark == watermark.payload_for(params["job_id"])
    assert ref.marks == ["c2pa", "watermark"]
    assert stored_result(params["job_id"]) == ref
    assert set(ref.timings_ms) == TIMED_STAGES
    assert ref.moderation == []
    assert ref.quality is not None and ref.quality.faces_lost == 0
    assert ref.quality.marks == ref.marks  # the job's public quality report says so too
    assert ref.quality.faces[0].found and ref.quality.source_similarity is not None
    assert len(ref.quality.attempts) == 1  # no floor set: no retry

    run_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        assert run_id is not None
        run = client.read_flow_run(run_id)
    assert run.name == params["job_id"]
    assert {f"job:{params['job_id']}", "owner:user-1"} <= set(run.tags)
    by_type = run_artifacts(run_id)
    assert sorted(by_type) == ["markdown", "progress", "table"]
    assert ref.key in str(by_type["markdown"].data)
    assert "## Quality" in str(by_type["markdown"].data)
    assert "Marked: signed C2PA Content Credentials, invisible watermark" in str(
        by_type["markdown"].data
    )
    assert '"identity_model": "dlib-resnet-v1"' in str(by_type["markdown"].data)
    items = {row["item"]: row for row in table_rows(by_type["table"])}
    assert {"load", "detect", "align", "fuse", "postprocess", "quality", "store", "device"} <= set(
        items
    )
    assert items["faces replaced"]["value"] == "1"
    assert items["detect"]["detail"].startswith("done")
    assert by_type["progress"].data == 100.0
    assert by_type["progress"].description == "Finished: succeeded."
    # The final artifacts are written once the run's final state is recorded: they never
    # hold it up (nor the relay's notice of the job's end) on a busy server.
    assert run.end_time is not None
    finals = [by_type["table"].created, by_type["markdown"].created, by_type["progress"].updated]
    assert all(at is not None and at >= run.end_time for at in finals), (finals, run.end_time)
    assert stages_seen(run_id, inline) == {stage: (1, "Completed") for stage in STAGE_RUNS}
    # the fault suite's observer counts the run as its job's one result writer either way
    api_url = str(PREFECT_API_URL.value())
    assert inline_stages(api_url, [str(run_id)]) == {str(run_id): STAGE_RUNS if inline else set()}
    assert prefect_writers(api_url, [params["job_id"]]) == {params["job_id"]: 1}
    # Stage task runs carry no per-job tags: Prefect acquires a tag concurrency lease for
    # every tag of every task run, a fresh one per job, which stalled warm runs ≈ 2 s.
    stage_runs = task_runs(run_id)
    assert all(not r.tags for r in stage_runs.values()), {n: r.tags for n, r in stage_runs.items()}


def test_per_face_mapping_loads_every_source_and_moderates_it(prefect_harness: Home) -> None:
    """Two sources onto t1's first and last faces in reading order; a third source that
    moderation blocks fails the job before detection."""
    astronaut = prefect_harness.put_input(samples.astronaut_jpeg_bytes())
    t1 = prefect_harness.put_input(samples.t1_jpeg_bytes())
    grace = prefect_harness.put_input(samples.grace_hopper_jpeg_bytes())
    mapping = [{"source": 0, "target": 0}, {"source": 1, "target": 5}]
    params = job_params(astronaut, t1, extra_source_keys=[grace], options={"mapping": mapping})
    FuseFacesParams.model_validate(params)
    state = fuse_faces(**params, return_state=True)
    assert state.is_completed(), state.message
    ref = ResultRef.model_validate(state.result())
    assert ref.faces_replaced == 2
    assert ref.quality is not None and len(ref.quality.faces) == 2

    wheel = prefect_harness.put_input(samples.encode(samples.colorwheel_rgb(), "PNG"), "png")
    blocked = job_params(
        astronaut, t1, extra_source_keys=[grace, wheel], options={"mapping": mapping}
    )
    state = fuse_faces(**blocked, return_state=True)
    assert state.is_failed()
    assert state.message is not None and state.message.startswith("[content_blocked] ")
    assert "source 2" in state.message


@STAGE_MODES
def test_no_face_found_is_not_retried(prefect_harness: Home, inline: bool) -> None:
    params = job_params(
        prefect_harness.put_input(samples.no_face_jpeg_bytes()),
        prefect_harness.put_input(samples.grace_hopper_jpeg_bytes()),
        settings_block=stage_settings(inline, "detect-retries", stage_retries={"detect": 3}),
    )
    state = fuse_faces(**params, return_state=True)
    assert state.is_failed()
    assert state.message is not None and state.message.startswith("[no_face_found] ")
    assert stages_seen(state.state_details.flow_run_id, inline)["detect"] == (1, "Failed")


@STAGE_MODES
def test_content_blocked_is_not_retried_and_no_face_model_runs(
    prefect_harness: Home, inline: bool
) -> None:
    params = job_params(
        prefect_harness.put_input(samples.astronaut_jpeg_bytes()),
        prefect_harness.put_input(samples.encode(samples.colorwheel_rgb(), "PNG"), "png"),
        settings_block=stage_settings(
            inline, "moderation-retries", stage_retries={"moderate_inputs": 3}
        ),
    )
    state = fuse_faces(**params, return_state=True)
    assert state.is_failed()
    assert state.message is not None and state.message.startswith("[content_blocked] ")
    assert stages_seen(state.state_details.flow_run_id, inline) == {
        "load": (1, "Completed"),
        "moderate_inputs": (1, "Failed"),
    }


def test_moderation_report_only_and_off(prefect_harness: Home) -> None:
    target = samples.grace_hopper_rgb().copy()
    target[-300:, -300:] = cv2.resize(
        samples.colorwheel_rgb(), (300, 300), interpolation=cv2.INTER_AREA
    )
    keys = (
        prefect_harness.put_input(samples.astronaut_jpeg_bytes()),
        prefect_harness.put_input(samples.encode(target, "PNG"), "png"),
    )
    FusionSettings(moderation=ModerationPolicy(mode="report")).save("test-report", overwrite=True)
    state = fuse_faces(**job_params(*keys, settings_block="fusion-settings/test-report"))
    ref = ResultRef.model_validate(state)
    assert [m.split(":")[0] for m in ref.moderation] == ["target", "result"]

    FusionSettings(moderation=ModerationPolicy(mode="off")).save("test-off", overwrite=True)
    state = fuse_faces(
        **job_params(*keys, settings_block="fusion-settings/test-off"), return_state=True
    )
    assert state.is_completed(), state.message
    assert ResultRef.model_validate(state.result()).moderation == []
    run_id = state.state_details.flow_run_id
    seen = stages_seen(run_id, inline=True)  # the default settings: no stage task runs
    assert "fuse" in seen and not {"moderate_inputs", "moderate_result"} & set(seen)
    details = {row["item"]: row["detail"] for row in table_rows(run_artifacts(run_id)["table"])}
    assert details["moderate_inputs"] == details["moderate_result"] == "skipped"


def test_marking_failure_fails_the_job_unless_marking_is_off(prefect_harness: Home) -> None:
    keys = (
        prefect_harness.put_input(samples.astronaut_jpeg_bytes()),
        prefect_harness.put_input(samples.grace_hopper_jpeg_bytes()),
    )
    good = load_credentials(DEFAULT_SIGNING_BLOCK)
    stranger = make_chain("someone else")[0]
    save_credentials(
        Credentials(good.cert_chain_pem, stranger.private_key_pem), "test-mismatched-key"
    )
    params = job_params(*keys, signing_block="secret/test-mismatched-key")
    state = fuse_faces(**params, return_state=True)
    assert state.is_failed()
    assert state.message is not None and state.message.startswith("[marking_failed] ")
    failure = stored_failure(params["job_id"])
    assert (failure.code, failure.retryable, failure.stage) == ("marking_failed", False, "store")

    missing = job_params(*keys, signing_block="secret/no-such-signing-block")
    state = fuse_faces(**missing, return_state=True)
    assert state.is_failed()
    assert state.message is not None and state.message.startswith("[marking_failed] ")

    FusionSettings(marking="off").save("test-unmarked", overwrite=True)
    unmarked = job_params(
        *keys,
        signing_block="secret/no-such-signing-block",
        settings_block="fusion-settings/test-unmarked",
    )
    state = fuse_faces(**unmarked, return_state=True)
    assert state.is_completed(), state.message
    ref = ResultRef.model_validate(state.result())
    marks = inspect_file(read_bytes(DEFAULT_STORAGE_BLOCK, ref.key))
    assert not marks.manifest.present and marks.watermark is None
    assert ref.marks == []


def test_past_deadline_fails_fast_without_models(prefect_harness: Home) -> None:
    loads = MODEL_CACHE.total_loads()
    params = job_params("inputs/aa/missing.jpg", "inputs/bb/missing.jpg", seconds=-5)
    start = time.monotonic()
    state = fuse_faces(**params, return_state=True)
    elapsed = time.monotonic() - start
    assert state.is_failed()
    assert state.message is not None and state.message.startswith("[deadline_exceeded] ")
    assert MODEL_CACHE.total_loads() == loads
    run_id = state.state_details.flow_run_id
    assert run_id is not None
    assert task_runs(run_id) == {}
    assert elapsed < 5.0
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(run_id)
    assert run.state is not None and run.state.message == state.message


@STAGE_MODES
def test_slow_stage_ends_at_the_deadline(
    prefect_harness: Home, monkeypatch: pytest.MonkeyPatch, inline: bool
) -> None:
    def stuck(*args: object, **kwargs: object) -> object:
        time.sleep(120)
        raise AssertionError("not interrupted")

    monkeypatch.setattr(pipeline, "fuse_stage", stuck)
    # The stages before fuse must end well inside the 8 s: moderation (≈ 0.5-1 s on a
    # loaded 2-core machine) is not what this test is about.
    settings = stage_settings(inline, "no-moderation", moderation=ModerationPolicy(mode="off"))
    seconds = 8.0
    params = job_params(
        prefect_harness.put_input(samples.astronaut_jpeg_bytes()),
        prefect_harness.put_input(samples.grace_hopper_jpeg_bytes()),
        seconds=seconds,
        settings_block=settings,
    )
    state = fuse_faces(**params, return_state=True)
    overshoot = (datetime.now(UTC) - params["deadline_at"]).total_seconds()
    assert state.is_failed()
    assert state.message is not None and state.message.startswith("[deadline_exceeded] ")
    assert overshoot < 1.5, f"ended {overshoot:.2f} s after the deadline"
    assert stages_seen(state.state_details.flow_run_id, inline)["fuse"] == (1, "TimedOut")
    assert params["deadline_at"] - timedelta(seconds=seconds) < datetime.now(UTC)


def test_missing_input_is_a_permanent_invalid_input(prefect_harness: Home) -> None:
    params = job_params(
        "inputs/aa/absent.jpg", prefect_harness.put_input(samples.grace_hopper_jpeg_bytes())
    )
    state = fuse_faces(**params, return_state=True)
    assert state.message is not None and state.message.startswith("[invalid_input] ")
    assert stages_seen(state.state_details.flow_run_id, inline=True)["load"] == (1, "Failed")


def test_a_running_stage_is_published_for_the_relay(
    prefect_harness: Home, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stage that lasts longer than the progress delay is named by the run's progress
    artifact while it runs, as the relay's sync reads it."""
    from flows.artifacts import PROGRESS_DELAY_S
    from webapi.prefect_api import PrefectAPI
    from webapi.relay.sync import stage_of

    seen: list[str | None] = []
    real_detect = pipeline.detect_stage_batch

    def slow_detect(*args: Any, **kwargs: Any) -> Any:
        run_id = str(flow_run.get_id())
        time.sleep(PROGRESS_DELAY_S + 1.0)
        with PrefectAPI(str(PREFECT_API_URL.value())) as api:
            run = api.read_flow_run(run_id)
            assert run is not None
            seen.append(stage_of(run, api.read_progress([run_id]).get(run_id)))
        return real_detect(*args, **kwargs)

    monkeypatch.setattr(pipeline, "detect_stage_batch", slow_detect)
    params = job_params(
        prefect_harness.put_input(samples.astronaut_jpeg_bytes()),
        prefect_harness.put_input(samples.grace_hopper_jpeg_bytes()),
    )
    state = fuse_faces(**params, return_state=True)
    assert state.is_completed(), state.message
    assert seen == ["detect"]


def test_identity_reference_moderation_and_encoding_run_beside_other_stages(
    prefect_harness: Home, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As fuse_images does: the quality stage's identity reference starts on a worker thread
    while align runs, the result's moderation and encoding while the quality stage runs;
    the result and its report are those of the stages one after the other."""
    params = job_params(
        prefect_harness.put_input(samples.astronaut_jpeg_bytes()),
        prefect_harness.put_input(samples.grace_hopper_jpeg_bytes()),
    )
    overlap = probe_overlap(monkeypatch)

    state = fuse_faces(**params, return_state=True)

    assert state.is_completed(), state.message
    assert overlap.waited == {"align_stage": [True], "checked_stage": [True]}
    for name in ("reference_stage", "moderate_result_stage", "marked_encode_stage"):
        assert overlap.threads[name] and all(
            thread.startswith("faceflow-stage") for thread in overlap.threads[name]
        )
    ref = ResultRef.model_validate(state.result())
    assert ref.quality is not None and ref.quality.faces[0].found
    assert ref.quality.source_similarity is not None and ref.moderation == []
