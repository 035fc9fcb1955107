"""Contact sheet of the classic fuser's look on a fixed set of sample pairs.

Run: ``.venv/bin/python bench/contact_sheet.py [--out docs/look.jpg]``.

One row per pair (``faceflow.testing.contact_sheet.PAIRS``, the sample faces of
``bench/quality.py``) under a header row naming the columns: the target, the result with
the default options, the result without the look options (``keep_occluders`` and
``mirror_source`` off), and the source; each tile the face's region, 200 px square. The
JPEG is written at the highest quality (85 down) that keeps it under ``MAX_BYTES``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cv2
import numpy as np

from bench.quality import Sample, sample_faces
from faceflow.testing.contact_sheet import COLUMNS, HEADER, PAIRS, TILE, encode_small
from tasks.options import FusionOptions
from tasks.pipeline import Detections, PipelineContext, align_stage, fuse_stage, postprocess_stage
from tasks.types import Box, RGBImage

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
