"""How far a ``fuse-video`` attempt is: a ``JobProgress`` record in storage for the relay
(``progress_key``: the job's ``progress`` field, the ``job.progress`` webhook, the CLI's
bar) and the run's progress artifact for the Prefect UI.

An attempt makes two passes over the video's frames, each a ``Pass``: the analysis
(``frames_analysed``: faces found in every frame, by the range parts) and the render
(``frames_done``: frames fused, by the render parts). A frame counts in a pass once its
part reported it (``PartsProgress``) or its range or chunk was found stored by an earlier
attempt. A pass's frames per second are this attempt's frames over the time since the
pass began; the ETA is the frames left at the pass's rate, and during the analysis all the
frames still to render at the analysis's rate (no render rate is known yet). The record is
rewritten at most once per ``min_interval_s`` while frames advance, and at once on a new
step or a stored range or chunk. A record that cannot be written is logged and never
fails the job.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from blocks.storage import ByteStore, read_from, write_to
from flows.artifacts import DeferredProgress, artifact_key, start_progress
from flows.params import JobProgress, part_progress_key, progress_key

logger = logging.getLogger("faceflow.flows.video_progress")

STEPS = ("probe", "analyse", "render_chunk", "join", "report", "store")
"""The steps of a video attempt in order (``flows.video.VIDEO_STAGES``' keys)."""
MIN_INTERVAL_S = 1.0
"""Least time between two records written while frames advance."""


@dataclass
class Pass:
    """One pass of an attempt over the video's frames (the analysis or the render)."""

    done: int = 0  # frames of the ranges or chunks stored (by any attempt)
    in_flight: int = 0  # frames the running parts reported, their range or chunk not stored
    worked: int = 0  # frames of the stored ones this attempt analysed or rendered
    parts: int = 0  # ranges or chunks stored
    started: float | None = None  # when this attempt's parts of the pass began

    @property
    def frames(self) -> int:
        """Frames through the pass so far."""
        return self.done + self.in_flight

    def rate(self, now: float) -> float | None:
        """This attempt's frames per second in the pass (None before its first frame)."""
        frames = self.worked + self.in_flight
        if self.started is None or frames == 0 or now <= self.started:
            return None
        return frames / (now - self.started)


class VideoProgress:
    """The progress of one video job attempt, written as it advances."""

    def __init__(
        self,
        store: ByteStore,
        job_id: str,
        attempt: int,
        *,
        min_interval_s: float = MIN_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        artifact: DeferredProgress | None = None,
    ) -> None:
        self.store, self.key, self.attempt = store, progress_key(job_id, attempt), attempt
        self.min_interval_s, self.clock, self.artifact = min_interval_s, clock, artifact
        self.step = STEPS[0]
        self.frames_total = self.chunks_total = 0
        self.analysis, self.render = Pass(), Pass()
        self.written_at: float | None = None
        self.writes = 0

    @classmethod
    def of_run(cls, store: ByteStore, job_id: str, attempt: int) -> VideoProgress:
        """The progress of the current flow run's attempt, with its progress artifact."""
        return cls(
            store, job_id, attempt, artifact=start_progress(artifact_key(job_id, "progress"))
        )

    def start(self, step: str) -> None:
        """Enter ``step`` (one of ``STEPS``); written now."""
        self.step = step
        self.write()

    def probed(self, frames: int) -> None:
        """The video's frames, once probed (not written: the next step writes)."""
        self.frames_total = frames

    def planned(self, frames: int, chunks: int) -> None:
        """The video's frames and render chunks, once planned."""
        self.frames_total, self.chunks_total = frames, chunks
        self.write()

    def found(self, phase: Pass, frames: int) -> None:
        """A range or chunk of ``frames`` frames stored by an earlier attempt (counted, not
        in the rate; not written: ``begin`` writes)."""
        phase.done += frames
        phase.parts += 1

    def begin(self, phase: Pass) -> None:
        """This attempt's parts of ``phase`` start now (not written: ``start`` writes)."""
        phase.started = self.clock()

    def running(self, phase: Pass, frames: int) -> None:
        """The parts of ``phase`` still running reported ``frames`` frames so far; written
        when ``min_interval_s`` passed and the count changed."""
        if frames == phase.in_flight:
            return
        phase.in_flight = frames
        now = self.clock()
        if self.written_at is None or now - self.written_at >= self.min_interval_s:
            self.write()

    def stored(self, phase: Pass, frames: int, worked: bool) -> None:
        """A part of ``phase`` stored its range or chunk of ``frames`` frames: by doing it
        (counted in the rate) or finding it stored; written now."""
        phase.done += frames
        phase.parts += 1
        if worked:
            phase.worked += frames
        self.write()

    @property
    def fps(self) -> float | None:
        """Frames per second of the pass running (the render's once it began)."""
        now = self.clock()
        if self.render.started is not None:
            return self.render.rate(now)
        return self.analysis.rate(now)

    def eta_seconds(self) -> float | None:
        """Seconds until every frame is rendered: the render's frames left at its rate;
        before the render began, the analysis's and all the render's frames left at the
        analysis's rate. None while no rate is known."""
        fps = self.fps
        if fps is None or not self.frames_total:
            return None
        left = max(0, self.frames_total - self.render.frames)
        if self.render.started is None:
            left += max(0, self.frames_total - self.analysis.frames)
        return left / fps

    def record(self) -> JobProgress:
        """The progress as it stands."""
        fps, eta, total = self.fps, self.eta_seconds(), self.frames_total
        return JobProgress(
            frames_analysed=min(self.analysis.frames, total),
            frames_done=min(self.render.frames, total),
            frames_total=total,
            chunks_done=self.render.parts,
            chunks_total=self.chunks_total,
            fps=None if fps is None else round(fps, 3),
            eta_seconds=None if eta is None else round(eta, 1),
            stage=self.step,
            updated_at=datetime.now(UTC),
        )

    def write(self) -> None:
        """Write the record to storage and show it on the progress artifact."""
        record = self.record()
        self.written_at = self.clock()
        try:
            write_to(self.store, self.key, record.model_dump_json().encode())
            self.writes += 1
        except Exception as exc:  # progress never fails the job
            logger.warning("Could not write the progress record: %r", exc)
        if self.artifact is not None:
            self.artifact.show(*self._shown(record))

    def close(self) -> None:
        """Write the last progress to the artifact now (the run is ending)."""
        if self.artifact is not None:
            self.artifact.close(*self._shown(self.record()))

    def _shown(self, record: JobProgress) -> tuple[float, str]:
        """The artifact's value (the pass's share of frames during the analysis and the
        render, else the steps passed) and description."""
        index = STEPS.index(self.step)
        total = record.frames_total
        passes = {"analyse": record.frames_analysed, "render_chunk": record.frames_done}
        share = passes[self.step] / total if total and self.step in passes else None
        value = 100.0 * (index / len(STEPS) if share is None else share)
        text = f"Stage {index + 1}/{len(STEPS)}: {self.step} (attempt {self.attempt})."
        if total and self.step == "analyse":
            text += f" {record.frames_analysed}/{total} frames analysed"
        elif total:
            text += f" {record.frames_done}/{total} frames, "
            text += f"{record.chunks_done}/{record.chunks_total} chunks"
        if total:
            if record.fps is not None and record.eta_seconds is not None:
                text += f", {record.fps:.1f} fps, ETA {record.eta_seconds:.0f} s"
            text += "."
        return value, text


class PartsProgress:
    """The coordinator's count of the frames its running range or render parts of one
    pass (``phase``) did (their ``part_progress_key`` records, read at most once per
    ``min_interval_s``), added to ``progress`` until each part's range or chunk is stored."""

    def __init__(
        self,
        progress: VideoProgress,
        job_id: str,
        attempt: int,
        frames: dict[str, int],
        phase: Pass,
    ) -> None:
        self.progress, self.job_id, self.attempt, self.frames = progress, job_id, attempt, frames
        self.phase = phase
        self.seen: dict[str, int] = {}
        self.read_at: float | None = None
        self.failures: dict[str, int] = {}  # the stored chunks' frame failures, by code

    def tick(self, waiting: set[str]) -> None:
        """Between two polls of the parts: read the running parts' records when due."""
        now = self.progress.clock()
        if self.read_at is not None and now - self.read_at < self.progress.min_interval_s:
            return
        self.read_at = now
        for part in waiting:
            record = self._record(part)
            if record is not None:
                self.seen[part] = min(int(record["frames"]), self.frames[part])
        self.progress.running(self.phase, sum(self.seen.values()))

    def done(self, part: str, worked: bool) -> None:
        """``part`` stored its range or chunk (``worked``: by doing it; a chunk's frame
        failures are added to ``failures``)."""
        record = self._record(part) if worked else None
        for code, count in dict((record or {}).get("failures") or {}).items():
            self.failures[str(code)] = self.failures.get(str(code), 0) + int(count)
        self.seen.pop(part, None)
        self.phase.in_flight = sum(self.seen.values())
        self.progress.stored(self.phase, self.frames[part], worked=worked)

    def _record(self, part: str) -> dict[str, Any] | None:
        key = part_progress_key(self.job_id, self.attempt, part)
        try:
            return dict(json.loads(read_from(self.progress.store, key)))
        except Exception:  # not written yet, or unreadable: progress never fails a job
            return None
