"""The quality report of a fusion: is the face still there, whose identity does it carry,
and did the poses match.

``identity_reference`` embeds the source face and the original target faces once per job
(dlib ResNet, ``tasks.identity``) and estimates their poses (``tasks.pose``);
``assess`` then re-detects each fused face in the result, near where it was pasted, and
scores it against that reference. A quality-floor retry reuses the reference, so only
the result's faces are embedded again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import cv2
import numpy as np
import numpy.typing as npt

from tasks.detect import DETECTORS, detect_faces
from tasks.identity import EMBEDDER, F32, embed_with_dlib, similarity
from tasks.models import MODEL_CACHE
from tasks.options import DetectorName, FaceChoice
from tasks.pose import fused_pose, head_pose, pose_difference, pose_mismatch, should_mirror
from tasks.postprocess import SHADING_SCALE, eye_distance, face_mask, masked_low_pass
from tasks.report import AttemptQuality, FaceQuality, FuserSettings, PoseAngles, QualityReport
from tasks.types import AlignedFace, Box, Face, RGBImage

SEARCH_MARGIN = 0.5
"""The fused face is searched for in its target box grown by this fraction per side."""
MIN_OVERLAP = 0.3
"""Smallest IoU between a result detection and the target face box to count as found."""
RECHECK_FACE_PX = 80
"""MTCNN searches the region at a scale where the face is at most this wide, for faces of
at least half of it (a few small pyramid levels instead of the whole photo's)."""


@dataclass(frozen=True)
class IdentityReference:
    """The source and original target faces: embeddings, poses and detector scores."""

    source_face: Face
    target_faces: list[Face]
    target_indices: list[int]
    source_embedding: F32
    target_embeddings: F32
    source_pose: PoseAngles
    target_poses: list[PoseAngles]
    ms: float
    face_source_embeddings: F32 | None = None  # a per-face mapping's own source per face
    face_source_poses: list[PoseAngles] | None = None
    target_seen_by_hog: tuple[bool, ...] = ()  # the second detector finds each target face

    def source_embedding_for(self, i: int) -> F32:
        """The embedding of the source fused onto target face ``i``."""
        if self.face_source_embeddings is not None:
            return self.face_source_embeddings[i]
        return self.source_embedding

    def source_pose_for(self, i: int) -> PoseAngles:
        """The pose of the source fused onto target face ``i``."""
        return self.face_source_poses[i] if self.face_source_poses else self.source_pose


def target_indices(choice: FaceChoice, count: int) -> list[int]:
    """Indices (largest first) of the target faces a ``face`` option selects."""
    if choice == "largest":
        return [0]
    if choice == "all":
        return list(range(count))
    return [int(choice)]


def identity_reference(
    source: RGBImage,
    target: RGBImage,
    source_face: Face,
    target_faces: Sequence[Face],
    indices: Sequence[int],
    *,
    device: str = "cpu",
    pins: Mapping[str, str] | None = None,
    per_face_sources: Sequence[tuple[RGBImage, Face]] = (),
) -> IdentityReference:
    """Embed and pose the source face and the chosen target faces (one network batch);
    with a per-face mapping, each target face's own source face too."""
    start = time.perf_counter()
    pairs = [(source, source_face), *((target, face) for face in target_faces)]
    embeddings = embed_with_dlib([*pairs, *per_face_sources], device=device, pins=pins)
    per_face = embeddings[len(pairs) :] if per_face_sources else None
    embeddings = embeddings[: len(pairs)]
    seen = tuple(found_by_hog(target, face) for face in target_faces)
    return IdentityReference(
        source_face=source_face,
        target_faces=list(target_faces),
        target_indices=list(indices),
        source_embedding=embeddings[0],
        target_embeddings=embeddings[1:],
        source_pose=head_pose(source_face.landmarks),
        target_poses=[head_pose(face.landmarks) for face in target_faces],
        ms=(time.perf_counter() - start) * 1000.0,
        face_source_embeddings=per_face,
        face_source_poses=(
            [head_pose(face.landmarks) for _, face in per_face_sources]
            if per_face_sources
            else None
        ),
        target_seen_by_hog=seen,
    )


def find_fused_face(
    result: RGBImage,
    where: Face,
    *,
    detector: DetectorName,
    device: str,
    model_dir: object = None,
    pins: Mapping[str, str] | None = None,
) -> Face | None:
    """The face detected in ``result`` at the place of target face ``where``, if any."""
    height, width = result.shape[:2]
    box = where.box
    if DETECTORS[detector].searches_region:
        # MTCNN's pyramid costs by the image's size: search the face's region only, at a
        # scale where the face is small.
        grow_x, grow_y = box.width * SEARCH_MARGIN, box.height * SEARCH_MARGIN
        x0, y0 = max(0, int(box.x1 - grow_x)), max(0, int(box.y1 - grow_y))
        x1 = min(width, int(np.ceil(box.x2 + grow_x)))
        y1 = min(height, int(np.ceil(box.y2 + grow_y)))
        region = np.ascontiguousarray(result[y0:y1, x0:x1])
        scale = min(1.0, RECHECK_FACE_PX / max(box.width, box.height, 1.0))
        faces = detect_faces(
            region,
            detector=detector,
            device=device,
            pins=pins,
            max_side=max(16, round(max(region.shape[:2]) * scale)),
            min_face_size=max(12, round(0.5 * max(box.width, box.height) * scale)),
        )
    else:  # SCRFD sees a fixed-size input: the whole photo, as it was detected at first
        x0 = y0 = 0
        faces = detect_faces(
            result,
            detector=detector,
            device=device,
            model_dir=model_dir,  # type: ignore[arg-type]
            pins=pins,
        )
    offset = np.array([x0, y0], dtype=np.float32)
    best: tuple[float, Face] | None = None
    for face in faces:
        moved = Face(
            Box(face.box.x1 + x0, face.box.y1 + y0, face.box.x2 + x0, face.box.y2 + y0),
            face.score,
            (face.landmarks + offset).astype(np.float32),
        )
        overlap = moved.box.iou(box)
        if overlap >= MIN_OVERLAP and (best is None or overlap > best[0]):
            best = (overlap, moved)
    return best[1] if best is not None else None


def assess(
    result: RGBImage,
    reference: IdentityReference,
    settings: FuserSettings,
    *,
    detector: DetectorName,
    device: str = "cpu",
    model_dir: object = None,
    pins: Mapping[str, str] | None = None,
    min_identity: float | None = None,
    earlier: Sequence[AttemptQuality] = (),
    mirror: bool = False,
) -> QualityReport:
    """The quality report of ``result`` against ``reference`` (its faces re-detected);
    ``mirror``: the fuser mirrored a source turned the other way (``tasks.pose``)."""
    start = time.perf_counter()
    found = [
        find_fused_face(
            result, face, detector=detector, device=device, model_dir=model_dir, pins=pins
        )
        for face in reference.target_faces
    ]
    present = [(i, face) for i, face in enumerate(found) if face is not None]
    embeddings = embed_with_dlib([(result, face) for _, face in present], device=device, pins=pins)
    by_face = {i: embeddings[k] for k, (i, _) in enumerate(present)}
    faces: list[FaceQuality] = []
    for i, target_face in enumerate(reference.target_faces):
        fused = found[i]
        source_pose, target_pose = reference.source_pose_for(i), reference.target_poses[i]
        difference = pose_difference(
            fused_pose(source_pose, target_pose, mirror=mirror), target_pose
        )
        embedding = by_face.get(i)
        confirmed = (
            fused is not None and found_by_hog(result, target_face)
            if i < len(reference.target_seen_by_hog) and reference.target_seen_by_hog[i]
            else None
        )
        faces.append(
            FaceQuality(
                index=reference.target_indices[i],
                detector_score=round(float(target_face.score), 4),
                found=fused is not None,
                result_score=round(float(fused.score), 4) if fused is not None else None,
                source_similarity=(
                    round(similarity(embedding, reference.source_embedding_for(i)), 4)
                    if embedding is not None
                    else None
                ),
                target_similarity=(
                    round(similarity(embedding, reference.target_embeddings[i]), 4)
                    if embedding is not None
                    else None
                ),
                target_pose=reference.target_poses[i],
                pose_difference=difference,
                pose_mismatch=pose_mismatch(difference),
                mirrored=mirror and should_mirror(source_pose, target_pose),
                confirmed=confirmed,
            )
        )
    source_sims = [f.source_similarity for f in faces if f.source_similarity is not None]
    target_sims = [f.target_similarity for f in faces if f.target_similarity is not None]
    lost = sum(1 for f in faces if not f.found)
    worst = min(source_sims) if source_sims and lost == 0 else None
    unconfirmed = sum(1 for f in faces if f.confirmed is False)
    attempt = AttemptQuality(
        settings=settings, source_similarity=worst, faces_lost=lost, faces_unconfirmed=unconfirmed
    )
    return QualityReport(
        identity_model=EMBEDDER,
        source_score=round(float(reference.source_face.score), 4),
        source_pose=reference.source_pose,
        faces=faces,
        source_similarity=worst,
        target_similarity=max(target_sims) if target_sims else None,
        faces_lost=lost,
        faces_unconfirmed=unconfirmed,
        pose_mismatch=any(f.pose_mismatch for f in faces),
        min_identity=min_identity,
        below_floor=min_identity is not None and (worst is None or worst < min_identity),
        settings=settings,
        attempts=[*earlier, attempt],
        ms=round((time.perf_counter() - start) * 1000.0 + reference.ms, 1),
    )


def better(first: QualityReport, second: QualityReport) -> bool:
    """Whether ``second`` beats ``first``: fewer faces lost, then fewer that the second
    detector misses, then higher source similarity."""
    if second.faces_lost != first.faces_lost:
        return second.faces_lost < first.faces_lost
    if second.faces_unconfirmed != first.faces_unconfirmed:
        return second.faces_unconfirmed < first.faces_unconfirmed
    return (second.source_similarity or 0.0) > (first.source_similarity or 0.0)


HOG_FACE_PX = 110
"""dlib's HOG detector looks for faces of at least 80 px: a region is scaled so the face is
about this wide before the second detector looks at it."""


def lighting_error(result: RGBImage, target: AlignedFace) -> float:
    """How far ``result``'s light on the replaced face is from the target's: the mean
    absolute difference, in levels (0-255, averaged over R, G, B), of the two faces' low
    passes (sigma ``SHADING_SCALE`` eye distances) inside the target's inner face."""
    size = target.size
    crop = cv2.warpAffine(
        result, target.matrix, (size, size), flags=cv2.INTER_LINEAR, borderMode=cv2.BORDER_REPLICATE
    )
    inner = (face_mask(size, target.landmarks) > 0.9).astype(np.float32)
    if inner.sum() < 16:
        return 0.0
    sigma = SHADING_SCALE * eye_distance(target.landmarks)
    low_result = masked_low_pass(crop.astype(np.float32), inner, sigma)
    low_target = masked_low_pass(target.crop.astype(np.float32), inner, sigma)
    return round(float(np.abs(low_result - low_target)[inner > 0].mean()), 2)


def found_by_hog(image: RGBImage, face: Face) -> bool:
    """Whether dlib's HOG face detector (an independent second detector, built into dlib;
    frontal and half-profile faces only) finds a face at ``face`` in ``image``, looking at
    the face's region levelled (``levelled_region``)."""
    region, where = levelled_region(image, face)
    rects = _hog_detector(region)
    return any(
        Box(r.left(), r.top(), r.right(), r.bottom()).iou(where) >= MIN_OVERLAP for r in rects
    )


def levelled_region(image: RGBImage, face: Face) -> tuple[npt.NDArray[np.uint8], Box]:
    """The region of ``face`` (its box grown by ``SEARCH_MARGIN`` a side) as HOG sees it
    best, and where the face's box lies in it: scaled so the face is ``HOG_FACE_PX`` wide,
    turned about the box's centre so the eyes are level, in grey stretched to the full
    range (1st to 99th percentile). HOG's templates are upright faces: on t1.jpg's second
    face (rolled 30°) its score was ≈ 0, the threshold, either side of it from one fuser
    setting to the next, and is ≈ 2 levelled."""
    height, width = image.shape[:2]
    box = face.box
    grow_x, grow_y = box.width * SEARCH_MARGIN, box.height * SEARCH_MARGIN
    x0, y0 = max(0, int(box.x1 - grow_x)), max(0, int(box.y1 - grow_y))
    x1 = min(width, int(np.ceil(box.x2 + grow_x)))
    y1 = min(height, int(np.ceil(box.y2 + grow_y)))
    scale = HOG_FACE_PX / max(box.width, 1.0)
    size = (max(1, round((x1 - x0) * scale)), max(1, round((y1 - y0) * scale)))
    grey = cv2.cvtColor(np.ascontiguousarray(image[y0:y1, x0:x1]), cv2.COLOR_RGB2GRAY)
    grey = cv2.resize(grey, size, interpolation=cv2.INTER_AREA if scale < 1.0 else cv2.INTER_LINEAR)
    where = Box(
        (box.x1 - x0) * scale, (box.y1 - y0) * scale, (box.x2 - x0) * scale, (box.y2 - y0) * scale
    )
    left, right = face.landmarks[0], face.landmarks[1]
    roll = float(np.degrees(np.arctan2(right[1] - left[1], right[0] - left[0])))
    centre = ((where.x1 + where.x2) / 2.0, (where.y1 + where.y2) / 2.0)
    turn = cv2.getRotationMatrix2D(centre, roll, 1.0)
    grey = cv2.warpAffine(grey, turn, size, flags=cv2.INTER_LINEAR, borderMode=cv2.BORDER_REFLECT)
    low, high = np.percentile(grey, (1.0, 99.0))
    stretched = (grey.astype(np.float32) - low) * (255.0 / max(float(high - low), 1.0))
    return np.clip(stretched + 0.5, 0, 255).astype(np.uint8), where


@dataclass(frozen=True)
class _Hog:
    detector: Any
    lock: threading.Lock  # dlib's objects are not safe to call from two threads at once


def _hog_detector(image: npt.NDArray[np.uint8]) -> list[Any]:
    def load() -> _Hog:
        import dlib

        return _Hog(dlib.get_frontal_face_detector(), threading.Lock())

    hog = MODEL_CACHE.get(("dlib-hog", "cpu", None), load)
    with hog.lock:
        return list(hog.detector(image, 0))
