"""Typed errors and options: stable codes, permanence, Literal-derived choices."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from tasks import errors
from tasks.options import DETECTORS, FUSERS, POSE_MISMATCH_POLICIES, FusionOptions


def test_codes_are_stable_and_permanence_is_typed() -> None:
    assert errors.NoFaceFound().code == "no_face_found"
    assert errors.InvalidInput().code == "invalid_input"
    assert errors.ModelUnavailable().code == "model_unavailable"
    assert errors.DeadlineExceeded().code == "deadline_exceeded"
    assert errors.is_permanent(errors.UnsupportedFormat())
    assert isinstance(errors.ImageTooLarge(), errors.InvalidInput)
    assert not errors.is_permanent(errors.TransientError())
    assert not errors.is_permanent(ValueError("x"))
    assert "no_face_found" in errors.PERMANENT_CODES


def test_message_format_carries_the_code_for_flow_states() -> None:
    exc = errors.NoFaceFound("No face was found in the target image.", detail="t1.jpg")
    assert str(exc) == "[no_face_found] No face was found in the target image. (t1.jpg)"
    assert exc.public_message == "No face was found in the target image."


def test_options_choices_come_from_literals_and_validate() -> None:
    assert DETECTORS == ("mtcnn", "scrfd") and FUSERS == ("classic", "inswapper")
    assert FusionOptions(face=2).face == 2
    with pytest.raises(ValidationError):
        FusionOptions(fuser="deepfake")  # type: ignore[arg-type]
    with pytest.raises(ValidationError):
        FusionOptions(identity_weight=1.5)
    with pytest.raises(ValidationError):
        FusionOptions(face=-1)
    with pytest.raises(ValidationError):
        FusionOptions(unknown=True)  # type: ignore[call-arg]


def test_pose_and_occluder_options_reach_the_api_contract() -> None:
    """The look options go through the API's JobCreate as any option: typed, strict, and
    sent on only when the caller set them."""
    from webapi.models import JobCreate

    assert POSE_MISMATCH_POLICIES == ("flag", "refuse")
    defaults = FusionOptions()
    assert defaults.on_pose_mismatch == "flag" and defaults.mirror_source
    assert defaults.keep_occluders
    job = JobCreate.model_validate(
        {"options": {"on_pose_mismatch": "refuse", "mirror_source": False}}
    )
    assert job.options.as_sent() == {"on_pose_mismatch": "refuse", "mirror_source": False}
    for bad in ({"on_pose_mismatch": "maybe"}, {"keep_occluders": "yes"}, {"mirror_source": 1}):
        with pytest.raises(ValidationError):
            JobCreate.model_validate({"options": bad})
    assert errors.PoseMismatch().code == "pose_mismatch"
    assert "pose_mismatch" in errors.PERMANENT_CODES


def test_contracts_import_without_torch_or_prefect() -> None:
    code = (
        "import sys, tasks.errors, tasks.options, flows.params;"
        "bad=[m for m in ('torch','prefect','cv2') if m in sys.modules];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_video_refusals_have_codes_and_http_statuses() -> None:
    from webapi.errors import pipeline_status

    statuses = {
        errors.VideoTooLarge(): (413, "video_too_large"),
        errors.UnsupportedVideo(): (415, "unsupported_video"),
        errors.InvalidVideo(): (422, "invalid_video"),
        errors.VideoTooLong(): (422, "video_too_long"),
        errors.VideoResolutionTooHigh(): (422, "video_resolution_too_high"),
        errors.VideoFrameRateTooHigh(): (422, "video_frame_rate_too_high"),
        errors.VideoAssemblyFailed(): (503, "video_assembly_failed"),
    }
    for exc, (status, code) in statuses.items():
        assert (pipeline_status(exc), exc.code) == (status, code)
        assert errors.is_permanent(exc) is (code in errors.PERMANENT_CODES)
    assert not errors.is_permanent(errors.VideoAssemblyFailed())


def test_every_api_error_has_its_own_answer() -> None:
    from webapi import errors as api_errors

    classes = [
        value
        for value in vars(api_errors).values()
        if isinstance(value, type) and issubclass(value, api_errors.ApiError)
    ]
    assert set(classes) == set(api_errors.API_ERRORS)
    codes = [answer.code for answer in api_errors.API_ERRORS.values()]
    assert len(set(codes)) == len(codes), "two API errors share a code"
    gone = api_errors.ResultExpired()
    assert (gone.status_code, gone.code, gone.message) == tuple(
        api_errors.API_ERRORS[api_errors.ResultExpired]
    )
