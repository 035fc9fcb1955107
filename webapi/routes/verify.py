"""``POST /v1/verify``: whether a file carries this service's marks, and for its owner which job.

The body is the file itself (an image, or an MP4: its manifest, and the watermark read
from 3 runs of 8 frames), as ``curl --data-binary @result.jpg``, at most
``verify_max_bytes`` (100 MiB). The answer says whether a Content Credentials manifest is
present, whether it validates (and chains to the trust anchors, ``c2pa_trust_anchors``),
who signed it, whether the invisible watermark is found and whether either says this
service made the file. The job id is told only to the job's owner: the watermark's job tag
is looked up among the caller's own jobs; anyone else learns only "made by this service".

Authenticated, limited to ``verify_per_minute`` requests per API key (429 with
``Retry-After``) and ``verify_threads`` decodes at once. The c2pa reader and the watermark
decoder (numpy, OpenCV, PyWavelets) are imported on the first verify, not with the app.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING

import anyio.to_thread
from fastapi import APIRouter, Request
from pydantic import BaseModel, Field
from sqlmodel import Session, col, select

from webapi.bodies import read_limited
from webapi.config import Settings
from webapi.deps import CurrentUser, ReadSessionDep, SettingsDep
from webapi.errors import InvalidRequest, RateLimited
from webapi.models import Job

if TYPE_CHECKING:
    from tasks.provenance import Inspection

router = APIRouter(prefix="/v1", tags=["verify"])
WINDOW_S = 60.0


class ManifestPublic(BaseModel):
    """A file's Content Credentials (C2PA manifest), as read."""

    present: bool = Field(description="Whether the file carries a C2PA manifest.")
    valid: bool = Field(
        description="Whether its signature and its hashes of the content check out (false for "
        "a file changed after signing)."
    )
    trusted: bool = Field(description="Whether the signer chains to a configured trust anchor.")
    signer: str | None = Field(None, description="The signing certificate's common name.")
    issuer: str | None = Field(None, description="The signing certificate's organisation.")
    claim_generator: str | None = Field(None, description="The software that made the claim.")
    digital_source_type: str | None = Field(None, description="The IPTC digital source type.")
    failures: list[str] = Field(default_factory=list, description="Validation failure codes.")


class WatermarkPublic(BaseModel):
    """The invisible watermark, as read."""

    checked: bool = Field(
        description="Whether the file is an image, or a video, large enough to carry the watermark."
    )
    present: bool = Field(description="Whether this service's watermark was found.")
    job_id: uuid.UUID | None = Field(
        None, description="The job it names: only when the caller owns that job."
    )


class VerifyReport(BaseModel):
    """What ``POST /v1/verify`` found in a file."""

    media_type: str | None = Field(description="The file's type, from its bytes.")
    made_by_this_service: bool = Field(
        description="Whether a valid manifest of this service or its watermark was found."
    )
    manifest: ManifestPublic
    watermark: WatermarkPublic


class VerifyLimiter:
    """At most ``per_minute`` verify requests per API key in any minute."""

    def __init__(self, per_minute: int) -> None:
        self.per_minute = per_minute
        self._seen: dict[uuid.UUID, deque[float]] = {}
        self._lock = threading.Lock()

    def admit(self, key: uuid.UUID, now: float | None = None) -> None:
        """Count a request of ``key``; ``RateLimited`` past the limit."""
        now = time.monotonic() if now is None else now
        with self._lock:
            seen = self._seen.setdefault(key, deque())
            while seen and seen[0] <= now - WINDOW_S:
                seen.popleft()
            if len(seen) >= self.per_minute:
                raise RateLimited(retry_after=seen[0] + WINDOW_S - now)
            seen.append(now)


_BODY = {
    "required": True,
    "description": "The file: a JPEG, PNG, WebP or MP4.",
    "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
}


@router.post(
    "/verify",
    response_model=VerifyReport,
    summary="Verify a file's marks",
    openapi_extra={"requestBody": _BODY},
    responses={
        401: {"description": "Missing or invalid API key."},
        413: {"description": "The file is larger than verify_max_bytes."},
        415: {"description": "Not a JPEG, PNG, WebP or MP4 file."},
        429: {"description": "Too many verify requests for this API key (Retry-After)."},
    },
)
async def verify_file(
    request: Request, user: CurrentUser, settings: SettingsDep, session: ReadSessionDep
) -> VerifyReport:
    """Whether the file in the body carries this service's Content Credentials and
    watermark; the job's id for its owner."""
    request.app.state.verify_rate.admit(user.id)
    data = await read_limited(request, settings.verify_max_bytes)
    if not data:
        raise InvalidRequest("Send the file as the request body.")
    found = await anyio.to_thread.run_sync(
        _inspect, data, settings, limiter=request.app.state.verify_limiter
    )
    job_id = None
    if found.watermark is not None:
        job_id = await anyio.to_thread.run_sync(_owned_job, session, user.id, found.watermark.tag)
    return VerifyReport(
        media_type=found.media_type,
        made_by_this_service=found.made_here,
        manifest=ManifestPublic.model_validate(found.manifest, from_attributes=True),
        watermark=WatermarkPublic(
            checked=found.watermark_checked, present=found.watermark is not None, job_id=job_id
        ),
    )


def _inspect(data: bytes, settings: Settings) -> Inspection:
    from tasks.provenance import inspect_file

    return inspect_file(data, trust_anchors(settings), settings.image_limits)


def trust_anchors(settings: Settings) -> str | None:
    """The PEM the verify endpoint trusts: ``c2pa_trust_anchors``, else the local stack's
    development root when there is one."""
    from tasks.provenance import dev_root_path

    path = settings.c2pa_trust_anchors or dev_root_path(Path(settings.home))
    return path.read_text() if path.is_file() else None


def _owned_job(session: Session, owner_id: uuid.UUID, tag: int) -> uuid.UUID | None:
    """The caller's job whose id starts with the watermark's 32-bit ``tag``, if any."""
    from tasks.watermark import tag_range

    low, high = tag_range(tag)
    statement = (
        select(Job.id)
        .where(Job.owner_id == owner_id, col(Job.id) >= low, col(Job.id) <= high)
        .limit(1)
    )
    return session.exec(statement).first()
