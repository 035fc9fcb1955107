"""Quality benchmark: the quality report over every ordered pair of the sample faces.

Run: ``.venv/bin/python bench/quality.py [--options '{"identity_weight": 1.0}'] [--json]``.

Faces: skimage's astronaut, matplotlib's grace_hopper, and every face of insightface's
``t1.jpg``, both in place (the group photo as target, one face index per pair) and as an
upscaled crop (the face about 200 px wide, as a separate photo). Every face is a source
(the in-place t1 faces only through their crops) and every face a target; pairs of one
person are skipped. Each pair runs align → fuse → postprocess → quality on detections
made once per photo. Prints median and worst source similarity, median target
similarity, faces lost, pose mismatches (after mirroring) and the sources mirrored, the
lighting error (``tasks.quality.lighting_error``: the result's low-pass against the
target's inside the face, in levels), the faces a second, independent detector (dlib's HOG,
the report's ``confirmed``) finds in the target but no longer in the result (before the
retry ``checked_stage`` makes for them: the bench runs one attempt), and the median ms per
stage; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from faceflow import samples
from tasks.detect import detect_faces
from tasks.options import FusionOptions
from tasks.pipeline import (
    Detections,
    PipelineContext,
    align_stage,
    fuse_stage,
    postprocess_stage,
    quality_stage,
    reference_stage,
    warm_up,
)
from tasks.quality import lighting_error
from tasks.report import QualityReport
from tasks.types import Face, RGBImage


@dataclass(frozen=True)
class Sample:
    """One face in one photo: who it is, the photo, and the face's index in it."""

    name: str
    person: str
    image: RGBImage
    faces: list[Face]
    index: int
    source: bool  # usable as a source (the photo's largest face is this person)


def sample_faces(ctx: PipelineContext) -> list[Sample]:
    """Every sample face, detected once."""

    def detect(image: RGBImage) -> list[Face]:
        return detect_faces(image, device=ctx.device, model_dir=ctx.model_dir, pins=ctx.pins)

    out: list[Sample] = []
    for name, image in (
        ("astronaut", samples.astronaut_rgb()),
        ("grace_hopper", samples.grace_hopper_rgb()),
    ):
        out.append(Sample(name, name, image, detect(image), 0, True))
    group = samples.t1_rgb()
    group_faces = detect(group)
    by_x = sorted(range(len(group_faces)), key=lambda i: group_faces[i].box.x1)
    for k, i in enumerate(by_x):  # people named in reading order, left to right
        person = f"t1-{k}"
        out.append(Sample(f"{person}@photo", person, group, group_faces, i, False))
        crop = samples.face_crop(group, group_faces[i])
        out.append(Sample(f"{person}@crop", person, crop, detect(crop), 0, True))
    return out


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def run(options: FusionOptions, ctx: PipelineContext, limit: int | None) -> dict[str, object]:
    """Every pair's report and the summary table."""
    faces = sample_faces(ctx)
    pairs = [(s, t) for s in faces if s.source for t in faces if t.person != s.person and t.faces]
    if limit is not None:
        pairs = pairs[:limit]
    stage_ms: dict[str, list[float]] = {s: [] for s in ("align", "fuse", "postprocess", "quality")}
    rows: list[dict[str, object]] = []
    reports: list[QualityReport] = []
    for source, target in pairs:
        chosen = FusionOptions.model_validate({**options.as_sent(), "face": target.index})
        detections = Detections(source.faces[0], [target.faces[target.index]], 1, len(target.faces))
        marks = [time.perf_counter()]
        aligned = align_stage(source.image, target.image, detections, chosen, ctx)
        marks.append(time.perf_counter())
        fused = fuse_stage(aligned, chosen, ctx)
        marks.append(time.perf_counter())
        image = postprocess_stage(target.image, fused, chosen, ctx)
        marks.append(time.perf_counter())
        reference = reference_stage(source.image, target.image, detections, chosen, ctx)
        report = quality_stage(image, reference, chosen, ctx)
        marks.append(time.perf_counter())
        for stage, a, b in zip(stage_ms, marks, marks[1:], strict=False):
            stage_ms[stage].append((b - a) * 1000.0)
        reports.append(report)
        face = report.faces[0]
        rows.append(
            {
                "source": source.name,
                "target": target.name,
                "found": face.found,
                "source_similarity": face.source_similarity,
                "target_similarity": face.target_similarity,
                "pose_mismatch": face.pose_mismatch,
                "mirrored": face.mirrored,
                "lighting_error": lighting_error(image, aligned.targets[0]),
                "hog_target": face.confirmed is not None,
                "hog_lost": face.confirmed is False,
            }
        )
    src = [r.source_similarity for r in reports if r.source_similarity is not None]
    tgt = [r.target_similarity for r in reports if r.target_similarity is not None]
    closer = sum(
        1
        for r in reports
        if r.source_similarity is not None
        and r.target_similarity is not None
        and r.source_similarity > r.target_similarity
    )
    worst = min(rows, key=lambda r: r["source_similarity"] or 0.0) if rows else None  # type: ignore[arg-type, return-value]
    return {
        "options": options.as_sent(),
        "pairs": len(reports),
        "source_similarity_median": _median(src),
        "source_similarity_worst": round(min(src), 4) if src else None,
        "worst_pair": f"{worst['source']} -> {worst['target']}" if worst else None,
        "target_similarity_median": _median(tgt),
        "closer_to_source": closer,
        "faces_lost": sum(r.faces_lost for r in reports),
        "pose_mismatches": sum(1 for r in reports if r.pose_mismatch),
        "mirrored": sum(1 for r in rows if r["mirrored"]),
        "lighting_error_median": _median([float(r["lighting_error"]) for r in rows]),  # type: ignore[arg-type]
        "lighting_error_worst": max((float(r["lighting_error"]) for r in rows), default=None),  # type: ignore[arg-type]
        "hog_faces_in_targets": sum(1 for r in rows if r["hog_target"]),
        "hog_faces_lost": [f"{r['source']} -> {r['target']}" for r in rows if r["hog_lost"]],
        "stage_ms_median": {k: round(statistics.median(v), 1) for k, v in stage_ms.items() if v},
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--options", default="{}", help="FusionOptions as JSON.")
    parser.add_argument("--limit", type=int, default=None, help="Only the first N pairs.")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--rows", action="store_true", help="Print every pair.")
    args = parser.parse_args()
    options = FusionOptions.model_validate(json.loads(args.options))
    ctx = PipelineContext.for_this_machine()
    warm_up(ctx)
    load = os.getloadavg()[0]
    report = run(options, ctx, args.limit)
    report["load_avg_1min"] = [round(load, 2), round(os.getloadavg()[0], 2)]
    if args.json:
        print(json.dumps(report))
        return
    rows = report.pop("rows")
    if args.rows:
        for row in rows:  # type: ignore[attr-defined]
            print(
                f"{row['source']:>16} -> {row['target']:<16} found {row['found']!s:5} "
                f"source {row['source_similarity']}  target {row['target_similarity']}  "
                f"pose mismatch {row['pose_mismatch']}"
            )
    for key, value in report.items():
        print(f"{key:>26}: {value}")


if __name__ == "__main__":
    main()
