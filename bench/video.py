"""Video jobs in one process: the whole job against the bare per-frame loop, and memory.

Run: ``.venv/bin/python bench/video.py [--seconds 20] [--size 480x360] [--fps 15]
[--modes bare,job] [--chunk-s 10]``; ``--workers 1,2 [--gpu-frame-ms 100] [--gpu-detect-ms 100]``: the job
fanned out over that many warm GPU workers instead (``bench/video_fanout.py``). Writes a clip (a slow pan and zoom over insightface's
t1.jpg group photo, H.264, streamed to disk frame by frame), then, each mode in a fresh
process (so peak RSS is its own):

- ``bare``: the bare per-frame loop: decode each frame, detect its faces, fuse the
  largest with the table's frame stages, encode it (no planning, no chunks, no audio);
- ``job``: ``tasks.video.fuse_video`` (probe, sampled moderation, analysis, plan, chunked
  render, join with audio, sampled result moderation, identity report);
- ``records``: the analysis pass and the face plan alone, and the bytes per frame of what
  they keep for the whole video (the Python objects' sizes, arrays included).

Prints frames per second, wall, CPU seconds of the process (``cpu_s``: on a shared machine
the wall depends on the other load, the CPU time much less), peak RSS, the job's step
timings and its times to first progress (``first_analysis_progress_s``: start → first
frames analysed, the moment ``fuse-video``'s progress record can first show
``frames_analysed`` > 0; ``first_progress_s``: start → first frame rendered, its first
record with ``frames_done`` > 0; a real job adds its dispatch and up to a second of the
records' write interval);
then the job's fps as a share of the bare loop's. Run it for two lengths to see whether memory grows with the
video (it must not: it is bounded by a render group and a chunk). Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def write_clip(path: Path, seconds: float, width: int, height: int, fps: int) -> Path:
    """A pan and zoom over t1.jpg, encoded as it is made (never the whole clip in memory)."""
    import av
    import cv2
    import numpy as np

    from faceflow import samples

    photo = samples.t1_rgb()
    n = int(seconds * fps)
    with av.open(str(path), "w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=fps, options={"preset": "veryfast"})
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.time_base = Fraction(1, fps)
        for i in range(n):
            t = i / max(1, n - 1)
            w = int(photo.shape[1] * (0.9 - 0.3 * t))
            h = w * height // width
            x = int((photo.shape[1] - w) * (0.5 + 0.4 * np.sin(2 * np.pi * t)) / 1.0)
            x = max(0, min(photo.shape[1] - w, x))
            y = max(0, min(photo.shape[0] - h, (photo.shape[0] - h) // 2))
            image = cv2.resize(photo[y : y + h, x : x + w], (width, height))
            rgb = np.ascontiguousarray(image, dtype=np.uint8)
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
            frame.pts = i
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    return path


def bare(clip: Path, out: Path) -> dict[str, float | None]:
    """Decode → detect → the table's frame stages on the largest face → encode, per frame."""
    from faceflow import samples
    from tasks.detect import detect_faces
    from tasks.options import FusionOptions
    from tasks.pipeline import PipelineContext, warm_up
    from tasks.stages import run_stages
    from tasks.video import FrameRunner, Source, frame_work, sources_of
    from tasks.video_io import SegmentWriter, frame_timestamps, probe_video, read_frames
    from tasks.video_plan import Swap

    ctx = PipelineContext.for_this_machine()
    warm_up(ctx)
    options = FusionOptions()
    (source,) = sources_of([samples.grace_hopper_rgb()], options, ctx)
    info, pts = probe_video(clip), frame_timestamps(clip)
    runner = FrameRunner(ctx)
    start, cpu = time.perf_counter(), time.process_time()
    with SegmentWriter(out, info=info, end_pts=info.end_pts) as writer:
        for frame in read_frames(clip, 0, len(pts), timestamps=pts):
            image = frame.image
            faces = detect_faces(image, device=ctx.device, max_side=ctx.detect_max_side)
            if faces:
                work = frame_work(
                    image, [Swap(0, faces[0])], [Source(source.image, source.face)], options
                )
                run_stages([work], ctx, runner, only=lambda stage: stage.frames)
                image = work.image if work.image is not None else image
            writer.write(image, frame.pts)
    wall, cpu_s = time.perf_counter() - start, time.process_time() - cpu
    return {"frames": len(pts), "wall_s": wall, "fps": len(pts) / wall, "cpu_s": cpu_s}


def job(clip: Path, out: Path, chunk_s: float) -> dict[str, float | None]:
    """``fuse_video`` on the clip; ``first_analysis_progress_s`` and ``first_progress_s``:
    from the start to the first frames analysed and the first frame rendered (the flow's
    first progress records with frames analysed and with frames done)."""
    from faceflow import samples
    from tasks.pipeline import PipelineContext, warm_up
    from tasks.video import fuse_video

    ctx = PipelineContext.for_this_machine()
    warm_up(ctx)
    first: list[float] = []
    first_analysed: list[float] = []

    def rendered_frame(index: int) -> None:
        if not first:
            first.append(time.perf_counter() - start)

    def analysed_frames(count: int) -> None:
        if not first_analysed:
            first_analysed.append(time.perf_counter() - start)

    start, cpu = time.perf_counter(), time.process_time()
    result = fuse_video(
        [samples.grace_hopper_jpeg_bytes()],
        clip,
        out,
        ctx=ctx,
        chunk_s=chunk_s,
        rendered_frame=rendered_frame,
        analysed_frames=analysed_frames,
    )
    wall, cpu_s = time.perf_counter() - start, time.process_time() - cpu
    frames = result.info.frame_count
    return {
        "frames": frames,
        "wall_s": wall,
        "fps": frames / wall,
        "cpu_s": cpu_s,
        "chunks": result.chunks,
        "first_analysis_progress_s": round(first_analysed[0], 2) if first_analysed else None,
        "first_progress_s": round(first[0], 2) if first else None,
        **{f"{k}_ms": round(v) for k, v in result.timings_ms.items()},
    }


def object_bytes(root: object) -> int:
    """Bytes of ``root`` and every object it reaches (numpy arrays with their data)."""
    import gc

    seen: set[int] = set()
    total, stack = 0, [root]
    while stack:
        item = stack.pop()
        if id(item) in seen or isinstance(item, type):
            continue
        seen.add(id(item))
        total += sys.getsizeof(item)
        stack.extend(gc.get_referents(item))
    return total


def records(clip: Path) -> dict[str, float | None]:
    """Analysis and plan of the clip: bytes per frame they keep."""
    from tasks.options import FusionOptions
    from tasks.pipeline import PipelineContext, warm_up
    from tasks.video import Analysis, analyse
    from tasks.video_io import frame_timestamps, read_frames
    from tasks.video_plan import plan_faces, scene_cuts

    ctx = PipelineContext.for_this_machine()
    warm_up(ctx)
    options = FusionOptions()
    pts = frame_timestamps(clip)
    frames = (f.image for f in read_frames(clip, 0, len(pts), timestamps=pts))
    analysis = analyse(frames, options, ctx, Analysis())
    plan = plan_faces(analysis.faces, scene_cuts(analysis.signatures), options.face)
    n = len(pts)
    return {
        "frames": n,
        "faces_per_frame": round(sum(len(f) for f in analysis.faces) / n, 2),
        "analysis_bytes_per_frame": round(object_bytes(analysis) / n),
        "plan_bytes_per_frame": round(object_bytes(plan) / n),
        "both_bytes_per_frame": round(object_bytes((analysis, plan)) / n),
    }


def child(mode: str, clip: Path, chunk_s: float) -> None:
    """One mode in this process; prints its figures as JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.mp4"
        runs: dict[str, Callable[[], dict[str, float | None]]] = {
            "bare": lambda: bare(clip, out),
            "job": lambda: job(clip, out, chunk_s),
            "records": lambda: records(clip),
        }
        figures = runs[mode]()
    figures["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(figures))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--size", default="480x360")
    parser.add_argument("--fps", type=int, default=15)
    parser.add_argument("--modes", default="bare,job")
    parser.add_argument("--chunk-s", type=float, default=10.0)
    parser.add_argument(
        "--workers",
        help="worker counts, e.g. 1,2: the job fanned out over warm workers (video_fanout.py)",
    )
    parser.add_argument(
        "--gpu-frame-ms", type=float, help="with --workers: each rendered frame a fixed sleep"
    )
    parser.add_argument(
        "--gpu-detect-ms", type=float, help="with --workers: each analysed frame a fixed sleep"
    )
    parser.add_argument("--child", nargs=2, metavar=("MODE", "CLIP"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], Path(args.child[1]), args.chunk_s)
        return
    width, height = (int(v) for v in args.size.split("x"))
    with tempfile.TemporaryDirectory() as tmp:
        clip = write_clip(Path(tmp) / "clip.mp4", args.seconds, width, height, args.fps)
        print(f"clip: {args.seconds:g} s, {args.size}, {args.fps} fps")
        if args.workers:
            from bench.video_fanout import run

            counts = [int(n) for n in args.workers.split(",")]
            run(clip, counts, args.chunk_s, args.gpu_frame_ms, args.gpu_detect_ms)
            return
        results = {}
        for mode in args.modes.split(","):
            line = (
                subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--chunk-s",
                        str(args.chunk_s),
                        "--child",
                        mode,
                        str(clip),
                    ],
                    check=True,
                    capture_output=True,
                    text=True,
                    cwd=HERE,
                )
                .stdout.strip()
                .splitlines()[-1]
            )
            results[mode] = json.loads(line)
            print(f"{mode:>5}: {json.dumps(results[mode])}")
        if "bare" in results and "job" in results:
            share = results["job"]["fps"] / results["bare"]["fps"]
            cpu = results["bare"]["cpu_s"] / results["job"]["cpu_s"]
            print(f"job fps / bare fps: {share:.2f}; bare CPU s / job CPU s: {cpu:.2f}")


if __name__ == "__main__":
    main()
