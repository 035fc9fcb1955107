"""Typed pipeline options: the contract between the webapi, the flow and the pipeline.

Pydantic only (no torch), so the webapi can validate options without the pipeline.
Model choices are ``Literal`` types; their allowed values derive from them with ``get_args``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from tasks.errors import JobTooLarge

DetectorName = Literal["mtcnn", "scrfd"]
FuserName = Literal["classic", "inswapper"]
OutputFormat = Literal["png", "jpeg", "webp"]
BlendMode = Literal["multiband", "seamless", "feather"]
StrictIndex = Annotated[int, Field(ge=0, strict=True)]
"""A non-negative int that must be given as one: ``true`` or ``"2"`` is refused, not 1 or 2."""
FaceChoice = Literal["largest", "all"] | StrictIndex
EnhancerName = Literal["none", "gfpgan"]
PoseMismatchPolicy = Literal["flag", "refuse"]

DETECTORS: tuple[str, ...] = get_args(DetectorName)
FUSERS: tuple[str, ...] = get_args(FuserName)
OUTPUT_FORMATS: tuple[str, ...] = get_args(OutputFormat)
BLEND_MODES: tuple[str, ...] = get_args(BlendMode)
ENHANCERS: tuple[str, ...] = get_args(EnhancerName)
POSE_MISMATCH_POLICIES: tuple[str, ...] = get_args(PoseMismatchPolicy)

CONTENT_TYPES: dict[str, str] = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}


class ImageLimits(BaseModel):
    """Bounds on every input image, and on a job's and a batch's images together (their
    decoded pixels bound a worker's memory: 3 bytes each as RGB, a few times that in the
    pipeline's copies), checked from the headers before any pixel is decoded."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_bytes: Annotated[int, Field(gt=0, description="Largest accepted encoded image.")] = (
        20 * 1024 * 1024
    )
    max_pixels: Annotated[
        int, Field(gt=0, description="Largest accepted width x height (decompression bombs).")
    ] = 40_000_000
    min_side: Annotated[int, Field(gt=0, description="Smallest accepted width or height.")] = 16
    max_job_pixels: Annotated[
        int,
        Field(
            gt=0,
            description="Most decoded pixels of one job's images together (sources, references "
            "and target): what a worker holds for the job. Three images at max_pixels.",
        ),
    ] = 120_000_000
    max_batch_pixels: Annotated[
        int,
        Field(
            gt=0,
            description="Most decoded pixels of the jobs that share one fuse-batch run: the "
            "relay closes a batch before it, the flow sends a job past it back to the relay.",
        ),
    ] = 240_000_000

    def check_job_pixels(self, pixels: int) -> None:
        """Refuse a job whose images decode to more than ``max_job_pixels`` together
        (``JobTooLarge``, permanent)."""
        if pixels > self.max_job_pixels:
            raise JobTooLarge(
                f"The job's images decode to {pixels / 1e6:.1f} megapixels together, over "
                f"the budget of {self.max_job_pixels / 1e6:.1f} per job.",
                detail=f"{pixels} pixels > {self.max_job_pixels}",
            )


class VideoLimits(BaseModel):
    """Bounds on every input video, checked when it is probed (before any frame is fused)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_bytes: Annotated[int, Field(gt=0, description="Largest accepted video file.")] = (
        500 * 1024 * 1024
    )
    max_duration_s: Annotated[
        float, Field(gt=0, description="Longest accepted video, in seconds.")
    ] = 600.0
    max_side: Annotated[
        int, Field(gt=0, description="Largest accepted width or height, as displayed.")
    ] = 1920
    max_fps: Annotated[float, Field(gt=0, description="Highest accepted average frame rate.")] = (
        60.0
    )


MAX_SOURCES = 8
"""Most source images one job may carry."""
MAX_REFERENCES = 8
"""Most reference images one job may carry."""


class FaceMapping(BaseModel):
    """One target face and the source image whose face is fused onto it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: StrictIndex = Field(description="Index of the source image (0 = the first).")
    target: StrictIndex | None = Field(
        None,
        description="Target face by its number in reading order (rows top to bottom, left "
        "to right; 0 = the first).",
    )
    reference: StrictIndex | None = Field(
        None,
        description="Instead of target: index of a reference image; the target face most "
        "similar to the reference's face is chosen.",
    )

    @model_validator(mode="after")
    def _one_target(self) -> FaceMapping:
        if (self.target is None) == (self.reference is None):
            raise ValueError("give exactly one of target and reference")
        return self


class FusionOptions(BaseModel):
    """What a caller may choose for one fusion job."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    detector: DetectorName = Field("mtcnn", description="Face detector.")
    fuser: FuserName = Field("classic", description="Fusion method.")
    identity_weight: float = Field(
        0.85,
        ge=0.0,
        le=1.0,
        strict=True,
        description="How much of the source face to carry (0 keeps target).",
    )
    face: FaceChoice = Field(
        "largest", description="Target face(s) to replace: 'largest', 'all' or a face index."
    )
    blend: BlendMode = Field("multiband", description="How the face is blended back.")
    color_transfer: bool = Field(
        True, strict=True, description="Match the source face's colour to the target."
    )
    keep_occluders: bool = Field(
        True,
        strict=True,
        description="Classic fuser: keep what covers the target face (glasses, a brim, hair; "
        "told from the face's skin by colour) over the fused face, and stop the fused face "
        "below the source's hairline.",
    )
    mirror_source: bool = Field(
        True,
        strict=True,
        description="Classic fuser: fuse the source mirrored when it is turned the other way "
        "from the target face (a face's sides swap: a parting or a mole moves across).",
    )
    on_pose_mismatch: PoseMismatchPolicy = Field(
        "flag",
        description="When a source and a target face still differ in pose beyond the limits "
        "(after mirroring): 'flag' returns the result with quality.pose_mismatch set; "
        "'refuse' fails the job with the permanent code pose_mismatch.",
    )
    sharpen: float = Field(
        0.0, ge=0.0, le=2.0, strict=True, description="Unsharp-mask amount (0 = off)."
    )
    enhancer: EnhancerName = Field(
        "none",
        description="Face restoration of the fused face before it is blended back: 'none' or "
        "'gfpgan' (a GFPGAN 1.4 ONNX model the operator provides and pins).",
    )
    enhancer_blend: float = Field(
        0.8,
        ge=0.0,
        le=1.0,
        strict=True,
        description="How much of the restored face to keep (1 = all).",
    )
    min_identity: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        strict=True,
        description="Quality floor on the result's identity similarity to the source (0.5 is "
        "the same-person threshold): below it the job retries once with the next fuser "
        "settings and returns the better result.",
    )
    mapping: tuple[FaceMapping, ...] = Field(
        (),
        max_length=MAX_SOURCES * 2,
        description="Per-face sources: which source image goes onto which target face (by "
        "reading-order number or by a reference image). Empty: the first source onto the "
        "faces that 'face' chooses.",
    )
    output_format: OutputFormat = Field("png", description="Encoding of the result image.")
    jpeg_quality: int = Field(
        92, ge=50, le=100, strict=True, description="Quality for JPEG and WebP output."
    )

    @model_validator(mode="after")
    def _mapping_or_face(self) -> FusionOptions:
        if self.mapping and "face" in self.model_fields_set and self.face != "largest":
            raise ValueError("'face' and 'mapping' exclude each other: the mapping names the faces")
        return self

    @property
    def content_type(self) -> str:
        """The MIME type of the encoded result."""
        return CONTENT_TYPES[self.output_format]

    def as_sent(self) -> dict[str, Any]:
        """The options the caller set, and only those, as JSON: what the webapi stores and
        sends to the flow, which fills the rest from the operator's ``FusionSettings``
        block (``apply_defaults``) or the defaults here."""
        return self.model_dump(mode="json", exclude_unset=True)


NsfwLabel = Literal[
    "FEMALE_GENITALIA_COVERED",
    "FACE_FEMALE",
    "BUTTOCKS_EXPOSED",
    "FEMALE_BREAST_EXPOSED",
    "FEMALE_GENITALIA_EXPOSED",
    "MALE_BREAST_EXPOSED",
    "ANUS_EXPOSED",
    "FEET_EXPOSED",
    "BELLY_COVERED",
    "FEET_COVERED",
    "ARMPITS_COVERED",
    "ARMPITS_EXPOSED",
    "FACE_MALE",
    "BELLY_EXPOSED",
    "MALE_GENITALIA_EXPOSED",
    "ANUS_COVERED",
    "FEMALE_BREAST_COVERED",
    "BUTTOCKS_COVERED",
]
"""The labels of NudeNet's detector, in the order of its output channels."""
NSFW_LABELS: tuple[str, ...] = get_args(NsfwLabel)
ModerationMode = Literal["enforce", "report", "off"]
MODERATION_MODES: tuple[str, ...] = get_args(ModerationMode)
DEFAULT_BLOCKED_LABELS: tuple[NsfwLabel, ...] = (
    "BUTTOCKS_EXPOSED",
    "FEMALE_BREAST_EXPOSED",
    "FEMALE_GENITALIA_EXPOSED",
    "MALE_GENITALIA_EXPOSED",
    "ANUS_EXPOSED",
)


class ModerationPolicy(BaseModel):
    """What the NSFW check looks for and what it does with a hit (an operator setting)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: ModerationMode = Field(
        "enforce",
        description="enforce: a flagged image fails the job with content_blocked (never "
        "retried); report: the job goes on and the findings are logged and returned; "
        "off: no check.",
    )
    check_inputs: bool = Field(
        True, description="Check the source and target images before any face detection."
    )
    check_result: bool = Field(True, description="Check the result image before it is stored.")
    blocked_labels: tuple[NsfwLabel, ...] = Field(
        DEFAULT_BLOCKED_LABELS, description="Detector labels that flag an image."
    )
    threshold: float = Field(
        0.5, gt=0.0, le=1.0, description="Lowest detector score at which a blocked label counts."
    )
    label_thresholds: dict[NsfwLabel, float] = Field(
        default_factory=dict, description="Per-label thresholds that replace the threshold."
    )

    @field_validator("label_thresholds")
    @classmethod
    def _scores(cls, value: dict[NsfwLabel, float]) -> dict[NsfwLabel, float]:
        if any(not 0.0 < v <= 1.0 for v in value.values()):
            raise ValueError("label thresholds must be in (0, 1]")
        return value

    @property
    def checks_inputs(self) -> bool:
        """Whether the inputs are checked."""
        return self.mode != "off" and self.check_inputs

    @property
    def checks_result(self) -> bool:
        """Whether the result is checked."""
        return self.mode != "off" and self.check_result

    def threshold_for(self, label: NsfwLabel) -> float:
        """The score at or above which ``label`` counts."""
        return self.label_thresholds.get(label, self.threshold)
