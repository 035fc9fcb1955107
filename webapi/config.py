"""Settings of the web API and the relay: one pydantic-settings class, ``FACEFLOW_`` prefix.

Nested fields use ``__`` (``FACEFLOW_IMAGE_LIMITS__MAX_BYTES=...``). Validated at start:
``environment=production`` refuses the development secret and private-URL access.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal, Self

from pydantic import AliasChoices, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from flows.binding import DEV_RUN_SIGNING_KEY
from tasks.options import ImageLimits, VideoLimits

DEV_API_KEY_PEPPER = "faceflow-development-pepper"


class SettingsError(ValueError):
    """The settings are unusable (e.g. a default secret in production)."""


class Settings(BaseSettings):
    """Everything the webapi reads from the environment."""

    model_config = SettingsConfigDict(
        env_prefix="FACEFLOW_", env_nested_delimiter="__", extra="ignore"
    )

    environment: Literal["development", "production"] = Field(
        "development", description="production refuses development secrets and private URLs."
    )
    home: Path = Field(Path(".faceflow"), description="Local state directory.")
    database_url: str = Field(
        "", description="SQLAlchemy URL of the job store (default: SQLite under home)."
    )
    storage_url: str = Field(
        "", description="file:///path or s3://bucket/prefix (default: file://<home>/storage)."
    )
    s3_endpoint_url: str | None = Field(None, description="S3 endpoint (MinIO, moto).")
    prefect_api_url: str = Field("http://127.0.0.1:4200/api", description="Prefect REST API.")
    prefect_api_auth_string: SecretStr | None = Field(
        None,
        # Prefect's own client variable, so one setting serves the relay and every Prefect
        # client of a host; FACEFLOW_PREFECT_API_AUTH_STRING wins when both are set.
        validation_alias=AliasChoices(
            "faceflow_prefect_api_auth_string", "prefect_api_auth_string"
        ),
        description="Credential of the Prefect API (user:password, HTTP basic auth; "
        "PREFECT_API_AUTH_STRING): the relay sends it with every Prefect call.",
    )
    api_key_pepper: SecretStr = Field(
        SecretStr(DEV_API_KEY_PEPPER), description="HMAC key under which API keys are hashed."
    )
    run_signing_key: SecretStr = Field(
        SecretStr(DEV_RUN_SIGNING_KEY),
        description="HMAC key under which the relay binds each flow run's parameters to its "
        "job (flows.binding); the workers hold it too (FACEFLOW_RUN_SIGNING_KEY), with the "
        "keys still accepted during a rotation in FACEFLOW_RUN_SIGNING_PREVIOUS_KEYS.",
    )
    allow_private_urls: bool = Field(
        False,
        description="Let callback and input URLs reach private addresses over http or "
        "https on any port (development and tests; production refuses it).",
    )
    url_ports: Annotated[list[Annotated[int, Field(ge=1, le=65535)]], NoDecode] = Field(
        [443, 8443],
        min_length=1,
        description="Ports callback and input URLs may use (https): 443, and 8443, the "
        "usual second TLS port of webhook receivers. Comma-separated in the environment.",
    )
    image_limits: ImageLimits = Field(default_factory=lambda: ImageLimits.model_validate({}))
    video_limits: VideoLimits = Field(
        default_factory=lambda: VideoLimits.model_validate({}),
        description="Bounds on a video target, checked by a probe at submit (file size, "
        "duration, longest side, frame rate): FACEFLOW_VIDEO_LIMITS__MAX_DURATION_S etc.",
    )
    max_json_bytes: int = Field(
        8 * 1024 * 1024,
        gt=0,
        description="Largest JSON request body (multipart bodies may be larger: "
        "max_request_bytes). A JSON body is held and parsed whole, its images are base64 "
        "(a third larger); big images belong in multipart files or URLs.",
    )
    json_max_items: int = Field(
        1000, ge=1, description="Most keys, strings and list items in one JSON body."
    )
    json_max_depth: int = Field(16, ge=1, description="Deepest nesting of a JSON body.")
    header_read_seconds: float = Field(
        10.0, gt=0, description="Time a client has to send its request headers."
    )
    body_read_seconds: float = Field(
        60.0,
        gt=0,
        description="Time a client has to send its whole request body (408), plus one "
        "second per body_min_bytes_per_second bytes it sent.",
    )
    body_min_bytes_per_second: float = Field(
        256 * 1024,
        gt=0,
        description="Upload rate that earns a large body (a video) more time: a 500 MB "
        "video may take 60 s + 500 MB / 256 KiB/s ≈ 33 min to arrive.",
    )
    default_deadline_seconds: int = Field(120, ge=1, description="Job deadline when not given.")
    max_deadline_seconds: int = Field(3600, ge=1)
    default_video_deadline_seconds: int = Field(
        3600, ge=1, description="A video job's deadline when not given."
    )
    max_video_deadline_seconds: int = Field(
        6 * 3600, ge=1, description="Longest deadline a video job may ask for."
    )
    default_queue_timeout_seconds: int = Field(60, ge=1, description="Time allowed to start.")
    max_queue_timeout_seconds: int = Field(3600, ge=1)
    default_quota: int = Field(10, ge=0, description="Non-terminal jobs per new user.")
    max_attempts: int = Field(2, ge=1, description="Flow runs per job at most.")
    worker_slots: int = Field(1, ge=1, description="Jobs the workers run at once (GPUs).")
    relay_run_events: bool = Field(
        True,
        description="Learn flow-run starts and ends from Prefect's event stream (a "
        "websocket to /api/events/out) and poll run states only as a safety net; off: "
        "poll every sync interval.",
    )
    default_service_seconds: float = Field(
        10.0, gt=0, description="Assumed run time of a job before any has succeeded."
    )
    default_frame_seconds: float = Field(
        0.1,
        gt=0,
        description="Assumed worker seconds per video frame before any video has succeeded "
        "(admission of video jobs; measured from finished videos after that).",
    )
    batch_admission_safety: float = Field(
        1.0,
        ge=1.0,
        description="Factor on the wait estimate of the batching model (per-run overhead and "
        "per-job compute, measured on recent jobs) before it is compared with the queue "
        "timeout; the model replaces admission_safety once it has enough history.",
    )
    admission_safety: float = Field(
        2.0,
        ge=1.0,
        description="Factor on the estimated wait before it is compared with the queue "
        "timeout (503): headroom for jobs costing more during a burst than before it "
        "(≈ 1.9x on the one-machine stack, where API, relay and worker share the cores).",
    )
    max_backlog: int | None = Field(
        None, ge=0, description="Hard cap on queued jobs (503 beyond), on top of the estimate."
    )
    max_wait_seconds: int = Field(60, ge=0, le=60, description="Largest Prefer: wait=N.")
    wait_poll_seconds: float = Field(
        1.0,
        gt=0,
        le=5.0,
        description="How often a Prefer: wait request reads its job as the safety net; its "
        "end wakes it at once when committed in this process or, on PostgreSQL, in any.",
    )
    run_relay: bool = Field(True, description="Run the relay loops inside the API process.")
    auth_cache_seconds: float = Field(
        5.0,
        ge=0,
        description="How long an authenticated API key is remembered in-process "
        "(a revoked key, disabled user or new quota applies within this time; 0: never).",
    )
    key_rotation_grace_seconds: float = Field(
        86400.0,
        ge=0,
        description="How long the old API keys keep working after faceflow keys rotate "
        "(the time to roll the new key out to the clients).",
    )
    submit_threads: int = Field(
        3,
        ge=1,
        description="Submits whose inputs are validated and stored at once (CPU work: more "
        "threads only contend); their jobs are then admitted in batches (webapi.group_commit).",
    )
    batch_max_jobs: int = Field(
        32,
        ge=1,
        description="Most jobs the relay puts in one fuse-batch flow run (1: one fuse-faces "
        "run per job, dispatched at once, no batching). Sized so Prefect's per-run cost "
        "stays under 10 % of the batch's compute on the CPU pipeline (docs/batching.md); "
        "a batch holds its jobs' decoded images at once.",
    )
    batch_linger_ms: float = Field(
        0.0,
        ge=0,
        le=1000,
        description="How long dispatch waits for more jobs when fewer than batch_max_jobs "
        "are due and the oldest is younger than this (ms); a lone job waits at most this. "
        "0 by default: under load the runs-ahead hold-back forms the batches, and a linger "
        "only delayed single jobs (docs/batching.md).",
    )
    batch_ahead_linger_ms: float = Field(
        300.0,
        ge=0,
        le=5000,
        description="With batching on, how long the jobs of a run that would only wait behind "
        "the lane's running ones (every worker slot busy) wait for more jobs to join them "
        "(ms, from the oldest's arrival; a full batch leaves at once). A burst then leaves in "
        "fewer, larger runs; a job on an idle lane never waits for it (docs/batching.md).",
    )
    runs_ahead_per_slot: int = Field(
        2,
        ge=1,
        description="With batching on, unfinished flow runs per worker slot before dispatch "
        "holds the next jobs back (they wait, and then leave together in a bigger batch).",
    )
    fetch_concurrency: int = Field(
        4,
        ge=1,
        le=64,
        description="Input URLs one relay replica fetches at once (its fetch lane's threads; "
        "dispatch never waits for a fetch: it takes only jobs whose inputs are stored).",
    )
    fetch_per_user: int = Field(
        2,
        ge=1,
        description="Most input fetches of one user in flight at once, over every relay "
        "replica (counted on the outbox leases): one user's slow URLs leave the other "
        "fetch slots to other users.",
    )
    fetch_deadline_seconds: float = Field(
        15.0,
        gt=0,
        le=40,
        description="Wall-clock limit of one whole input fetch: connecting, TLS, the "
        "response head, every redirect and the body together, however slowly the server "
        "sends (at most 40: the reconcile flow, which also fetches, stops after 55 s).",
    )
    fetch_tries: int = Field(
        3,
        ge=1,
        le=10,
        description="Tries of an input URL that fails transiently (its deadline passed, the "
        "connection was refused or dropped, HTTP 5xx/408/425/429) before its job fails "
        "with input_fetch_timeout (the last try ran out of time) or input_fetch_failed.",
    )
    public_base_url: str | None = Field(None, description="External URL of the API.")
    default_priority: Literal["normal", "high"] = Field(
        "normal", description="Priority class of new users (faceflow users create)."
    )
    priority_work_queue: str = Field(
        "priority",
        description="Work queue of the GPU pool that high-priority jobs go to (created "
        "with a higher priority than the normal queue: workers take its runs first).",
    )
    input_retention_seconds: int = Field(
        0, ge=0, description="Inputs kept after a job ends (0: deleted at the next pass)."
    )
    result_retention_seconds: int = Field(
        86400, ge=0, description="Results kept after a job ends (then GET /result is 410)."
    )
    job_retention_seconds: int = Field(
        30 * 86400,
        ge=0,
        description="Job rows (with their outbox and webhook attempts) kept after the end, "
        "for audit; never less than the result is kept.",
    )
    retention_batch: int = Field(500, ge=1, description="Jobs one retention step handles.")
    autoscale_target_wait_seconds: float = Field(
        30.0,
        gt=0,
        description="Wait the autoscaling signal aims for: faceflow_gpu_workers_wanted asks "
        "for enough workers to start every queued job within it.",
    )
    services_dir: Path | None = Field(
        None,
        description="Where supervised services record their starts (default: <home>/services); "
        "/metrics exports them as restart counters.",
    )

    c2pa_trust_anchors: Path | None = Field(
        None,
        description="PEM file of the root certificates POST /v1/verify trusts for Content "
        "Credentials (default: the local stack's development root, <home>/c2pa/root.pem, "
        "when present).",
    )
    verify_per_minute: int = Field(
        30, ge=1, description="POST /v1/verify requests per API key and minute (429 past it)."
    )
    verify_threads: int = Field(
        2, ge=1, description="Verify requests decoded at once (each one a CPU core)."
    )
    verify_max_bytes: int = Field(
        100 * 1024 * 1024,
        gt=0,
        description="Largest file POST /v1/verify accepts (an MP4 result; 413 past it).",
    )

    @field_validator("url_ports", mode="before")
    @classmethod
    def _comma_separated(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.strip("[]").split(",") if part.strip()]
        return value

    @model_validator(mode="after")
    def _defaults_and_production(self) -> Self:
        if not self.database_url:
            self.database_url = f"sqlite:///{(self.home / 'webapi.db').resolve()}"
        if not self.storage_url:
            self.storage_url = (self.home / "storage").resolve().as_uri()
        if self.services_dir is None:
            self.services_dir = (self.home / "services").resolve()
        if self.environment == "production":
            if self.api_key_pepper.get_secret_value() == DEV_API_KEY_PEPPER:
                raise SettingsError("set FACEFLOW_API_KEY_PEPPER: the default is for development")
            if self.allow_private_urls:
                raise SettingsError("FACEFLOW_ALLOW_PRIVATE_URLS is for development only")
            if self.run_signing_key.get_secret_value() in ("", DEV_RUN_SIGNING_KEY):
                raise SettingsError("set FACEFLOW_RUN_SIGNING_KEY: the default is for development")
        return self

    @property
    def batching(self) -> bool:
        """Whether dispatch puts several jobs into one flow run."""
        return self.batch_max_jobs > 1

    @property
    def max_runs_in_flight(self) -> int:
        """Unfinished flow runs (per lane) beyond which batching dispatch waits."""
        return self.worker_slots * self.runs_ahead_per_slot

    @property
    def max_request_bytes(self) -> int:
        """Largest request body: two base64 images plus room for the other fields."""
        return 2 * (self.image_limits.max_bytes * 4 // 3 + 4) + 64 * 1024


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, read from the environment once."""
    return Settings.model_validate({})
