"""The default pipeline of this checkout against another one, in turns.

Run: ``.venv/bin/python bench/compare.py PATH [--pairs 4] [--runs 15] [--threads 1]``.
``PATH`` is another checkout (a ``git worktree`` of an older commit). Each turn starts a
fresh process per checkout (``PYTHONPATH`` and working directory set to it, so each
imports its own code; checked), loads the models, makes two warm calls of
``fuse_images(astronaut, grace_hopper)`` with default options, then times ``--runs``
calls. The checkouts alternate, so a load that comes and goes hits both. Prints, per pair,
the wall and CPU medians, their ratio (this checkout over ``PATH``), the load average and
the per-stage medians; then the range and median of the ratios. Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parents[1]

CHILD = """
import json, statistics, sys, time
import tasks
from faceflow import samples
from tasks.options import FusionOptions
from tasks.pipeline import PipelineContext, warm_up
from pathlib import Path
# A checkout before the stage table (1dc7e48) has no tasks/stages.py; ask the checkout's
# own folder, not the import system (the editable install would find this one's).
if (Path(tasks.__file__).parent / "stages.py").exists():
    from tasks.stages import fuse_images
else:
    from tasks.pipeline import fuse_images

runs = int(sys.argv[1])
ctx = PipelineContext.for_this_machine()
warm_up(ctx)
source, target = samples.astronaut_jpeg_bytes(), samples.grace_hopper_jpeg_bytes()
for _ in range(2):
    fuse_images(source, target, FusionOptions(), ctx)
walls, cpus, stages = [], [], {}
for _ in range(runs):
    cpu, wall = time.process_time(), time.perf_counter()
    result = fuse_images(source, target, FusionOptions(), ctx)
    walls.append((time.perf_counter() - wall) * 1000.0)
    cpus.append((time.process_time() - cpu) * 1000.0)
    for stage, ms in result.timings_ms.items():
        stages.setdefault(stage, []).append(ms)
print(json.dumps({
    "tasks": tasks.__file__,
    "wall": statistics.median(walls),
    "cpu": statistics.median(cpus),
    "stages": {s: round(statistics.median(v), 1) for s, v in stages.items()},
}))
"""


def run_in(checkout: Path, runs: int, threads: str) -> dict[str, Any]:
    """The child's figures, run in ``checkout`` with its own code."""
    env = dict(os.environ, PYTHONPATH=str(checkout))
    env.pop("OMP_NUM_THREADS", None)
    if threads != "default":
        env["OMP_NUM_THREADS"] = threads
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(runs)],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode:
        raise SystemExit(f"{checkout}: exit {done.returncode}\n{done.stderr[-2000:]}")
    figures: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    if not str(figures["tasks"]).startswith(str(checkout)):
        raise SystemExit(f"{checkout} imported another checkout's code: {figures['tasks']}")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("other", type=Path, help="The checkout to compare with.")
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--threads", default="1", help="OMP_NUM_THREADS, or 'default'.")
    args = parser.parse_args()
    other = args.other.resolve()
    ratios: list[float] = []
    for pair in range(args.pairs):
        before = run_in(other, args.runs, args.threads)
        after = run_in(HERE, args.runs, args.threads)
        ratio = after["wall"] / before["wall"]
        ratios.append(ratio)
        print(
            f"pair {pair}: {other.name} {before['wall']:.0f} ms (cpu {before['cpu']:.0f})"
            f"  {HERE.name} {after['wall']:.0f} ms (cpu {after['cpu']:.0f})"
            f"  ratio {ratio:.3f}  load {os.getloadavg()[0]:.2f}",
            flush=True,
        )
        print(f"  {other.name:>10}: {before['stages']}")
        print(f"  {HERE.name:>10}: {after['stages']}", flush=True)
    print(
        f"ratios {min(ratios):.3f} to {max(ratios):.3f}, median {statistics.median(ratios):.3f}"
        f"  (OMP_NUM_THREADS {args.threads})"
    )


if __name__ == "__main__":
    main()
