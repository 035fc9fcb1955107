"""Per-face source mapping: reading order, index and reference entries, on real photos."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from pydantic import ValidationError

from tasks.detect import detect_faces
from tasks.errors import InvalidInput, NoFaceFound
from tasks.mapping import reading_order
from tasks.options import FaceMapping, FusionOptions
from tasks.pipeline import Detections, PipelineContext, detect_stage
from tasks.stages import fuse_images
from tasks.types import Box, Face, RGBImage
from tests import samples

LANDMARKS = np.zeros((5, 2), dtype=np.float32)


def _detect_astronaut(
    target: RGBImage, *mapping: FaceMapping, **images: Sequence[RGBImage]
) -> Detections:
    """``detect_stage`` of the astronaut (``images``: extra sources and references) onto
    ``target`` with ``mapping``."""
    return detect_stage(
        samples.astronaut_rgb(),
        target,
        FusionOptions(mapping=list(mapping)),
        PipelineContext(),
        **images,
    )


def _face(cx: float, cy: float, size: float = 40.0) -> Face:
    half = size / 2
    return Face(Box(cx - half, cy - half, cx + half, cy + half), 0.99, LANDMARKS)


def test_reading_order_is_rows_top_down_then_left_to_right() -> None:
    faces = [_face(300, 110), _face(100, 100), _face(200, 95), _face(150, 300), _face(50, 310)]
    assert reading_order(faces) == [1, 2, 0, 4, 3]
    assert reading_order([]) == []


def test_mapping_entries_name_one_target_and_exclude_a_face_choice() -> None:
    with pytest.raises(ValidationError):
        FaceMapping(source=0)
    with pytest.raises(ValidationError):
        FaceMapping(source=0, target=1, reference=0)
    with pytest.raises(ValidationError):
        FusionOptions(face="all", mapping=[FaceMapping(source=0, target=0)])
    FusionOptions(mapping=[FaceMapping(source=1, reference=0)])


def _reference_crop(reading_index: int) -> np.ndarray:
    """A crop around one of t1's faces, as a caller would send a reference photo."""
    faces = detect_faces(samples.t1_rgb())
    box = faces[reading_order(faces)[reading_index]].box
    y0, x0 = max(0, int(box.y1) - 40), max(0, int(box.x1) - 40)
    return np.ascontiguousarray(samples.t1_rgb()[y0 : int(box.y2) + 40, x0 : int(box.x2) + 40])


def test_detect_resolves_indices_and_references_to_their_own_sources() -> None:
    target = samples.t1_rgb()
    faces = detect_faces(target)
    order = reading_order(faces)
    found = _detect_astronaut(
        target,
        FaceMapping(source=1, target=5),
        FaceMapping(source=0, reference=0),
        extra_sources=[samples.grace_hopper_rgb()],
        references=[_reference_crop(3)],
    )
    assert [order.index(i) for i in found.target_indices] == [5, 3]
    assert [s.index for s in found.per_face] == [1, 0]
    assert found.per_face[0].image is not found.per_face[1].image
    assert found.target_count == len(faces) == 6

    with pytest.raises(InvalidInput, match="out of range"):
        _detect_astronaut(target, FaceMapping(source=0, target=6))
    with pytest.raises(InvalidInput, match="same target face"):
        _detect_astronaut(
            target,
            FaceMapping(source=0, target=3),
            FaceMapping(source=0, reference=0),
            references=[_reference_crop(3)],
        )
    with pytest.raises(InvalidInput, match="source 1"):
        _detect_astronaut(target, FaceMapping(source=1, target=0))
    with pytest.raises(NoFaceFound, match="source image 1"):
        _detect_astronaut(
            target, FaceMapping(source=1, target=0), extra_sources=[samples.no_face_rgb()]
        )


def test_two_sources_fused_onto_their_faces_with_a_quality_report_per_source() -> None:
    options = FusionOptions(
        mapping=[FaceMapping(source=0, target=0), FaceMapping(source=1, reference=0)]
    )
    result = fuse_images(
        samples.astronaut_jpeg_bytes(),
        samples.t1_jpeg_bytes(),
        options,
        PipelineContext(),
        extra_sources=[samples.grace_hopper_jpeg_bytes()],
        references=[samples.encode(_reference_crop(3))],
    )
    assert result.faces_replaced == 2
    assert result.quality is not None and result.quality.faces_lost == 0
    faces = detect_faces(samples.t1_rgb())
    order = reading_order(faces)
    assert [f.index for f in result.quality.faces] == [order[0], order[3]]
    # Each face is compared with its own source: swapping the sources' embeddings would
    # not give the same similarities (grace_hopper and the astronaut differ).
    assert all(f.source_similarity is not None for f in result.quality.faces)
    import io

    from PIL import Image

    image = np.asarray(Image.open(io.BytesIO(result.data)).convert("RGB")).astype(int)
    original = samples.t1_rgb().astype(int)
    for i in range(len(faces)):
        box = faces[i].box
        region = np.s_[int(box.y1) : int(box.y2), int(box.x1) : int(box.x2)]
        changed = np.abs(image[region] - original[region]).mean() > 2.0
        assert changed == (i in (order[0], order[3])), i


def test_cli_map_specs() -> None:
    import typer

    from faceflow.cli import _parse_map

    assert _parse_map("1:4") == {"source": 1, "target": 4}
    assert _parse_map("0:r2") == {"source": 0, "reference": 2}
    for bad in ("1", "a:1", "1:x", "1:r"):
        with pytest.raises(typer.BadParameter):
            _parse_map(bad)
