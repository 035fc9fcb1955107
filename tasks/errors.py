"""Typed pipeline errors: permanent (never retried) versus transient.

Every error carries a stable machine-readable ``code`` (a ``JobErrorCode``: the one list of
codes is ``tasks.error_codes``) and a ``public_message`` that is safe to show to API users
(no paths, no internals). This module imports nothing heavy, so the webapi may map codes
without importing the pipeline.
"""

from __future__ import annotations

import traceback
from typing import ClassVar, TypeVar

from tasks.error_codes import JobErrorCode

E = TypeVar("E", bound=BaseException)


class FaceFlowError(Exception):
    """Base of every error the pipeline raises on purpose."""

    code: ClassVar[JobErrorCode] = JobErrorCode.internal_error
    permanent: ClassVar[bool] = False
    default_message: ClassVar[str] = "The job failed."

    def __init__(self, message: str | None = None, *, detail: str | None = None) -> None:
        self.public_message = message or self.default_message
        self.detail = detail
        super().__init__(
            self.public_message if detail is None else f"{self.public_message} ({detail})"
        )

    @property
    def message(self) -> str:
        """The public message with the detail, if any: ``str(self)`` without the code."""
        return super().__str__()

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}"


class PermanentError(FaceFlowError):
    """The same input will fail the same way: never retry."""

    permanent = True


class TransientError(FaceFlowError):
    """A failure that may pass on another attempt (resource exhaustion, I/O hiccup)."""

    code = JobErrorCode.transient_error
    default_message = "A temporary failure interrupted the job."


class InvalidInput(PermanentError):
    """The input is not an acceptable image or the options are invalid."""

    code = JobErrorCode.invalid_input
    default_message = "The input is not a valid image."


class UnsupportedFormat(InvalidInput):
    """The image format is not one of JPEG, PNG or WebP."""

    code = JobErrorCode.unsupported_format
    default_message = "Unsupported image format: use JPEG, PNG or WebP."


class ImageTooLarge(InvalidInput):
    """The image exceeds the byte or pixel limit (decompression bombs included)."""

    code = JobErrorCode.image_too_large
    default_message = "The image exceeds the size limits."


class JobTooLarge(ImageTooLarge):
    """The job's images together decode to more pixels than a job may hold."""

    code = JobErrorCode.job_too_large
    default_message = "The job's images together exceed the pixel budget of a job."


class OverBatchBudget(TransientError):
    """The job's images did not fit in the pixel budget of the batch run it was sent in
    (the relay plans batches within it: it is sent again in another run)."""

    code = JobErrorCode.over_batch_budget
    default_message = "The job did not fit in the memory budget of the batch it was sent in."


class ImageTooSmall(InvalidInput):
    """The image is too small to hold a face."""

    code = JobErrorCode.image_too_small
    default_message = "The image is too small."


class InvalidVideo(InvalidInput):
    """The video cannot be read: not a container, corrupt, truncated or undecodable."""

    code = JobErrorCode.invalid_video
    default_message = "The video could not be read (corrupt or truncated file)."


class UnsupportedVideo(InvalidInput):
    """The container or codec is not one of MP4, MOV, MKV, WebM; H.264, H.265, VP9, AV1."""

    code = JobErrorCode.unsupported_video
    default_message = "Unsupported video: use MP4, MOV, MKV or WebM with H.264, H.265, VP9 or AV1."


class VideoTooLarge(InvalidInput):
    """The video file exceeds the byte limit."""

    code = JobErrorCode.video_too_large
    default_message = "The video file exceeds the size limit."


class VideoTooLong(InvalidInput):
    """The video lasts longer than the duration limit."""

    code = JobErrorCode.video_too_long
    default_message = "The video exceeds the duration limit."


class VideoResolutionTooHigh(InvalidInput):
    """The video's longest side exceeds the resolution limit."""

    code = JobErrorCode.video_resolution_too_high
    default_message = "The video exceeds the resolution limit."


class VideoFrameRateTooHigh(InvalidInput):
    """The video's average frame rate exceeds the limit."""

    code = JobErrorCode.video_frame_rate_too_high
    default_message = "The video exceeds the frame rate limit."


class NoFaceFound(PermanentError):
    """No face was detected where one is required."""

    code = JobErrorCode.no_face_found
    default_message = "No face was found in the image."


class FaceLost(PermanentError):
    """The fused face is no longer detected in the result (every fuser setting tried)."""

    code = JobErrorCode.face_lost
    default_message = "The fused face could not be found in the result."


class PoseMismatch(PermanentError):
    """A source and a target face differ in pose beyond the limits (``tasks.pose``), and
    the job asked to refuse such a result (``on_pose_mismatch="refuse"``)."""

    code = JobErrorCode.pose_mismatch
    default_message = (
        "The source face's pose differs too much from the target face's for a natural result."
    )


class ModelUnavailable(PermanentError):
    """A model file is missing or does not match its pinned SHA-256."""

    code = JobErrorCode.model_unavailable
    default_message = "A required model is not available on this worker."


class ContentBlocked(PermanentError):
    """Moderation flagged an input or the result (NSFW): the same images fail the same way."""

    code = JobErrorCode.content_blocked
    default_message = "The images were refused by content moderation."


class DeadlineExceeded(PermanentError):
    """The job's deadline passed (or too little time is left for the next stage)."""

    code = JobErrorCode.deadline_exceeded
    default_message = "The job did not finish before its deadline."


class VideoAssemblyFailed(TransientError):
    """A joined video does not match its source (frame count, duration, segments that do
    not fit together): a segment was lost or damaged; rendering it again may pass."""

    code = JobErrorCode.video_assembly_failed
    default_message = "The video result could not be assembled."


class MarkingFailed(PermanentError):
    """The result could not be marked (watermark or signed C2PA manifest): a missing or
    unusable signing certificate or key. With marking required (the settings block's
    ``marking``), a result is never returned unmarked."""

    code = JobErrorCode.marking_failed
    default_message = "The result could not be signed with its Content Credentials."


class RunBindingInvalid(PermanentError):
    """The run's parameters do not carry a valid binding to their job (``flows.binding``):
    they were changed after the relay signed them, or the run was not created by the relay.
    The flow refuses the job before reading any input."""

    code = JobErrorCode.run_binding_invalid
    default_message = "The job's run was refused: its parameters were not issued for it."


PERMANENT_CODES: frozenset[JobErrorCode] = frozenset(
    cls.code
    for cls in (
        InvalidInput,
        UnsupportedFormat,
        ImageTooLarge,
        JobTooLarge,
        ImageTooSmall,
        InvalidVideo,
        UnsupportedVideo,
        VideoTooLarge,
        VideoTooLong,
        VideoResolutionTooHigh,
        VideoFrameRateTooHigh,
        NoFaceFound,
        FaceLost,
        PoseMismatch,
        ModelUnavailable,
        ContentBlocked,
        DeadlineExceeded,
        RunBindingInvalid,
        MarkingFailed,
    )
)


def is_permanent(exc: BaseException) -> bool:
    """Whether an exception must not be retried."""
    return isinstance(exc, FaceFlowError) and exc.permanent


def as_job_error(exc: BaseException) -> FaceFlowError:
    """The typed error an exception becomes for its job: a ``FaceFlowError`` as it is,
    anything else an ``internal_error`` (not permanent: another attempt may pass)."""
    if isinstance(exc, FaceFlowError):
        return exc
    return FaceFlowError(detail=type(exc).__name__)


def drop_frames(exc: E) -> E:
    """``exc`` without the frames it was raised through (``exc`` itself is returned).

    A traceback keeps every frame it passed through alive, and each frame its locals: a
    stage's failure would hold the job's decoded images for as long as the error is kept
    (on the job's ``Work``, which the frames reference back, and in the flow run's final
    Prefect state, which outlives the run in a warm worker). The frames' locals are
    cleared and the traceback detached, for ``exc`` and the exceptions it chains
    (``__cause__``, ``__context__``, an ``ExceptionGroup``'s members); frames still
    running are left alone."""
    seen: set[int] = set()
    pending: list[BaseException] = [exc]
    while pending:
        error = pending.pop()
        if id(error) in seen:
            continue
        seen.add(id(error))
        if error.__traceback__ is not None:
            traceback.clear_frames(error.__traceback__)
            error.__traceback__ = None
        pending.extend(e for e in (error.__cause__, error.__context__) if e is not None)
        if isinstance(error, BaseExceptionGroup):
            pending.extend(error.exceptions)
    return exc
