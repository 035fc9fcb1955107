"""GPU-shaped compute for the benchmarks: the pipeline's compute becomes a fixed time per job.

On a GPU host a job's model and image maths leave the CPU: what remains on the cores is
orchestration. To show the control plane's share as it would be there, ``install(ms)``
replaces the compute of every stage of ``tasks.stages.PIPELINE`` (the ``tasks.pipeline``
functions its entry names: moderation, detection, alignment, fusion, enhancement,
postprocess, quality) by a ``time.sleep`` of its share of ``ms`` per job — a sleep releases the GIL, as a GPU kernel does — returning what the real stage
returned the first time it saw the same inputs (``faceflow.testing.shaped``; the benchmarks
use the same photos for every job), so every later stage, the result and its store are real. Decoding and
encoding stay real CPU work, as they are on a GPU host.

Installed in a process by ``bench/gpu_shaped_site/sitecustomize.py`` when
``FACEFLOW_BENCH_GPU_MS`` is set in its environment (the bench sets it on the warm worker,
whose children inherit it), and by the bench itself for its bare loop. Nothing outside
``bench/`` knows about it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from faceflow.testing.shaped import shaped

ENV = "FACEFLOW_BENCH_GPU_MS"
SITE = "gpu_shaped_site"

#: Share of a job's compute time each stage sleeps (detection dominates on a GPU too),
#: spent in the first of the ``tasks.pipeline`` functions the stage's table entry names
#: (``tasks.stages.Stage.calls``); the others it names are shaped with no sleep of their
#: own (the quality stage's reference: its result is in ``checked_stage``'s key).
SHARES: dict[str, float] = {
    "moderate_inputs": 0.05,
    "detect": 0.35,
    "align": 0.05,
    "fuse": 0.2,
    "enhance": 0.0,
    "postprocess": 0.1,
    "quality": 0.2,
    "moderate_result": 0.05,
}


def install(ms: float) -> None:
    """Make the compute stages of ``tasks.stages.PIPELINE`` GPU-shaped: ``ms`` per job."""
    from tasks import pipeline
    from tasks.stages import PIPELINE

    if getattr(pipeline, "_gpu_shaped_ms", None) is not None:
        return
    for stage in PIPELINE:
        for i, name in enumerate(stage.calls):
            seconds = ms * SHARES.get(stage.name, 0.0) / 1000.0 if i == 0 else 0.0
            setattr(pipeline, name, shaped(getattr(pipeline, name), seconds))
    detect = pipeline.detect_stage

    def detect_stage_batch(jobs: Sequence[tuple[Any, Any, Any]], ctx: Any) -> list[Any]:
        """Per job, as the shaped ``detect_stage`` (errors per job, as the real one)."""
        found: list[Any] = []
        for source, target, options in jobs:
            try:
                found.append(detect(source, target, options, ctx))
            except pipeline.FaceFlowError as error:
                found.append(error)
        return found

    pipeline.detect_stage_batch = detect_stage_batch  # type: ignore[assignment]
    pipeline._gpu_shaped_ms = ms  # type: ignore[attr-defined]
