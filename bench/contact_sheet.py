"""Contact sheet of the classic fuser's look on a fixed set of sample pairs.

Run: ``.venv/bin/python bench/contact_sheet.py [--out docs/look.jpg]``.

One row per pair (``PAIRS``, the sample faces of ``bench/quality.py``): the target, the
result with the default options, the result without the look options
(``keep_occluders`` and ``mirror_source`` off), and the source; each tile the face's
region, 200 px square.
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
    ("t1-4@crop", "t1-1@crop"),  # the pair a second detector loses
)
TILE = 200
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="docs/look.jpg")
    args = parser.parse_args()
    ctx = PipelineContext.for_this_machine()
    faces = {s.name: s for s in sample_faces(ctx)}
    rows = []
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
    sheet = cv2.cvtColor(np.vstack(rows), cv2.COLOR_RGB2BGR)
    cv2.imwrite(args.out, sheet, [cv2.IMWRITE_JPEG_QUALITY, 85])
    print(f"{args.out}: {len(rows)} pairs, target | result | without the look options | source")


if __name__ == "__main__":
    main()
