"""The quality report of a result: what the webapi stores on the job and the CLI prints.

Pydantic only (no numpy, no torch), so ``flows.params.ResultRef`` and the webapi can carry
it without the pipeline. ``tasks.quality`` computes it.

Identity similarity is on a 0..1 scale derived from the embedding model's distance ``d``:
``1 - d / (2 * threshold)``, clipped, so 0.5 is the model's same-person threshold (dlib's
ResNet: distance 0.6), 1 the same embedding, and different people score below 0.5.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from tasks.options import BlendMode, FuserName

Degrees = Annotated[float, Field(description="Angle in degrees.")]
Similarity = Annotated[float, Field(ge=0.0, le=1.0)]


class PoseAngles(BaseModel):
    """Head pose (or a pose difference) in degrees: yaw (left/right), pitch (up/down), roll."""

    model_config = ConfigDict(frozen=True)

    yaw: Degrees
    pitch: Degrees
    roll: Degrees


class FuserSettings(BaseModel):
    """The fuser settings one attempt used (what a quality-floor retry changes)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    fuser: FuserName
    identity_weight: float = Field(ge=0.0, le=1.0)
    blend: BlendMode


class FaceQuality(BaseModel):
    """Quality of one replaced face."""

    index: int = Field(description="Index of the target face (largest first).")
    detector_score: float = Field(description="Detector confidence of the target face.")
    found: bool = Field(description="Whether the fused face is still detected in the result.")
    result_score: float | None = Field(
        None, description="Detector confidence of the fused face in the result."
    )
    source_similarity: Similarity | None = Field(
        None, description="Identity similarity of the fused face to the source face."
    )
    target_similarity: Similarity | None = Field(
        None, description="Identity similarity of the fused face to the original target face."
    )
    target_pose: PoseAngles
    pose_difference: PoseAngles = Field(
        description="Target pose minus source pose (the source as fused: mirrored if it was)."
    )
    pose_mismatch: bool = Field(description="Source and target poses differ beyond the limits.")
    mirrored: bool = Field(
        False, description="The source was fused mirrored (it faced the other way)."
    )
    confirmed: bool | None = Field(
        None,
        description="Whether a second, independent detector (dlib's HOG) also finds the fused "
        "face; null when it does not find the original target face either (a profile).",
    )


class AttemptQuality(BaseModel):
    """One fusion attempt of a job: its settings and how it scored."""

    settings: FuserSettings
    source_similarity: Similarity | None
    faces_lost: int
    faces_unconfirmed: int = 0


class QualityReport(BaseModel):
    """How good a result is: detection, identity, pose, and which fuser settings won."""

    identity_model: str = Field(description="Embedding model of the similarities.")
    source_score: float = Field(description="Detector confidence of the source face.")
    source_pose: PoseAngles
    faces: list[FaceQuality]
    source_similarity: Similarity | None = Field(
        None, description="Worst source similarity over the replaced faces."
    )
    target_similarity: Similarity | None = Field(
        None, description="Highest target similarity over the replaced faces."
    )
    faces_lost: int = Field(0, description="Replaced faces no longer detected in the result.")
    faces_unconfirmed: int = Field(
        0,
        description="Replaced faces the second detector found in the target but not in the "
        "result (a quality-floor retry is made for them).",
    )
    pose_mismatch: bool = Field(False, description="Any replaced face's pose mismatches.")
    min_identity: float | None = Field(None, description="The job's quality floor, if any.")
    below_floor: bool = Field(False, description="The winning result is below the floor.")
    settings: FuserSettings = Field(description="The fuser settings of the returned result.")
    attempts: list[AttemptQuality] = Field(
        default_factory=list, description="Every attempt, in order (two when the floor retried)."
    )
    ms: float = Field(0.0, description="Time spent assessing, in milliseconds.")
    marks: list[str] = Field(
        default_factory=list,
        description="How the returned result is marked (docs/provenance.md): c2pa (signed "
        "Content Credentials), watermark (in its pixels); empty when marking is off.",
    )

    def as_json(self) -> dict[str, Any]:
        """The report as JSON-ready data (floats rounded for display)."""
        return self.model_dump(mode="json")
