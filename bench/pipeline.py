"""Pipeline benchmark: model load, warm per-stage medians, peak RSS, cost growth with pixels.

Run: ``.venv/bin/python bench/pipeline.py [--runs 10] [--json]``. Prints figures; asserts nothing.
Targets on the 2-core dev machine: warm total <= 500 ms, model load <= 2 s,
peak RSS <= 1.5 GB, and a 4x-pixels target costs <= 3x the base.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cv2
import numpy as np

from faceflow import samples
from tasks.models import MODEL_CACHE
from tasks.options import MODERATION_MODES, FusionOptions, ModerationPolicy
from tasks.pipeline import PipelineContext, warm_up
from tasks.stages import STAGE_NAMES, fuse_images


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _measure(source: bytes, target: bytes, ctx: PipelineContext, runs: int) -> dict[str, float]:
    per_stage: dict[str, list[float]] = {s: [] for s in STAGE_NAMES}
    totals: list[float] = []
    options = FusionOptions()
    for _ in range(runs):
        start = time.perf_counter()
        result = fuse_images(source, target, options, ctx)
        totals.append((time.perf_counter() - start) * 1000.0)
        for stage, ms in result.timings_ms.items():
            per_stage[stage].append(ms)
    figures = {s: statistics.median(v) for s, v in per_stage.items() if v}
    figures["total"] = statistics.median(totals)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--moderation", choices=MODERATION_MODES, default="enforce", help="NSFW check mode."
    )
    args = parser.parse_args()

    ctx = PipelineContext.for_this_machine(moderation=ModerationPolicy(mode=args.moderation))
    source = samples.astronaut_jpeg_bytes()
    target = samples.grace_hopper_jpeg_bytes()
    base_target = samples.grace_hopper_rgb()
    big = cv2.resize(
        base_target,
        (base_target.shape[1] * 2, base_target.shape[0] * 2),
        interpolation=cv2.INTER_CUBIC,
    )
    big_target = samples.encode(np.asarray(big, dtype=np.uint8), "JPEG", quality=95)

    rss_before = _peak_rss_mb()
    load_ms = warm_up(ctx)
    fuse_images(source, target, FusionOptions(), ctx)  # first real run (allocations, JIT paths)
    base = _measure(source, target, ctx, args.runs)
    fuse_images(source, big_target, FusionOptions(), ctx)
    large = _measure(source, big_target, ctx, args.runs)
    report = {
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "device": ctx.device,
        "runs": args.runs,
        "model_load_ms": round(load_ms, 1),
        "model_loads": MODEL_CACHE.total_loads(),
        "base_ms": {k: round(v, 1) for k, v in base.items()},
        "x4_pixels_ms": {k: round(v, 1) for k, v in large.items()},
        "x4_over_base": round(large["total"] / base["total"], 2),
        "peak_rss_mb_before_models": round(rss_before, 1),
        "peak_rss_mb": round(_peak_rss_mb(), 1),
    }
    if args.json:
        print(json.dumps(report))
        return
    print(f"device {report['device']}  runs {args.runs}  machine {report['machine']}")
    print(f"model load + warm-up: {report['model_load_ms']} ms  (loads: {report['model_loads']})")
    header = "  ".join(f"{s:>11}" for s in [*STAGE_NAMES, "total"])
    print(f"{'':14}{header}")
    for label, fig in (("512x600", base), ("1024x1200", large)):
        cells = "  ".join(f"{fig.get(s, 0.0):9.1f}ms" for s in [*STAGE_NAMES, "total"])
        print(f"{label:<14}{cells}")
    print(f"4x pixels / base: {report['x4_over_base']}x   peak RSS: {report['peak_rss_mb']} MB")


if __name__ == "__main__":
    main()
