"""The contract between the webapi and the ``fuse-faces`` flow.

Torch-free and Prefect-free, so the webapi can build parameters and read results
without importing the pipeline. Storage keys are the only way bytes travel: the webapi
writes inputs under ``inputs/``, the flow writes the result image and a small JSON
sidecar (``ResultRef``) under ``results/``; the relay reads the sidecar after the run.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

from tasks.options import FusionOptions

DEFAULT_STORAGE_BLOCK = "local-file-system/faceflow-storage"
DEFAULT_SETTINGS_BLOCK = "fusion-settings/default"
FLOW_NAME = "fuse-faces"
DEPLOYMENT_NAME = "fuse-faces"

StageName = Literal["load", "detect", "align", "fuse", "postprocess", "store"]
"""The flow's stages, in order: load (read + decode inputs) … store (write result)."""
STAGES: tuple[StageName, ...] = get_args(StageName)
FINAL_STAGE: StageName = STAGES[-1]
"""The stage a succeeded job last went through (the relay records it on success)."""


class FuseFacesParams(BaseModel):
    """Parameters of one ``fuse-faces`` flow run, as the relay sends them."""

    model_config = ConfigDict(extra="forbid")

    job_id: str = Field(description="The job's id (UUID string); also the flow-run name.")
    owner_id: str = Field(description="The owning user's id, for tags and audit.")
    source_key: str = Field(description="Storage key of the source (face) image.")
    target_key: str = Field(description="Storage key of the target photo.")
    options: FusionOptions = Field(default_factory=FusionOptions, description="Fusion options.")
    deadline_at: datetime = Field(description="Absolute UTC deadline shared by every attempt.")
    attempt: int = Field(1, ge=1, description="Flow-run attempt number for this job (1-based).")
    storage_block: str = Field(DEFAULT_STORAGE_BLOCK, description="Storage block document name.")
    settings_block: str = Field(DEFAULT_SETTINGS_BLOCK, description="FusionSettings block name.")


class ResultRef(BaseModel):
    """What a successful run returns and writes as ``result_meta_key``: no image bytes."""

    key: str = Field(description="Storage key of the result image.")
    content_type: str = Field(description="MIME type of the result image.")
    width: int
    height: int
    faces_replaced: int = 0
    device: str = "cpu"
    timings_ms: dict[str, float] = Field(default_factory=dict)


def input_key(digest: str, ext: str) -> str:
    """Storage key of an input image stored by content hash (sha256 hex)."""
    return f"inputs/{digest[:2]}/{digest}.{ext}"


def result_key(job_id: str, attempt: int, ext: str) -> str:
    """Storage key of a job attempt's result image."""
    return f"results/{job_id}/attempt-{attempt}.{ext}"


def result_meta_key(job_id: str, attempt: int) -> str:
    """Storage key of the JSON ``ResultRef`` sidecar of a job attempt."""
    return f"results/{job_id}/attempt-{attempt}.json"


def run_tags(job_id: str, owner_id: str) -> list[str]:
    """Tags of a job's flow runs (set by the relay at creation), so operators can find
    them in the Prefect UI. Task runs do not carry them: Prefect looks up tag concurrency
    limits for every tag of every task run, a per-job tag costs a lease round trip per
    stage (and stalled runs for ≈ 2 s under a burst)."""
    return [f"job:{job_id}", f"owner:{owner_id}"]


def idempotency_key(job_id: str, attempt: int) -> str:
    """Prefect idempotency key of a job attempt (keys are scoped per flow: globally unique)."""
    return f"job-{job_id}-attempt-{attempt}"
