"""Contact sheet of the classic fuser's look on a fixed set of sample pairs.

Run: ``.venv/bin/python bench/contact_sheet.py [--out docs/look.jpg]``.

One row per pair (``PAIRS``, the sample faces of ``bench/quality.py``) under a header
row naming the columns: the target, the result with the default options, the result
without the look options (``keep_occluders`` and ``mirror_source`` off), and the source;
each tile the face's region, 200 px square. The JPEG is written at the highest quality
(85 down) that keeps it under ``MAX_BYTES``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cv2
import numpy as np

from bench.quality import Sample, sample_faces
from tasks.options import FusionOptions
from tasks.pipeline import Detections, PipelineContext, align_stage, fuse_stage, postprocess_stage
from tasks.types import Box, RGBImage

PAIRS = (
    ("astronaut", "grace_hopper"),  # glasses and a cap's brim on the target
    ("astronaut", "t1-1@crop"),  # a source lit from the front onto a face lit from the side
    ("t1-5@crop", "t1-4@crop"),  # the source's long hair
    ("t1-4@crop", "t1-1@crop"),  # a rolled target the second detector used to lose
    ("t1-1@crop", "t1-3@crop"),  # the target's shadows, no longer kept as occluders
)
COLUMNS = ("target", "result", "without look options", "source")
TILE = 200
HEADER = 28
MAX_BYTES = 300_000
PLAIN: dict[str, object] = {"keep_occluders": False, "mirror_source": False}


def _tile(image: RGBImage, box: Box) -> RGBImage:
    grow = 0.6
    x0, y0 = max(0, int(box.x1 - box.width * grow)), max(0, int(box.y1 - box.height * grow))
    x1, y1 = int(box.x2 + box.width * grow), int(box.y2 + box.height * grow)
    return np.asarray(cv2.resize(image[y0:y1, x0:x1], (TILE, TILE)), dtype=np.uint8)


def _fuse(
    source: Sample, target: Sample, options: dict[str, object], ctx: PipelineContext
) -> RGBImage:
    chosen = FusionOptions.model_validate({**options, "face": target.index})
    detections = Detections(source.faces[0], [target.faces[target.index]], 1, len(target.faces))
    aligned = align_stage(source.image, target.image, detections, chosen, ctx)
    return postprocess_stage(target.image, fuse_stage(aligned, chosen, ctx), chosen, ctx)


def _header() -> RGBImage:
    strip = np.full((HEADER, TILE * len(COLUMNS), 3), 255, dtype=np.uint8)
    for i, name in enumerate(COLUMNS):
        cv2.putText(
            strip,
            name,
            (i * TILE + 8, HEADER - 9),
            cv2.FONT_HERSHEY_SIMPLEX,
            0.5,
            (0, 0, 0),
            1,
            cv2.LINE_AA,
        )
    return strip


def encode_small(sheet: RGBImage, max_bytes: int = MAX_BYTES) -> bytes:
    """``sheet`` as a JPEG at the highest quality (85 down, by 5) under ``max_bytes``."""
    bgr = cv2.cvtColor(sheet, cv2.COLOR_RGB2BGR)
    for quality in range(85, 20, -5):
        ok, data = cv2.imencode(".jpg", bgr, [cv2.IMWRITE_JPEG_QUALITY, quality])
        if ok and len(data) < max_bytes:
            return bytes(data)
    raise ValueError(f"the contact sheet does not fit {max_bytes} bytes")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="docs/look.jpg")
    args = parser.parse_args()
    ctx = PipelineContext.for_this_machine()
    faces = {s.name: s for s in sample_faces(ctx)}
    rows = [_header()]
    for source_name, target_name in PAIRS:
        source, target = faces[source_name], faces[target_name]
        box = target.faces[target.index].box
        rows.append(
            np.hstack(
                [
                    _tile(target.image, box),
                    _tile(_fuse(source, target, {}, ctx), box),
                    _tile(_fuse(source, target, PLAIN, ctx), box),
                    _tile(source.image, source.faces[0].box),
                ]
            )
        )
    data = encode_small(np.vstack(rows))
    Path(args.out).write_bytes(data)
    print(f"{args.out}: {len(PAIRS)} pairs, {' | '.join(COLUMNS)}, {len(data)} bytes")


if __name__ == "__main__":
    main()
