"""The contract between the webapi and the ``fuse-faces`` flow.

Torch-free and Prefect-free, so the webapi can build parameters and read results
without importing the pipeline. Storage keys are the only way bytes travel: the webapi
writes inputs under ``inputs/``, the flow writes the result image and a small JSON
sidecar (``ResultRef``) under ``results/``; the relay reads the sidecar after the run.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import datetime
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from tasks.error_codes import JobErrorCode
from tasks.errors import FaceFlowError
from tasks.options import FusionOptions
from tasks.report import QualityReport

DEFAULT_STORAGE_BLOCK = "local-file-system/faceflow-storage"
DEFAULT_SETTINGS_BLOCK = "fusion-settings/default"
DEFAULT_SIGNING_BLOCK = "secret/faceflow-c2pa-signing"
"""The Secret block holding the certificate chain and key that sign results (``blocks.signing``)."""
FLOW_NAME = "fuse-faces"
DEPLOYMENT_NAME = "fuse-faces"
BATCH_FLOW_NAME = "fuse-batch"
BATCH_DEPLOYMENT_NAME = "fuse-batch"
VIDEO_FLOW_NAME = "fuse-video"
VIDEO_DEPLOYMENT_NAME = "fuse-video"
VIDEO_PART_FLOW_NAME = "fuse-video-part"
VIDEO_ANALYSE_DEPLOYMENT = "video-analyse"
VIDEO_RENDER_DEPLOYMENT = "video-render"
"""The two deployments of ``fuse-video-part`` on the GPU pool's ``video`` queue that a
``fuse-video`` coordinator fans a video out to: its analysis, then one run per chunk."""

FINAL_STAGE = "store"
"""The stage a succeeded job last went through (the relay records it on success): the last
of ``tasks.stages.PIPELINE``, which the webapi does not import (a test keeps them equal)."""

STAGE_DONE_LOG = "Stage %s attempt %d done in %.1f ms, %.2f s left to the deadline"
STAGE_FAILED_LOG = "Stage %s attempt %d failed after %.1f ms: %r; %s"
"""The run-log lines of a stage run inline (``flows.deadline.StageGuard.call``): stage,
attempt, milliseconds; ``STAGE_LINE`` reads them."""
STAGE_LINE = re.compile(r"^Stage (?P<stage>\w+) attempt (?P<attempt>\d+) (?P<how>done|failed)")


class JobAttempt(BaseModel):
    """One job attempt as a flow receives it: a ``fuse-faces`` run's parameters (with the
    blocks) or one entry of a ``fuse-batch`` run's ``jobs``."""

    model_config = ConfigDict(extra="forbid")

    job_id: str = Field(description="The job's id (UUID string).")
    owner_id: str = Field(description="The owning user's id, for tags and audit.")
    source_key: str = Field(description="Storage key of the source (face) image.")
    target_key: str = Field(description="Storage key of the target photo.")
    extra_source_keys: list[str] = Field(
        default_factory=list,
        description="Storage keys of the sources after the first (per-face mapping).",
    )
    reference_keys: list[str] = Field(
        default_factory=list,
        description="Storage keys of the reference images a per-face mapping names.",
    )
    options: FusionOptions = Field(default_factory=FusionOptions, description="Fusion options.")
    deadline_at: datetime = Field(description="This job's absolute UTC deadline.")
    attempt: int = Field(1, ge=1, description="Flow-run attempt number for this job (1-based).")
    binding: str | None = Field(
        None,
        description="The relay's signature over this job's parameters (flows.binding): the "
        "flow refuses the job when it does not match them.",
    )

    @classmethod
    def of_run(cls, parameters: Mapping[str, Any]) -> JobAttempt:
        """The job attempt of a single-job flow run, from its parameters (``locals()`` at
        the flow's start): those that are fields, a ``None`` one as its default (an empty
        key list, default options); the blocks and other run settings are left out."""
        fields = cls.model_fields
        return cls.model_validate(
            {
                name: value
                for name, value in parameters.items()
                if name in fields and value is not None
            }
        )


class FuseFacesParams(JobAttempt):
    """Parameters of one ``fuse-faces`` flow run, as the relay sends them."""

    storage_block: str = Field(DEFAULT_STORAGE_BLOCK, description="Storage block document name.")
    settings_block: str = Field(DEFAULT_SETTINGS_BLOCK, description="FusionSettings block name.")
    signing_block: str = Field(
        DEFAULT_SIGNING_BLOCK, description="Secret block whose certificate marks the result."
    )


class FuseBatchParams(BaseModel):
    """Parameters of one ``fuse-batch`` flow run: several job attempts that share a run.

    ``deadline_at`` is the latest of the jobs' deadlines: the warm worker kills the run
    past it (plus grace); each job's own deadline is enforced inside the flow.
    """

    model_config = ConfigDict(extra="forbid")

    jobs: list[JobAttempt] = Field(min_length=1, description="The job attempts of this run.")
    deadline_at: datetime = Field(description="Latest deadline of the jobs (the run's limit).")
    storage_block: str = Field(DEFAULT_STORAGE_BLOCK, description="Storage block document name.")
    settings_block: str = Field(DEFAULT_SETTINGS_BLOCK, description="FusionSettings block name.")
    signing_block: str = Field(
        DEFAULT_SIGNING_BLOCK, description="Secret block whose certificate marks the result."
    )


def _known_code(value: object) -> object:
    """A record's code as a ``JobErrorCode``, an unknown string as the fallback
    (``JobErrorCode.parse``); anything else is left for validation to refuse."""
    return JobErrorCode.parse(value) if isinstance(value, str) else value


class JobFailure(BaseModel):
    """Why one job attempt failed, written as ``result_error_key`` by the flow (``fuse-faces``
    and ``fuse-batch`` alike): the relay fails a job only on this record, never on a run's
    state. ``retryable``: a transient failure the relay may re-dispatch while attempts and
    time remain."""

    code: Annotated[JobErrorCode, BeforeValidator(_known_code)] = Field(
        description="Stable error code; one this version does not list reads as "
        "``internal_error`` (``tasks.error_codes``)."
    )
    message: str = Field(description="Safe public message.")
    retryable: bool = Field(False, description="Whether another attempt may succeed.")
    stage: str | None = Field(None, description="The stage the job failed in.")
    flow_run_id: str | None = Field(
        None,
        description="The flow run that wrote it: the relay takes it only from the run the "
        "job holds (a record without one is taken as from that run).",
    )

    @classmethod
    def of(
        cls, error: FaceFlowError, *, stage: str | None = None, flow_run_id: str | None = None
    ) -> JobFailure:
        """The record of ``error``: its code and public message; retryable unless permanent."""
        return cls(
            code=error.code,
            message=error.public_message,
            retryable=not error.permanent,
            stage=stage,
            flow_run_id=flow_run_id,
        )


class ResultRef(BaseModel):
    """What a successful run returns and writes as ``result_meta_key``: no image bytes."""

    key: str = Field(description="Storage key of the result image.")
    content_type: str = Field(description="MIME type of the result image.")
    width: int
    height: int
    faces_replaced: int = 0
    device: str = "cpu"
    timings_ms: dict[str, float] = Field(default_factory=dict)
    quality: QualityReport | None = Field(None, description="The result's quality report.")
    moderation: list[str] = Field(
        default_factory=list,
        description="What a report-only moderation check flagged (role: label score).",
    )
    marks: list[str] = Field(
        default_factory=list,
        description="How the result is marked (docs/provenance.md): c2pa (signed Content "
        "Credentials), watermark (in its pixels); empty when marking is off.",
    )


class VideoResultRef(ResultRef):
    """What a successful ``fuse-video`` run returns and writes as ``result_meta_key``."""

    frames: int = Field(description="Frames of the result (the input's).")
    duration_s: float = Field(description="Duration of the result's video stream.")
    chunks: int = Field(description="Render chunks of the video.")
    chunks_rendered: int = Field(
        description="Chunks this attempt rendered (the others were found in storage)."
    )
    cuts: list[int] = Field(default_factory=list, description="Frames that start a scene.")
    switches: int = Field(0, description="Identity switches of the face plan.")
    tracks: list[dict[str, Any]] = Field(
        default_factory=list, description="The report per track (tasks.video.TrackReport)."
    )
    frame_failures: dict[str, int] = Field(
        default_factory=dict, description="Frames a stage failed on (kept unchanged), by code."
    )


def video_chunk_key(name: str) -> str:
    """Storage key of a rendered chunk (``tasks.video.chunk_name``: named by content, so
    any attempt of any job with the same video, plan, sources and options reuses it)."""
    return f"video-chunks/{name}"


def input_key(digest: str, ext: str) -> str:
    """Storage key of an input image stored by content hash (sha256 hex)."""
    return f"inputs/{digest[:2]}/{digest}.{ext}"


def result_key(job_id: str, attempt: int, ext: str) -> str:
    """Storage key of a job attempt's result image."""
    return f"results/{job_id}/attempt-{attempt}.{ext}"


def result_meta_key(job_id: str, attempt: int) -> str:
    """Storage key of the JSON ``ResultRef`` sidecar of a job attempt."""
    return f"results/{job_id}/attempt-{attempt}.json"


class JobProgress(BaseModel):
    """How far a video job attempt is, as ``fuse-video`` writes it (``progress_key``) and
    the API shows it on the job (``JobPublic.progress``)."""

    frames_analysed: int = Field(
        0,
        ge=0,
        description="Frames through the analysis pass so far (faces found in every frame, "
        "before any is fused; ranges analysed by an earlier attempt count). It reaches "
        "frames_total before the render starts.",
    )
    frames_done: int = Field(ge=0, description="Frames fused so far (stored chunks count).")
    frames_total: int = Field(ge=0, description="Frames of the video (0 until probed).")
    chunks_done: int = Field(ge=0, description="Render chunks finished.")
    chunks_total: int = Field(ge=0, description="Render chunks of the video (0 until planned).")
    fps: float | None = Field(
        None,
        description="Frames per second of the pass running, by this attempt: analysed "
        "during stage analyse, fused during render_chunk.",
    )
    eta_seconds: float | None = Field(
        None,
        description="Estimated seconds until every frame is fused: during the analysis, the "
        "frames left to analyse and all the frames to fuse at the analysis's rate; during "
        "the render, the frames left to fuse at the render's rate.",
    )
    stage: str | None = Field(
        None, description="The step the attempt is in (probe, analyse, render_chunk, join, …)."
    )
    updated_at: datetime | None = Field(None, description="When the flow wrote it.")


def progress_key(job_id: str, attempt: int) -> str:
    """Storage key of a video job attempt's ``JobProgress`` (rewritten as it advances)."""
    return f"results/{job_id}/attempt-{attempt}.progress.json"


def chunks_manifest_key(job_id: str, attempt: int) -> str:
    """Storage key of the JSON list of chunk keys (``video_chunk_key``) a video job
    attempt renders into: retention deletes them with the job's inputs."""
    return f"results/{job_id}/attempt-{attempt}.chunks.json"


def video_plan_key(job_id: str, attempt: int) -> str:
    """Storage key of a video job attempt's plan (probe, then chunks and face plan),
    written by its probe and plan parts and read by its other parts and coordinator."""
    return f"results/{job_id}/attempt-{attempt}.plan.pkl"


def video_analysis_key(name: str) -> str:
    """Storage key of the analysis of a video's frame range (``tasks.video_analysis``'s
    ``range_name``: named by content, so any attempt reuses it)."""
    return f"video-analysis/{name}"


def analysis_manifest_key(job_id: str, attempt: int) -> str:
    """Storage key of the JSON list of analysis keys (``video_analysis_key``) a video job
    attempt analyses into: retention deletes them with the job's inputs."""
    return f"results/{job_id}/attempt-{attempt}.analysis.json"


def analysis_part(start: int, stop: int) -> str:
    """The ``fuse-video-part`` part name of the analysis of frames ``[start, stop)``."""
    return f"analyse-{start:06d}-{stop:06d}"


def chunk_part(index: int) -> str:
    """The ``fuse-video-part`` part name of chunk ``index``'s render."""
    return f"chunk-{index:04d}"


def part_progress_key(job_id: str, attempt: int, part: str) -> str:
    """Storage key of the frames one range or render part of a video job attempt has
    analysed or rendered so far (``{"frames": n}``, rewritten as it goes): the
    coordinator's progress adds them."""
    return f"results/{job_id}/attempt-{attempt}.parts/{part}.json"


_RANGE_KEY = re.compile(r"(?:^|/)analysis-(\d+)-(\d+)-[0-9a-f]+\.npz$")


def analysis_part_of(key: str) -> str | None:
    """The range part (``analysis_part``) whose analysis is stored under ``key`` (a
    ``video_analysis_key``), None for another key."""
    found = _RANGE_KEY.search(key)
    return None if found is None else analysis_part(int(found[1]), int(found[2]))


PROBE_PART, PLAN_PART, REPORT_PART = "probe", "plan", "report"
"""The ``fuse-video-part`` part names of the probe (probe, moderation of sampled input
frames, the sources' faces), the plan (cuts, chunks, face plan) and the report
(moderation of sampled result frames, each track's identity similarity to its source);
a range's is ``analysis_part(start, stop)``, a render part's ``chunk_part(index)``."""


def video_report_key(job_id: str, attempt: int) -> str:
    """Storage key of the report part's record (``flows.video_store.ReportRecord``), beside
    the render parts' (``part_progress_key``): its coordinator reads it."""
    return part_progress_key(job_id, attempt, REPORT_PART)


def video_parts_tag(job_id: str, attempt: int) -> str:
    """Tag of every ``fuse-video-part`` run of a job attempt: how a cancel of the
    attempt's coordinator run finds them (``webapi.relay.reap``)."""
    return f"video-of:{job_id}:{attempt}"


def result_error_key(job_id: str, attempt: int) -> str:
    """Storage key of the JSON ``JobFailure`` of a job attempt that failed."""
    return f"results/{job_id}/attempt-{attempt}.error.json"


def stop_marker_key(job_id: str, attempt: int) -> str:
    """Storage key the relay writes when a job attempt that shares its run with other jobs
    ends early (cancelled, expired, overdue, re-dispatched): the ``fuse-batch`` run skips
    that job when it sees the marker, instead of the whole run being cancelled."""
    return f"results/{job_id}/attempt-{attempt}.stop"


def run_tags(job_id: str, owner_id: str) -> list[str]:
    """Tags of a job's flow runs (set by the relay at creation), so operators can find
    them in the Prefect UI. Task runs do not carry them: Prefect looks up tag concurrency
    limits for every tag of every task run, a per-job tag costs a lease round trip per
    stage (and stalled runs for ≈ 2 s under a burst)."""
    return [f"job:{job_id}", f"owner:{owner_id}"]


def batch_tags(jobs: list[JobAttempt]) -> list[str]:
    """Tags of a ``fuse-batch`` run: every job's and owner's tag, so an operator with a job
    id finds the run that carried it (``job:<id>`` in the UI's tag filter)."""
    tags = {tag for job in jobs for tag in run_tags(job.job_id, job.owner_id)}
    return ["batch", *sorted(tags)]


def batch_run_name(jobs: list[JobAttempt]) -> str:
    """Name of a ``fuse-batch`` run: its first job's id and how many more it carries."""
    return f"{jobs[0].job_id}+{len(jobs) - 1}" if len(jobs) > 1 else jobs[0].job_id


def idempotency_key(job_id: str, attempt: int) -> str:
    """Prefect idempotency key of a job attempt (keys are scoped per flow: globally unique)."""
    return f"job-{job_id}-attempt-{attempt}"
