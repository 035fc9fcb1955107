"""Per-face source mapping: which source image's face goes onto which target face.

Target faces are numbered in reading order (``reading_order``: rows top to bottom, left to
right within a row), the way a caller counts the people in a photo. A mapping entry
(``tasks.options.FaceMapping``) names its target face by that number, or by a reference
image: the target face most similar to the reference's face, by identity embedding
(``Embedder``: one call embedding (image, face) pairs; the pipeline passes dlib's ResNet,
``tasks.identity.embed_with_dlib``), as FaceFusion's reference face selector does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import median

import numpy as np
import numpy.typing as npt

from tasks.errors import InvalidInput
from tasks.options import FaceMapping
from tasks.types import Face, RGBImage

F32 = npt.NDArray[np.float32]
Embedder = Callable[[Sequence[tuple[RGBImage, Face]]], F32]
"""Identity embeddings (one row per (image, face) pair), comparable by cosine similarity."""


def reading_order(faces: Sequence[Face]) -> list[int]:
    """Indices of ``faces`` in reading order: rows top to bottom, left to right in a row.

    A face joins the current row when its centre is within half the median face height
    of the row's first face, vertically.
    """
    if not faces:
        return []
    centres = [((f.box.x1 + f.box.x2) / 2.0, (f.box.y1 + f.box.y2) / 2.0) for f in faces]
    half = 0.5 * median(f.box.height for f in faces)
    rows: list[list[int]] = []
    for i in sorted(range(len(faces)), key=lambda i: centres[i][1]):
        if rows and abs(centres[i][1] - centres[rows[-1][0]][1]) <= half:
            rows[-1].append(i)
        else:
            rows.append([i])
    return [i for row in rows for i in sorted(row, key=lambda i: centres[i][0])]


@dataclass(frozen=True, slots=True)
class Assignment:
    """The target faces a mapping chose, in mapping order, and the source of each."""

    target_indices: list[int]  # into the target faces as given (largest first)
    source_indices: list[int]  # into the job's sources
    similarities: list[float | None]  # to the reference, for reference entries


def check_entries(mapping: Sequence[FaceMapping], sources: int, references: int) -> None:
    """``InvalidInput`` for an entry that names a source or reference image the job has not."""
    for entry in mapping:
        if entry.source >= sources:
            raise InvalidInput(f"Mapping names source {entry.source}: the job has {sources}.")
        if entry.reference is not None and entry.reference >= references:
            raise InvalidInput(
                f"Mapping names reference {entry.reference}: the job has {references}."
            )


def cosine(a: F32, b: F32) -> float:
    """Cosine similarity of two embeddings."""
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    return float(np.dot(a, b) / max(na * nb, 1e-12))


def assign_faces(
    mapping: Sequence[FaceMapping],
    target: RGBImage,
    target_faces: Sequence[Face],
    references: Sequence[tuple[RGBImage, Face]],
    embed: Embedder,
) -> Assignment:
    """Resolve ``mapping`` against the target's faces (largest first, as detected).

    ``InvalidInput`` for a target index beyond the faces found, or two entries that end
    on the same target face. Reference entries are resolved with one ``embed`` call.
    """
    order = reading_order(target_faces)
    wanted = sorted({m.reference for m in mapping if m.reference is not None})
    best: dict[int, tuple[int, float]] = {}
    if wanted:
        pairs = [references[r] for r in wanted] + [(target, f) for f in target_faces]
        vectors = embed(pairs)
        refs, faces = vectors[: len(wanted)], vectors[len(wanted) :]
        for r, ref in zip(wanted, refs, strict=True):
            scores = [cosine(ref, face) for face in faces]
            top = int(np.argmax(scores))
            best[r] = (top, scores[top])
    chosen: list[int] = []
    similarities: list[float | None] = []
    for entry in mapping:
        if entry.target is not None:
            if entry.target >= len(order):
                raise InvalidInput(
                    f"Target face {entry.target} is out of range: the target image has "
                    f"{len(order)} face(s)."
                )
            index, score = order[entry.target], None
        else:
            assert entry.reference is not None
            index, score = best[entry.reference][0], round(best[entry.reference][1], 4)
        if index in chosen:
            raise InvalidInput(
                "Two mapping entries chose the same target face.",
                detail=f"reading-order face {order.index(index)}",
            )
        chosen.append(index)
        similarities.append(score)
    return Assignment(chosen, [m.source for m in mapping], similarities)
