"""The ``fuse-video`` flow: the coordinator of one video job attempt.

It runs on the control pool (its ``video`` queue), never on a GPU: it holds no GPU slot
while it waits, so a one-worker GPU pool cannot deadlock. Its work is done by
``fuse-video-part`` runs on the GPU pool's ``video`` queue (``flows/video_parts.py``,
created and waited on by ``flows.video_fanout.Parts``): the ``probe`` part (probe,
moderation of sampled input frames), one ``analyse-<start>-<stop>`` part per frame range
not analysed yet (about a chunk each, spread over the pool's workers), the ``plan`` part
(cuts, chunks, face plan from the merged analysis), then one ``chunk-<i>`` part per chunk
not stored yet, spread over the pool's workers. The coordinator then fetches the stored
chunks and joins them with the audio; the ``report`` part moderates sampled result frames
and measures each track's identity similarity (read back from the stored chunks); the
coordinator then stores the result with that report (``flows.video_store``' tasks). It
renders nothing and runs no model: it imports neither the pipeline nor a model runtime
(``tests/test_video_plan_store.py`` checks it). With marking on, every rendered frame
carries the job's watermark (``tasks.watermark.VIDEO``) and the result its signed Content
Credentials.

A range's analysis and a rendered chunk are stored under their content keys (video,
frames, detector; chunk, face plan, sources and options): a re-dispatched attempt creates
parts only for the ranges and chunks missing, a crashed part is run again and redoes only
its own. One deadline (``deadline_at``) is shared by
the coordinator and every part. Cancel: the relay cancels the coordinator run and its
parts (tag ``video_parts_tag``); a coordinator stopped by SIGTERM cancels its parts and
ends ``Cancelled`` itself.

Contract as ``fuse-faces``: the result under ``result_key(job, attempt, "mp4")`` and its
``VideoResultRef`` sidecar last; the run returns the ref dict, or on failure writes the
``JobFailure`` record and ends ``Failed`` with ``"[code] message"``.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

from prefect import Task, flow, get_run_logger
from prefect.states import Cancelled, State

from blocks.settings import load_settings
from blocks.storage import ByteStore, is_stored, load_storage, read_from, read_locally, write_to
from flows.artifacts import publish_video_result
from flows.attempt import failed, result_marker, start_attempt
from flows.deadline import Deadline
from flows.outcome import record_failure
from flows.params import (
    DEFAULT_SETTINGS_BLOCK,
    DEFAULT_SIGNING_BLOCK,
    DEFAULT_STORAGE_BLOCK,
    PLAN_PART,
    PROBE_PART,
    REPORT_PART,
    VIDEO_ANALYSE_DEPLOYMENT,
    VIDEO_FLOW_NAME,
    VIDEO_RENDER_DEPLOYMENT,
    JobAttempt,
    VideoResultRef,
    analysis_manifest_key,
    analysis_part,
    chunk_part,
    chunks_manifest_key,
    result_key,
    result_meta_key,
    video_plan_key,
    video_report_key,
)
from flows.video_fanout import Parts, PartsCancelled
from flows.video_progress import PartsProgress, VideoProgress
from flows.video_store import (
    RENDERED,
    VIDEO_STAGES,
    WORKDIR_PREFIX,
    ReportRecord,
    Signer,
    collect_task,
    guarded,
    join_task,
    load_plan,
    store_task,
    sweep_workdirs,
    video_marks,
)
from tasks.errors import TransientError
from tasks.options import FusionOptions
from tasks.video_records import track_reports

__all__ = ["VIDEO_STAGES", "WORKDIR_PREFIX", "fuse_video_flow", "sweep_workdirs"]

R = TypeVar("R")


class Terminated(Exception):
    """The coordinator's process got SIGTERM (its run is being cancelled)."""


@contextmanager
def sigterm_raises() -> Iterator[None]:
    """SIGTERM raises ``Terminated`` on this (main) thread while the block runs, so the
    coordinator can cancel its parts and end ``Cancelled``."""

    def handler(signum: int, frame: object) -> None:
        raise Terminated()

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: Prefect's own handling stays
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@flow(
    name=VIDEO_FLOW_NAME,
    flow_run_name="{job_id}",
    persist_result=False,
    retries=0,
    validate_parameters=True,
    log_prints=False,
)
def fuse_video_flow(
    job_id: str,
    owner_id: str,
    source_key: str,
    target_key: str,
    deadline_at: datetime,
    options: FusionOptions | None = None,
    attempt: int = 1,
    extra_source_keys: list[str] | None = None,
    reference_keys: list[str] | None = None,
    storage_block: str = DEFAULT_STORAGE_BLOCK,
    settings_block: str = DEFAULT_SETTINGS_BLOCK,
    chunk_s: float | None = None,
    binding: str | None = None,
    signing_block: str = DEFAULT_SIGNING_BLOCK,
) -> dict[str, Any] | State[Any]:
    """Fuse the source face into every frame of the target video for one job attempt
    (a per-face mapping: each source onto its person, ``extra_source_keys`` and
    ``reference_keys`` as for ``fuse-faces``).

    Returns ``VideoResultRef.model_dump(mode="json")``; on failure the run ends ``Failed``
    with ``"[code] message"`` and the attempt's ``JobFailure`` is in storage. Parameters
    not bound to the job (``binding``, ``flows.binding``) fail it with
    ``run_binding_invalid`` before anything is read."""
    stage = "load"
    store: ByteStore | None = None
    progress: VideoProgress | None = None
    parts: Parts | None = None
    spec = JobAttempt.of_run(locals())
    deadline = Deadline.of(deadline_at)
    try:
        with sigterm_raises():
            start_attempt(
                spec,
                storage_block=storage_block,
                settings_block=settings_block,
                signing_block=signing_block,
            )
            settings = load_settings(settings_block)
            store = load_storage(storage_block)
            progress = VideoProgress.of_run(store, job_id, attempt)
            signer = Signer(result_marker(settings, signing_block))
            parameters = {
                "job": spec.model_dump(mode="json", exclude_unset=True),  # options as sent
                "storage_block": storage_block,
                "settings_block": settings_block,
                "signing_block": signing_block,
                "chunk_s": chunk_s,
            }
            parts = Parts(job_id, attempt, parameters, deadline)
            sweep_workdirs()
            with tempfile.TemporaryDirectory(prefix=f"{WORKDIR_PREFIX}{os.getpid()}-") as tmp:
                workdir = Path(tmp)
                progress.start(stage := "probe")
                parts.run([PROBE_PART], VIDEO_ANALYSE_DEPLOYMENT)
                stored = load_plan(store, video_plan_key(job_id, attempt))
                analyses = stored.analysis_keys
                write_to(
                    store, analysis_manifest_key(job_id, attempt), json.dumps(analyses).encode()
                )
                progress.probed(stored.probed.info.frame_count)
                spans = {analysis_part(*span): span[1] - span[0] for span in stored.ranges}
                missing = []
                for part, key in zip(spans, analyses, strict=True):
                    if is_stored(store, key):  # analysed by an earlier attempt
                        progress.found(progress.analysis, spans[part])
                    else:
                        missing.append(part)
                progress.begin(progress.analysis)
                progress.start(stage := "analyse")
                analysing = PartsProgress(progress, job_id, attempt, spans, progress.analysis)
                parts.run(
                    missing,
                    VIDEO_ANALYSE_DEPLOYMENT,  # spread over the workers
                    done=lambda part, message: analysing.done(part, message.startswith(RENDERED)),
                    tick=analysing.tick,
                )
                parts.run([PLAN_PART], VIDEO_ANALYSE_DEPLOYMENT)
                stored = load_plan(store, video_plan_key(job_id, attempt))
                planned, probed = stored.planned, stored.probed
                if planned is None:
                    raise TransientError(detail="the plan part stored no plan")
                chunks, keys = planned.chunks, stored.chunk_keys
                progress.planned(probed.info.frame_count, len(chunks))
                write_to(store, chunks_manifest_key(job_id, attempt), json.dumps(keys).encode())
                frames = {chunk_part(c.index): c.frames for c in chunks}
                missing = []
                for chunk, key in zip(chunks, keys, strict=True):
                    if is_stored(store, key):  # rendered by an earlier attempt
                        progress.found(progress.render, chunk.frames)
                    else:
                        missing.append(chunk_part(chunk.index))
                progress.begin(progress.render)
                progress.start(stage := "render_chunk")
                running = PartsProgress(progress, job_id, attempt, frames, progress.render)
                parts.run(
                    missing,
                    VIDEO_RENDER_DEPLOYMENT,
                    done=lambda part, message: running.done(part, message.startswith(RENDERED)),
                    tick=running.tick,
                )
                rendered = sum(parts.messages[p].startswith(RENDERED) for p in missing)

                def step(name: str, fn: Task[..., R], *args: Any) -> R:
                    nonlocal stage
                    if name != stage:
                        progress.start(name)
                    stage = name
                    return guarded(name, deadline).run(fn, *args)

                video, result = workdir / "input", workdir / "result.mp4"
                read_locally(store, target_key, video)  # the join takes its audio
                segments = step("join", collect_task, store, keys, workdir)
                info = step("join", join_task, segments, video, result, probed.info)
                progress.start(stage := "report")
                parts.run([REPORT_PART], VIDEO_ANALYSE_DEPLOYMENT)
                report = ReportRecord.model_validate_json(
                    read_from(store, video_report_key(job_id, attempt))
                )
                plan = planned.plan
                ref = VideoResultRef(
                    key=result_key(job_id, attempt, "mp4"),
                    content_type="video/mp4",
                    width=info.width,
                    height=info.height,
                    faces_replaced=sum(len(swaps) for swaps in plan.frames),
                    device=report.device,
                    moderation=probed.flags + report.flags,
                    frames=info.frame_count,
                    duration_s=float(info.duration_s),
                    chunks=len(chunks),
                    chunks_rendered=rendered,
                    cuts=planned.cuts,
                    switches=plan.switches,
                    tracks=[asdict(t) for t in track_reports(plan, report.similarities)],
                    frame_failures=running.failures,
                    marks=video_marks(signer.marker is not None, info),
                )
                if signer.marker is not None:  # the result's ingredients: the job's inputs
                    signer.sources = [
                        read_from(store, k) for k in [source_key, *(extra_source_keys or [])]
                    ]
                    signer.references = [read_from(store, k) for k in reference_keys or []]
                    signer.digest = stored.digest
                step(
                    "store",
                    store_task,
                    store,
                    result,
                    signer,
                    ref,
                    result_meta_key(job_id, attempt),
                )
                facts = [
                    f"{ref.frames} frames, {ref.width}x{ref.height}, {ref.duration_s:.1f} s",
                    f"{ref.chunks} chunk(s), {ref.chunks_rendered} rendered in this attempt",
                    f"{ref.faces_replaced} faces replaced, {len(ref.tracks)} track(s)",
                ]
                publish_video_result(job_id, attempt, ref.key, ref.marks, facts)
    except (Terminated, PartsCancelled) as exc:
        if parts is not None:
            parts.cancel()
        get_run_logger().warning("Video job %s attempt %d cancelled: %s", job_id, attempt, exc)
        return Cancelled(message="Cancelled by FaceFlow")
    except Exception as exc:
        if parts is not None:
            parts.cancel()
        record_failure(store if store is not None else storage_block, job_id, attempt, exc, stage)
        return failed(exc, f"Video job {job_id} attempt {attempt}")
    finally:
        if progress is not None:
            progress.close()
    get_run_logger().info(
        "Video job %s: %d chunk(s), %d rendered", job_id, ref.chunks, ref.chunks_rendered
    )
    return ref.model_dump(mode="json")
