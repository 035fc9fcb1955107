"""Every code a job can end with: the one list, for every writer and reader.

A code is stored in ``jobs.error_code``, in the flows' ``JobFailure`` records and in the
API's and webhooks' ``error.code``, always as its string value (``JobErrorCode`` is a
``StrEnum``: ``JobErrorCode.no_face_found == "no_face_found"``). The pipeline's errors
(``tasks.errors``) carry theirs as ``code``; the relay writes its own (``worker_lost``,
``dispatch_rejected``, ``queue_timeout``, ...). Imports nothing but the standard library,
so the webapi, the flows and the worker may all use it.
"""

from __future__ import annotations

import logging
from enum import StrEnum, unique

log = logging.getLogger(__name__)


@unique
class JobErrorCode(StrEnum):
    """A job's error code; a new code is one member here (and its writer)."""

    # The pipeline (tasks.errors): the flows record these in the attempt's JobFailure.
    internal_error = "internal_error"  # an unexpected error in the flow (retryable)
    transient_error = "transient_error"  # a temporary failure; another attempt may pass
    invalid_input = "invalid_input"  # an input is not an acceptable image or is corrupt
    unsupported_format = "unsupported_format"  # an image is not JPEG, PNG or WebP
    image_too_large = "image_too_large"  # an image exceeds the byte or pixel limit
    job_too_large = "job_too_large"  # the job's images together exceed a job's pixels
    over_batch_budget = "over_batch_budget"  # did not fit its batch run: sent again
    image_too_small = "image_too_small"  # an image is too small to hold a face
    invalid_video = "invalid_video"  # the video is corrupt, truncated or undecodable
    unsupported_video = "unsupported_video"  # the video's container or codec is refused
    video_too_large = "video_too_large"  # the video file exceeds the byte limit
    video_too_long = "video_too_long"  # the video exceeds the duration limit
    video_resolution_too_high = "video_resolution_too_high"  # longest side over the limit
    video_frame_rate_too_high = "video_frame_rate_too_high"  # frame rate over the limit
    video_assembly_failed = "video_assembly_failed"  # joined chunks do not match the source
    no_face_found = "no_face_found"  # no face where one is required
    face_lost = "face_lost"  # the fused face is not found in the result
    pose_mismatch = "pose_mismatch"  # poses too far apart, refused as the caller asked
    model_unavailable = "model_unavailable"  # a model file is missing or fails its SHA-256
    content_blocked = "content_blocked"  # moderation refused an input or the result
    deadline_exceeded = "deadline_exceeded"  # the deadline passed (also written by the relay)
    run_binding_invalid = "run_binding_invalid"  # the run's parameters were not issued for it
    marking_failed = "marking_failed"  # the result could not be watermarked and signed (C2PA)
    # The relay (webapi.relay).
    dispatch_rejected = "dispatch_rejected"  # Prefect refused to create the job's flow run
    queue_timeout = "queue_timeout"  # the job did not start before its queue deadline
    worker_lost = "worker_lost"  # the run crashed or was lost and no attempt was left
    result_invalid = "result_invalid"  # the run stored a result record that cannot be read
    input_fetch_failed = "input_fetch_failed"  # an input URL could not be fetched
    input_fetch_timeout = "input_fetch_timeout"  # fetching an input URL ran out of time
    invalid_request = "invalid_request"  # an input fetched from its URL is empty
    payload_too_large = "payload_too_large"  # an input fetched from its URL is too large
    # The API (webapi.crud).
    cancelled = "cancelled"  # cancelled by its owner (or with its owner) while still queued
    # No longer written; kept so that jobs stored by older versions still read.
    result_missing = "result_missing"  # a run ended without a stored outcome

    @classmethod
    def parse(cls, value: str) -> JobErrorCode:
        """``value`` as a code; one not listed here (a record from another version or
        writer) as ``UNKNOWN``, logged."""
        try:
            return cls(value)
        except ValueError:
            log.warning("unknown job error code %r taken as %s", value[:64], UNKNOWN)
            return UNKNOWN


UNKNOWN = JobErrorCode.internal_error
"""The code a record's unknown code is read as: the job failed for a reason not listed."""
