"""Regenerate ``docs/example.png``: source | target | result of astronaut → grace_hopper.

Run: ``.venv/bin/python bench/example.py``.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
from PIL import Image

from faceflow import samples
from tasks.options import FusionOptions
from tasks.pipeline import PipelineContext
from tasks.stages import fuse_images

OUT = Path(__file__).resolve().parents[1] / "docs" / "example.png"


def main() -> None:
    result = fuse_images(
        samples.astronaut_jpeg_bytes(),
        samples.grace_hopper_jpeg_bytes(),
        FusionOptions(),
        PipelineContext.for_this_machine(),
    )
    fused = np.asarray(Image.open(io.BytesIO(result.data)).convert("RGB"))
    height = fused.shape[0]
    panels = []
    for image in (samples.astronaut_rgb(), samples.grace_hopper_rgb(), fused):
        scale = height / image.shape[0]
        size = (round(image.shape[1] * scale), height)
        panels.append(np.asarray(Image.fromarray(image).resize(size, Image.Resampling.LANCZOS)))
    gap = np.full((height, 8, 3), 255, dtype=np.uint8)
    strip = np.concatenate([panels[0], gap, panels[1], gap, panels[2]], axis=1)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(strip).save(OUT, optimize=True)
    print(f"wrote {OUT} ({strip.shape[1]}x{strip.shape[0]}); timings {result.timings_ms}")


if __name__ == "__main__":
    main()
