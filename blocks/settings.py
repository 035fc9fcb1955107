"""``FusionSettings``: the operator's knobs for the ``fuse-faces`` flow, stored as a block.

Per-job choices travel in ``FuseFacesParams.options``; this block holds what an operator
sets once per deployment: default models, per-stage time budgets and retries, input
limits and where model files live. Stage dictionaries may name only some stages: the
others keep their defaults.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from prefect.blocks.core import Block
from pydantic import Field, field_validator

from blocks.cache import load_block
from tasks.options import DetectorName, FuserName, FusionOptions, ImageLimits, ModerationPolicy
from tasks.stage_names import STAGE_NAMES, StageName

if TYPE_CHECKING:
    from tasks.stages import Stage

__all__ = ["STAGE_NAMES", "FusionSettings", "StageName", "StagePolicy", "load_settings"]


def _table() -> dict[StageName, Stage]:
    """The stage table by name as it is now, imported when first needed: loading the
    settings does not import the pipeline and its models (the video coordinator on the
    control pool)."""
    from tasks.stages import PIPELINE

    return {s.name: s for s in PIPELINE}


# The table's defaults (tasks.stages.PIPELINE): what a stage dictionary leaves out.
def default_budgets_s() -> dict[StageName, float]:
    """Each stage's budget in the table."""
    return {name: s.budget_s for name, s in _table().items()}


def default_expected_s() -> dict[StageName, float]:
    """Each stage's expected cost in the table."""
    return {name: s.expected_s for name, s in _table().items()}


def default_retries() -> dict[StageName, int]:
    """Each stage's retries in the table."""
    return {name: s.retries for name, s in _table().items()}


@dataclass(frozen=True, slots=True)
class StagePolicy:
    """Time budget, expected cost and retries of one stage."""

    stage: StageName
    budget_s: float
    expected_s: float
    retries: int
    retry_delay_s: float


class FusionSettings(Block):
    """Operator settings of the fuse-faces flow: models, stage budgets, retries and limits."""

    _block_type_name = "Fusion Settings"
    _description = (
        "Operator settings of the FaceFlow fuse-faces flow: default detector and fuser, "
        "identity weight, per-stage time budgets, expected costs and retries, input limits, "
        "NSFW moderation policy, result marking (C2PA and watermark), which runs give each "
        "stage a Prefect task run, model directory and model pins."
    )

    detector: DetectorName = Field(
        default="mtcnn", description="Detector used when a job does not choose one."
    )
    fuser: FuserName = Field(
        default="classic", description="Fuser used when a job does not choose one."
    )
    identity_weight: float = Field(
        default=0.85,
        ge=0.0,
        le=1.0,
        description="Identity weight used when a job does not choose one (0 keeps the target).",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="Torch device: auto picks cuda when a GPU is visible, else cpu."
    )
    stage_budgets_s: dict[StageName, float] = Field(
        default_factory=default_budgets_s,
        description="Longest time one attempt of each stage may take, in seconds.",
    )
    stage_expected_s: dict[StageName, float] = Field(
        default_factory=default_expected_s,
        description="Typical duration of each stage in seconds; no attempt starts with less left.",
    )
    stage_retries: dict[StageName, int] = Field(
        default_factory=default_retries,
        description="How many times a transient failure of each stage is retried.",
    )
    retry_delay_s: float = Field(
        default=0.5, ge=0.0, description="Pause before a stage retry, in seconds."
    )
    video_chunk_s: float = Field(
        10.0,
        gt=0,
        description="Length of a video's render chunks in seconds (moved to a scene cut "
        "within a quarter of it): the unit of retry and resume, and of progress between "
        "chunks; a kill redoes at most one chunk.",
    )
    image_limits: ImageLimits = Field(
        default_factory=ImageLimits, description="Bounds on every input image."
    )
    moderation: ModerationPolicy = Field(
        default_factory=ModerationPolicy,
        description="NSFW check of the inputs (before detection) and of the result: mode "
        "(enforce, report or off), blocked detector labels and their score thresholds.",
    )
    batch_cpu_threads: int = Field(
        default=0,
        ge=0,
        le=64,
        description="Threads a fuse-batch run gives its jobs' CPU work (reading and decoding "
        "inputs, blending and encoding results, writing them); 0: one per CPU core, at most 8.",
    )
    model_threads: int = Field(
        default=0,
        ge=0,
        le=8,
        description="Model calls kept in flight: a job's images go through face detection "
        "in that many calls at once, and a fuse-batch run also moderates inputs and checks "
        "the quality of that many jobs at once; 0: two on the CPU of a machine with two or "
        "more cores, one on a GPU (whose calls take the whole batch). Each call gets the "
        "CPU cores divided among the calls as intra-op threads (torch's unless "
        "OMP_NUM_THREADS is set, and the moderation detector's).",
    )
    marking: Literal["required", "off"] = Field(
        default="required",
        description="Marking of every result (docs/provenance.md): required embeds an "
        "invisible watermark and a signed C2PA manifest (Content Credentials) from the "
        "signing block, and fails a job whose result cannot be signed (marking_failed); off "
        "returns results unmarked. The EU AI Act (Art. 50(2)) asks providers of systems that "
        "generate or manipulate images or video to mark their outputs in a machine-readable, "
        "detectable way: turn it off only where the operator marks results otherwise.",
    )
    stage_task_runs: Literal["batches", "always", "never"] = Field(
        default="never",
        description="Which runs give each pipeline stage its own Prefect task run: never "
        "(the default), batches (fuse-batch runs only: one task run per stage for the whole "
        "batch) or always (every fuse-faces run too). Without task runs a stage is called "
        "inline in the flow run under the same timeout, retry and deadline rules, and shows "
        "as log lines (stage, attempt, ms) and in the run's stage table artifact; this "
        "spares a single job's run about 10 ms of task-run bookkeeping per stage, and a "
        "batch run its task runs' events on the Prefect server (about 9 points of a real "
        "burst's throughput on a 2-core host).",
    )
    model_dir: str | None = Field(
        default=None,
        description="Directory of operator-provided model files (None uses FACEFLOW_MODEL_DIR).",
    )
    model_pins: dict[str, str] = Field(
        default_factory=dict,
        description="SHA-256 overrides by model name, for operator-provided model files.",
    )

    @field_validator("stage_budgets_s", "stage_expected_s")
    @classmethod
    def _positive_seconds(cls, value: dict[StageName, float]) -> dict[StageName, float]:
        if any(v <= 0 for v in value.values()):
            raise ValueError("stage durations must be positive")
        return value

    @field_validator("stage_retries")
    @classmethod
    def _non_negative_retries(cls, value: dict[StageName, int]) -> dict[StageName, int]:
        if any(v < 0 for v in value.values()):
            raise ValueError("stage retries must not be negative")
        return value

    def policy(self, stage: StageName) -> StagePolicy:
        """The effective policy of ``stage`` (stages missing from a dictionary use the
        table's defaults, ``tasks.stages.PIPELINE``)."""
        default = _table()[stage]
        return StagePolicy(
            stage=stage,
            budget_s=self.stage_budgets_s.get(stage, default.budget_s),
            expected_s=self.stage_expected_s.get(stage, default.expected_s),
            retries=self.stage_retries.get(stage, default.retries),
            retry_delay_s=self.retry_delay_s,
        )

    def stage_task_runs_for(self, *, batch: bool) -> bool:
        """Whether a run (a ``fuse-batch`` run when ``batch``) gives each stage a task run."""
        return self.stage_task_runs == "always" or (batch and self.stage_task_runs == "batches")

    def apply_defaults(self, options: FusionOptions) -> FusionOptions:
        """``options`` with detector, fuser and identity weight from here where the job set none.

        A field counts as set when the caller sent it (pydantic's ``model_fields_set``): the
        webapi sends ``options.as_sent()``.
        """
        defaults = {
            "detector": self.detector,
            "fuser": self.fuser,
            "identity_weight": self.identity_weight,
        }
        missing = {k: v for k, v in defaults.items() if k not in options.model_fields_set}
        if not missing:
            return options
        return options.model_copy(update=missing)


def load_settings(block_name: str) -> FusionSettings:
    """The ``FusionSettings`` document ``block_name`` (``"fusion-settings/<name>"``), from
    the per-process block cache (``blocks.cache``: a change is seen within its TTL)."""
    block = load_block(block_name)
    if not isinstance(block, FusionSettings):
        raise TypeError(f"Block {block_name!r} is not a FusionSettings block.")
    return block
