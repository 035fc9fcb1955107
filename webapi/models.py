"""The job store: users, API keys, jobs, the outbox and webhook delivery attempts.

Table models (``table=True``) are the database; ``*Create`` models are validated input and
``*Public`` models are what the API returns. Every timestamp is timezone-aware UTC in
Python and stored as naive UTC (``UTCDateTime``), identically on SQLite and PostgreSQL.

Who writes what:

- the API (``webapi.crud``) inserts users, jobs and the first ``dispatch`` outbox row;
- every job *status* change goes through ``webapi.jobstate.transition`` (compare-and-set);
- the relay leases outbox rows (``lease_owner``/``lease_until``), creates flow runs, syncs
  Prefect state into jobs, and records ``WebhookDelivery`` rows for each POST it makes.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Literal

import sqlalchemy as sa
from pydantic import AnyUrl, BaseModel, ConfigDict, StrictInt, field_validator, model_validator
from sqlalchemy.engine import Dialect
from sqlmodel import JSON, Field, SQLModel

from flows.params import JobProgress
from tasks.options import MAX_REFERENCES, MAX_SOURCES, FusionOptions
from tasks.report import QualityReport


def utcnow() -> datetime:
    """The current time, timezone-aware UTC."""
    return datetime.now(UTC)


class UTCDateTime(sa.types.TypeDecorator[datetime]):
    """Aware UTC ``datetime`` in Python, naive UTC in the database (same on every dialect)."""

    impl = sa.DateTime
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column; use webapi.models.utcnow()")
        return value.astimezone(UTC).replace(tzinfo=None)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        return None if value is None else value.replace(tzinfo=UTC)


class JobStatus(StrEnum):
    """Job states. ``queued → running → succeeded | failed``, plus ``expired`` (queue
    deadline passed before start) and ``cancel_requested → cancelled``."""

    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    expired = "expired"
    cancel_requested = "cancel_requested"
    cancelled = "cancelled"

    @property
    def is_terminal(self) -> bool:
        """Whether the job can never change state again."""
        return self in TERMINAL_STATUSES


TERMINAL_STATUSES: frozenset[JobStatus] = frozenset(
    {JobStatus.succeeded, JobStatus.failed, JobStatus.expired, JobStatus.cancelled}
)
ACTIVE_STATUSES: frozenset[JobStatus] = frozenset(set(JobStatus) - TERMINAL_STATUSES)

Priority = Literal["normal", "high"]
Media = Literal["photo", "video"]
CallbackEvent = Literal[
    "job.running", "job.progress", "job.succeeded", "job.failed", "job.cancelled", "job.expired"
]
CALLBACK_EVENTS: tuple[CallbackEvent, ...] = (
    "job.running",
    "job.progress",
    "job.succeeded",
    "job.failed",
    "job.cancelled",
    "job.expired",
)
#: Least time between two ``job.progress`` webhooks of one job (opt-in; video jobs).
PROGRESS_EVENT_INTERVAL_S = 5.0
#: Events sent when a job has a ``callback_url`` but no explicit ``callback_events``.
DEFAULT_CALLBACK_EVENTS: tuple[CallbackEvent, ...] = (
    "job.succeeded",
    "job.failed",
    "job.cancelled",
    "job.expired",
)
#: The webhook event of each status (``cancel_requested`` and ``queued`` have none).
STATUS_EVENTS: dict[JobStatus, CallbackEvent] = {
    JobStatus.running: "job.running",
    JobStatus.succeeded: "job.succeeded",
    JobStatus.failed: "job.failed",
    JobStatus.cancelled: "job.cancelled",
    JobStatus.expired: "job.expired",
}

OutboxKind = Literal["dispatch", "webhook", "cancel_run"]
OutboxOutcome = Literal["done", "obsolete", "gave_up"]

_STATUS_TYPE = sa.Enum(
    JobStatus,
    native_enum=False,
    length=20,
    validate_strings=True,
    values_callable=lambda enum: [member.value for member in enum],
    name="job_status",
)


# --------------------------------------------------------------------------- users


class UserBase(SQLModel):
    """Fields a user shares between storage and output."""

    name: str = Field(
        min_length=1, max_length=100, unique=True, index=True, description="Unique user name."
    )
    quota: int = Field(
        default=10, ge=0, description="Most non-terminal (queued/running) jobs at once."
    )
    priority: Priority = Field(
        default="normal",
        sa_type=sa.String(10),
        description="Priority class: 'high' may submit jobs to the priority lane.",
    )
    input_retention_s: int | None = Field(
        default=None,
        ge=0,
        description="Seconds the inputs of a finished job are kept (None: the setting).",
    )
    result_retention_s: int | None = Field(
        default=None,
        ge=0,
        description="Seconds the result of a finished job is kept (None: the setting).",
    )


class User(UserBase, table=True):
    """An API user. ``webhook_secret`` is the Standard Webhooks signing secret
    (``whsec_`` + base64 of 32 random bytes); it is stored as is because the relay signs
    with it. API keys live in ``ApiKey`` (hashed)."""

    __tablename__ = "users"

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    webhook_secret: str = Field(max_length=100, description="whsec_<base64 32 bytes>.")
    disabled: bool = Field(
        default=False,
        description="A disabled user's keys and submits are refused and webhooks not sent "
        "(faceflow users disable|enable).",
    )
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime, nullable=False)


class UserPublic(UserBase):
    """A user as the CLI shows it (never the secret)."""

    id: uuid.UUID
    created_at: datetime


class ApiKey(SQLModel, table=True):
    """One API key of a user, stored only as ``key_hash`` = hex HMAC-SHA256(pepper, key).
    ``id`` names it (not secret: faceflow keys list|revoke); ``revoked_at`` is when it
    stops working, in the future during a rotation's grace period."""

    __tablename__ = "api_keys"

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    user_id: uuid.UUID = Field(foreign_key="users.id", index=True, ondelete="CASCADE")
    key_hash: str = Field(max_length=64, unique=True, index=True, description="hex HMAC-SHA256.")
    prefix: str = Field(max_length=16, description="First characters of the key, to recognise it.")
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime, nullable=False)
    revoked_at: datetime | None = Field(
        default=None, sa_type=UTCDateTime, description="When the key stops working."
    )


# --------------------------------------------------------------------------- jobs


class JobBase(SQLModel):
    """Caller-chosen job fields, validated the same way on input and in storage."""

    priority: Priority = Field(default="normal", sa_type=sa.String(10))
    callback_url: str | None = Field(
        default=None, max_length=2000, description="Where the relay POSTs signed webhooks."
    )
    callback_events: list[CallbackEvent] = Field(
        default_factory=list, sa_type=JSON, description="Events sent to callback_url."
    )


class Job(JobBase, table=True):
    """One fusion job.

    Inputs: ``source_key``/``target_key`` are storage keys (``flows.params.input_key``) of
    validated images; for an input given as an https URL the key is ``None`` until the
    relay has fetched, validated and stored it, and ``source_url``/``target_url`` hold the
    URL. ``input_digest`` (sha256 hex) covers both inputs and every option, so an
    idempotent retry with the same ``idempotency_key`` matches only the same request.

    Attempts: ``attempts`` counts flow runs created (0 until the first dispatch);
    ``flow_run_id`` is the *current* attempt's Prefect flow run — the only run allowed to
    write (``jobstate.transition(expected_flow_run_id=...)``); several jobs share it when
    the relay dispatched them as one ``fuse-batch`` run (``dispatch_key`` names that
    batch). ``max_attempts`` caps re-dispatches. Deadlines are fixed at submit: ``queue_deadline_at`` (must have started
    by then, else ``expired``) and ``deadline_at`` (shared by every attempt).

    Outcome: ``result_*`` from the flow's ``ResultRef``; ``error_code`` is a stable code
    (a ``tasks.error_codes.JobErrorCode``: ``no_face_found``, ``worker_lost``, ...) and
    ``error_message`` is safe to show. ``stage`` is the pipeline stage last reported.

    Retention (``webapi.retention``): ``input_retention_s``/``result_retention_s`` are fixed
    at submit (the owner's, else the settings'); when the job ends, ``jobstate`` sets
    ``inputs_purge_at``/``result_purge_at`` = end + retention. A retention pass deletes the
    objects that are due, clears the ``*_purge_at`` it handled (NULL: nothing pending —
    before the end as after the purge) and records ``inputs_purged_at`` and
    ``result_expired_at``. A job that has not ended has no purge time: nothing of it is
    deleted.
    """

    __tablename__ = "jobs"
    __table_args__ = (
        sa.UniqueConstraint("owner_id", "idempotency_key", name="uq_jobs_owner_idempotency_key"),
        sa.Index("ix_jobs_owner_created", "owner_id", "created_at", "id"),
        sa.Index("ix_jobs_status_created", "status", "created_at"),
        sa.Index("ix_jobs_owner_status", "owner_id", "status"),
        sa.Index("ix_jobs_status_priority", "status", "priority"),
        sa.Index("ix_jobs_inputs_purge_at", "inputs_purge_at"),
        sa.Index("ix_jobs_result_purge_at", "result_purge_at"),
        sa.Index("ix_jobs_finished_at", "finished_at"),
        sa.Index("ix_jobs_source_key", "source_key"),
        sa.Index("ix_jobs_target_key", "target_key"),
    )

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    owner_id: uuid.UUID = Field(foreign_key="users.id", ondelete="CASCADE")
    idempotency_key: str | None = Field(default=None, max_length=255)
    input_digest: str = Field(max_length=64, description="sha256 hex of inputs + options.")
    source_key: str | None = Field(default=None, max_length=200)
    target_key: str | None = Field(default=None, max_length=200)
    source_url: str | None = Field(default=None, max_length=2000)
    target_url: str | None = Field(default=None, max_length=2000)
    extra_inputs: dict[str, list[str]] | None = Field(
        default=None,
        sa_type=JSON,
        description="Storage keys of a per-face mapping's other images: 'sources' (after "
        "the first) and 'references'.",
    )
    media: Media = Field(
        default="photo",
        sa_type=sa.String(8),
        sa_column_kwargs={"server_default": "photo"},
        description="What the target is: a photo (fuse-faces, fuse-batch) or a video "
        "(fuse-video, always a run of its own).",
    )
    video_input: dict[str, Any] | None = Field(
        default=None,
        sa_type=JSON,
        description="A video target's probe at submit (VideoInputPublic): container, codecs, "
        "size, frames, duration, frame rate, audio.",
    )
    video_report: dict[str, Any] | None = Field(
        default=None,
        sa_type=JSON,
        description="A video result's report (VideoReportPublic) from its VideoResultRef.",
    )
    progress: dict[str, Any] | None = Field(
        default=None,
        sa_type=JSON,
        description="A running video job's progress (JobProgress), written by the relay from "
        "the flow's progress record.",
    )
    input_pixels: int | None = Field(
        default=None,
        ge=0,
        sa_type=sa.BigInteger,
        description="Pixels the job's images decode to together (webapi.inputs.job_pixels); "
        "the batch planner's measure. NULL on jobs from before it: counted as the per-job "
        "budget.",
    )

    options: dict[str, Any] = Field(
        default_factory=dict, sa_type=JSON, description="FusionOptions.model_dump(mode='json')."
    )
    status: JobStatus = Field(default=JobStatus.queued, sa_type=_STATUS_TYPE)
    stage: str | None = Field(default=None, max_length=32)
    attempts: int = Field(default=0, ge=0)
    max_attempts: int = Field(default=2, ge=1)
    flow_run_id: uuid.UUID | None = Field(default=None, index=True)
    dispatch_key: str | None = Field(
        default=None,
        max_length=64,
        description="Prefect idempotency key of the batch run planned for this attempt "
        "(written before the run is created, so a relay that dies in between re-creates "
        "the same run); None for a run of its own.",
    )

    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime, nullable=False)
    updated_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime, nullable=False)
    queue_deadline_at: datetime = Field(sa_type=UTCDateTime, nullable=False)
    deadline_at: datetime = Field(sa_type=UTCDateTime, nullable=False)
    started_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    finished_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    cancel_requested_at: datetime | None = Field(default=None, sa_type=UTCDateTime)

    result_key: str | None = Field(default=None, max_length=200)
    result_content_type: str | None = Field(default=None, max_length=50)
    result_width: int | None = None
    result_height: int | None = None
    timings: dict[str, float] = Field(
        default_factory=dict, sa_type=JSON, description="Stage timings (ms) from ResultRef."
    )
    quality: dict[str, Any] | None = Field(
        default=None, sa_type=JSON, description="The result's quality report from ResultRef."
    )
    error_code: str | None = Field(default=None, max_length=64)
    error_message: str | None = Field(default=None, max_length=500)

    input_retention_s: int = Field(default=0, ge=0, description="Inputs kept after the end.")
    result_retention_s: int = Field(default=86400, ge=0, description="Result kept after the end.")
    inputs_purge_at: datetime | None = Field(
        default=None, sa_type=UTCDateTime, description="When retention deletes the inputs."
    )
    result_purge_at: datetime | None = Field(
        default=None, sa_type=UTCDateTime, description="When retention deletes the result."
    )
    inputs_purged_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    result_expired_at: datetime | None = Field(default=None, sa_type=UTCDateTime)

    @property
    def fusion_options(self) -> FusionOptions:
        """``options`` as the typed contract."""
        return FusionOptions.model_validate(self.options)

    @property
    def awaits_fetch(self) -> bool:
        """Queued with an input URL not fetched and stored yet (the fetch lane's; in SQL:
        ``webapi.relay.fetch_lane.waits_for_fetch``)."""
        return self.status == JobStatus.queued and (
            self.source_key is None or self.target_key is None
        )


class JobCreate(BaseModel):
    """``POST /v1/jobs`` body (JSON, or the ``params`` field of a multipart request with
    ``source``/``target`` files, in which case ``source``/``target`` are omitted here)."""

    model_config = ConfigDict(extra="forbid")

    source: str | None = Field(
        default=None,
        description="Source face: a data:image/(jpeg|png|webp);base64, URI or an https URL.",
    )
    sources: list[str] | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_SOURCES,
        description="Instead of source: several source images for a per-face mapping "
        "(options.mapping names them by index); the first may be an https URL, the others "
        "are data: URIs.",
    )
    references: list[str] | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_REFERENCES,
        description="Reference images (data: URIs) that options.mapping entries name: each "
        "picks the target face most similar to it.",
    )
    target: str | None = Field(
        default=None,
        description="Target photo or video: a data: URI (data:image/... or data:video/...; "
        "larger videos go as a multipart file) or an https URL.",
    )
    options: FusionOptions = Field(default_factory=lambda: FusionOptions.model_validate({}))
    callback_url: AnyUrl | None = Field(default=None, description="http(s) webhook receiver.")
    callback_events: list[CallbackEvent] | None = Field(
        default=None, description="Events to send (default: every terminal event)."
    )
    deadline_seconds: StrictInt | None = Field(
        default=None, ge=1, description="Total time allowed from submit (default from settings)."
    )
    queue_timeout_seconds: StrictInt | None = Field(
        default=None, ge=1, description="Time allowed to start (default from settings)."
    )
    priority: Priority | None = Field(
        default=None,
        description="Lane: 'high' (keys of the high priority class only) or 'normal' "
        "(default: the key's priority class).",
    )

    @model_validator(mode="after")
    def _one_way_to_give_sources(self) -> JobCreate:
        if self.source is not None and self.sources is not None:
            raise ValueError("give source or sources, not both")
        return self

    def mapping_problem(self, sources: int, references: int) -> str | None:
        """Why ``options.mapping`` does not fit ``sources`` source and ``references``
        reference images (None when it does)."""
        mapping = self.options.mapping
        if sources > 1 and not mapping:
            return "several sources need options.mapping to say which face gets which"
        if references and not any(m.reference is not None for m in mapping):
            return "references need options.mapping entries that name them"
        for m in mapping:
            if m.source >= sources:
                return f"options.mapping names source {m.source}: {sources} given"
            if m.reference is not None and m.reference >= references:
                return f"options.mapping names reference {m.reference}: {references} given"
        for field in ("target", "reference"):
            named = [getattr(m, field) for m in mapping if getattr(m, field) is not None]
            twice = sorted({n for n in named if named.count(n) > 1})
            if twice:
                return f"options.mapping names {field} {twice[0]} twice: one entry per face"
        return None

    @field_validator("callback_events")
    @classmethod
    def _unique_events(cls, value: list[CallbackEvent] | None) -> list[CallbackEvent] | None:
        return None if value is None else list(dict.fromkeys(value))


class JobError(BaseModel):
    """Why a job failed (or expired / was cancelled)."""

    code: str
    message: str


class JobResult(BaseModel):
    """Where the result image is and what it is."""

    url: str
    content_type: str
    width: int
    height: int


class VideoInputPublic(BaseModel):
    """What the probe at submit found in a video target."""

    container: str
    video_codec: str
    width: int = Field(description="As displayed (rotation applied).")
    height: int
    rotation: int = Field(description="Degrees the stored picture turns for display.")
    frame_count: int
    duration_s: float
    fps: float = Field(description="Average frame rate (frames / duration).")
    variable_frame_rate: bool
    audio: bool = Field(description="Whether the video carries an audio track (kept).")
    size_bytes: int


class VideoReportPublic(BaseModel):
    """What a video result is: frames, chunks, scene cuts, identity switches, per track."""

    frames: int
    duration_s: float
    chunks: int
    chunks_rendered: int = Field(description="Chunks the last attempt rendered (not reused).")
    cuts: list[int] = Field(default_factory=list, description="Frames that start a scene.")
    switches: int = Field(0, description="Identity switches of the face plan.")
    tracks: list[dict[str, Any]] = Field(default_factory=list, description="Report per track.")
    frame_failures: dict[str, int] = Field(
        default_factory=dict, description="Frames kept unchanged because a stage failed, by code."
    )
    moderation: list[str] = Field(default_factory=list, description="Report-only flags.")
    marks: list[str] = Field(
        default_factory=list,
        description="How the result is marked: c2pa (signed Content Credentials); empty when "
        "marking is off.",
    )


class JobUrls(BaseModel):
    """Links to act on a job."""

    self: str
    cancel: str
    result: str


class JobCallback(BaseModel):
    """One webhook delivery attempt, as shown on the job."""

    event: str
    webhook_id: str
    attempt: int
    at: datetime
    status_code: int | None
    outcome: str
    error: str | None = None


class JobPublic(BaseModel):
    """A job as the API returns it."""

    id: uuid.UUID
    status: JobStatus
    stage: str | None
    attempts: int
    priority: Priority
    media: Media = Field("photo", description="What the target is: photo or video.")
    progress: JobProgress | None = Field(None, description="A video job's progress.")
    video: VideoInputPublic | None = Field(None, description="A video target, as probed.")
    video_report: VideoReportPublic | None = Field(
        None, description="A video result's report (succeeded video jobs)."
    )
    options: FusionOptions
    created_at: datetime
    queue_deadline_at: datetime
    deadline_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    error: JobError | None
    result: JobResult | None
    result_expires_at: datetime | None = None
    result_expired: bool = False
    timings: dict[str, float]
    quality: QualityReport | None = Field(
        None, description="How good the result is: identity, pose, faces found, settings."
    )
    urls: JobUrls
    callback_url: str | None
    callback_events: list[CallbackEvent]
    callbacks: list[JobCallback]


class JobsPublic(BaseModel):
    """A page of the caller's jobs, newest first."""

    data: list[JobPublic]
    next_cursor: str | None


# --------------------------------------------------------------------------- outbox


class Outbox(SQLModel, table=True):
    """Work the relay must do, committed in the same transaction as the change causing it.

    ``kind``:
    - ``dispatch``: create the flow run of attempt ``payload["attempt"]`` (written at
      submit, and by the reaper for a re-dispatch);
    - ``webhook``: POST ``payload["body"]`` (a frozen JSON object, so retries send the
      same bytes) with ``webhook-id`` = ``payload["webhook_id"]`` (``msg_<outbox id hex>``,
      stable across retries) for event ``payload["event"]``;
    - ``cancel_run``: set Prefect flow run ``payload["flow_run_id"]`` to CANCELLING
      (written when a job with a flow run is cancelled, cancel-requested or expired).

    Leasing: a relay claims a row with ``done_at IS NULL AND next_attempt_at <= now AND
    (lease_until IS NULL OR lease_until < now)`` (``FOR UPDATE SKIP LOCKED`` on
    PostgreSQL), sets ``lease_owner``/``lease_until``, and on failure bumps ``attempts``,
    ``last_error`` and ``next_attempt_at`` (backoff). ``done_at`` + ``outcome`` close it:
    ``done``, ``obsolete`` (job went terminal first) or ``gave_up``.
    """

    __tablename__ = "outbox"
    __table_args__ = (sa.Index("ix_outbox_pending", "done_at", "next_attempt_at"),)

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    kind: OutboxKind = Field(sa_type=sa.String(16))
    job_id: uuid.UUID = Field(foreign_key="jobs.id", index=True, ondelete="CASCADE")
    payload: dict[str, Any] = Field(default_factory=dict, sa_type=JSON)
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime, nullable=False)
    next_attempt_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime, nullable=False)
    attempts: int = Field(default=0, ge=0)
    lease_owner: str | None = Field(default=None, max_length=100)
    lease_until: datetime | None = Field(default=None, sa_type=UTCDateTime)
    last_error: str | None = Field(default=None, max_length=1000)
    done_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    outcome: OutboxOutcome | None = Field(default=None, sa_type=sa.String(16))


class WebhookDelivery(SQLModel, table=True):
    """One HTTP attempt of a webhook outbox row (``outcome``: ``delivered`` for 2xx,
    ``retry`` for a retryable failure, ``gave_up`` for 410 or the 24 h limit)."""

    __tablename__ = "webhook_deliveries"

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    outbox_id: uuid.UUID = Field(foreign_key="outbox.id", index=True, ondelete="CASCADE")
    job_id: uuid.UUID = Field(foreign_key="jobs.id", index=True, ondelete="CASCADE")
    event: str = Field(max_length=32)
    webhook_id: str = Field(max_length=64)
    attempt: int = Field(ge=1)
    at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime, nullable=False)
    status_code: int | None = None
    outcome: str = Field(max_length=16)
    error: str | None = Field(default=None, max_length=500)
    duration_ms: float | None = None
