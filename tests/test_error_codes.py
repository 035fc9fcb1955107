"""One set of job error codes (``tasks.error_codes.JobErrorCode``): every writer takes its
code from it, each code is stored as the same string as before, and a record with a code
this version does not list reads as the defined fallback."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from flows.params import JobFailure
from tasks import error_codes, errors
from tasks.error_codes import UNKNOWN, JobErrorCode
from webapi.errors import InvalidRequest, PayloadTooLarge
from webapi.relay.fetch import FetchError, FetchTimedOut

#: The strings stored in ``jobs.error_code`` and sent as ``error.code`` before the enum:
#: a renamed member would change what clients and old rows see.
STORED = {
    "internal_error", "transient_error", "invalid_input", "unsupported_format",
    "image_too_large", "job_too_large", "over_batch_budget", "image_too_small",
    "invalid_video", "unsupported_video", "video_too_large", "video_too_long",
    "video_resolution_too_high", "video_frame_rate_too_high", "video_assembly_failed",
    "no_face_found", "face_lost", "pose_mismatch", "model_unavailable", "content_blocked",
    "deadline_exceeded", "run_binding_invalid", "marking_failed", "dispatch_rejected",
    "queue_timeout",
    "worker_lost", "result_invalid", "input_fetch_failed", "input_fetch_timeout",
    "invalid_request", "payload_too_large", "cancelled", "result_missing",
}  # fmt: skip


def _subclasses(base: type[errors.FaceFlowError]) -> list[type[errors.FaceFlowError]]:
    found = [base]
    for sub in base.__subclasses__():
        found += _subclasses(sub)
    return found


def test_each_code_is_stored_as_the_same_string() -> None:
    assert {code.value for code in JobErrorCode} == STORED
    for code in JobErrorCode:
        assert code == code.value == code.name == str(code) == f"{code}"
        assert json.dumps({"code": code}) == json.dumps({"code": code.value})


def test_every_writer_takes_its_code_from_the_enum() -> None:
    classes = [cls for cls in _subclasses(errors.FaceFlowError) if "code" in vars(cls)]
    assert len(classes) > 15
    codes = [cls.code for cls in classes]
    assert all(isinstance(code, JobErrorCode) for code in codes)
    assert len(set(codes)) == len(codes), "two pipeline errors share a code"
    assert set(JobErrorCode) >= errors.PERMANENT_CODES
    assert isinstance(FetchError.code, JobErrorCode)
    assert isinstance(FetchTimedOut.code, JobErrorCode)
    # The fetch lane fails a job with these API errors' codes (an empty or too large input).
    assert isinstance(InvalidRequest.code, JobErrorCode)
    assert isinstance(PayloadTooLarge.code, JobErrorCode)


def test_a_record_with_an_unknown_code_reads_as_the_fallback() -> None:
    unknown = JobFailure.model_validate_json('{"code": "from_a_newer_flow", "message": "m"}')
    assert unknown.code is UNKNOWN is JobErrorCode.internal_error
    known = JobFailure.model_validate_json('{"code": "no_face_found", "message": "m"}')
    assert known.code is JobErrorCode.no_face_found
    assert json.loads(known.model_dump_json())["code"] == "no_face_found"
    assert JobErrorCode.parse("worker_lost") is JobErrorCode.worker_lost
    assert JobErrorCode.parse("") is UNKNOWN
    with pytest.raises(ValidationError):
        JobFailure.model_validate({"code": 7, "message": "m"})


def test_a_failure_record_carries_the_errors_code_public_message_and_retry() -> None:
    """The flow's and the stand-in flow's records both come from ``JobFailure.of``."""
    permanent = errors.NoFaceFound(detail="/tmp/inputs/source.jpg")
    failure = JobFailure.of(permanent, stage="detect", flow_run_id="run-1")
    assert failure.code is JobErrorCode.no_face_found
    assert failure.message == permanent.public_message
    assert "/tmp" not in failure.message
    assert (failure.retryable, failure.stage, failure.flow_run_id) == (False, "detect", "run-1")
    transient = JobFailure.of(errors.TransientError("storage hiccup"))
    assert (transient.code, transient.retryable, transient.stage, transient.flow_run_id) == (
        JobErrorCode.transient_error,
        True,
        None,
        None,
    )


def test_an_error_reads_with_and_without_its_code() -> None:
    error = errors.NoFaceFound(detail="source")
    assert error.message == "No face was found in the image. (source)"
    assert str(error) == "[no_face_found] No face was found in the image. (source)"


def test_the_codes_import_only_the_standard_library() -> None:
    """So that the webapi, the flows and the worker may all import them."""
    tree = ast.parse(Path(error_codes.__file__).read_text(encoding="utf-8"))
    imported = {
        name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for name in (
            [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module]
        )
        if name
    }
    assert imported and imported <= set(sys.stdlib_module_names), imported
