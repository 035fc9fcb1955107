"""Typed errors and options: stable codes, permanence, Literal-derived choices."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from tasks import errors
from tasks.options import DETECTORS, FUSERS, FusionOptions


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
