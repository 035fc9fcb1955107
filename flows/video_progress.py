"""How far a ``fuse-video`` attempt is: a ``JobProgress`` record in storage for the relay
(``progress_key``: the job's ``progress`` field, the ``job.progress`` webhook, the CLI's
bar) and the run's progress artifact for the Prefect UI.

Frames count as done when rendered or when their chunk was found stored by an earlier
attempt; frames per second are this attempt's rendered frames over the time since its
first render began, and the ETA is the frames left at that rate. The record is rewritten
at most once per ``min_interval_s`` while frames advance, and at once on a new step or a
finished chunk. A record that cannot be written is logged and never fails the job.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
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
        self.frames_done = self.chunks_done = self.rendered = 0
        self.in_flight = 0  # frames render parts rendered of chunks not stored yet
        self.render_started: float | None = None
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

    def planned(self, frames: int, chunks: int) -> None:
        """The video's frames and render chunks, once planned."""
        self.frames_total, self.chunks_total = frames, chunks
        self.write()

    def frame_rendered(self) -> None:
        """One more frame fused by this attempt; written when ``min_interval_s`` passed."""
        now = self.clock()
        if self.render_started is None:
            self.render_started = now
        self.frames_done += 1
        self.rendered += 1
        if self.written_at is None or now - self.written_at >= self.min_interval_s:
            self.write()

    def chunk_done(self, frames: int, rendered: bool) -> None:
        """A chunk of ``frames`` frames is stored: rendered now (its frames were counted as
        they went) or found from an earlier attempt (counted here); written now."""
        self.chunks_done += 1
        if not rendered:
            self.frames_done += frames
        self.write()

    def rendering(self) -> None:
        """The render parts start now (the coordinator counts their chunks as stored)."""
        self.render_started = self.clock()

    def rendering_parts(self, frames: int) -> None:
        """The render parts still running have rendered ``frames`` frames so far; written
        when ``min_interval_s`` passed and the count changed."""
        if frames == self.in_flight:
            return
        self.in_flight = frames
        now = self.clock()
        if self.written_at is None or now - self.written_at >= self.min_interval_s:
            self.write()

    def chunk_stored(self, frames: int, rendered: bool) -> None:
        """A render part stored its chunk of ``frames`` frames: it rendered them (counted
        in the frames per second) or found the chunk stored; written now."""
        self.chunks_done += 1
        self.frames_done += frames
        if rendered:
            self.rendered += frames
        self.write()

    @property
    def fps(self) -> float | None:
        """This attempt's rendered frames per second (None before the first)."""
        rendered = self.rendered + self.in_flight
        if self.render_started is None or rendered == 0:
            return None
        elapsed = self.clock() - self.render_started
        return rendered / elapsed if elapsed > 0 else None

    def record(self) -> JobProgress:
        """The progress as it stands."""
        fps = self.fps
        done = self.frames_done + self.in_flight
        left = max(0, self.frames_total - done)
        return JobProgress(
            frames_done=min(done, self.frames_total) if self.frames_total else 0,
            frames_total=self.frames_total,
            chunks_done=self.chunks_done,
            chunks_total=self.chunks_total,
            fps=None if fps is None else round(fps, 3),
            eta_seconds=None if fps is None else round(left / fps, 1),
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
        index = STEPS.index(self.step)
        share = record.frames_done / record.frames_total if record.frames_total else 0.0
        value = 100.0 * (share if self.step == "render_chunk" else index / len(STEPS))
        text = f"Stage {index + 1}/{len(STEPS)}: {self.step} (attempt {self.attempt})."
        if record.frames_total:
            text += f" {record.frames_done}/{record.frames_total} frames, "
            text += f"{record.chunks_done}/{record.chunks_total} chunks"
            if record.fps is not None and record.eta_seconds is not None:
                text += f", {record.fps:.1f} fps, ETA {record.eta_seconds:.0f} s"
            text += "."
        return value, text


class PartsProgress:
    """The coordinator's count of the frames its running render parts rendered (their
    ``part_progress_key`` records, read at most once per ``min_interval_s``), added to
    ``progress`` until each part's chunk is stored."""

    def __init__(
        self, progress: VideoProgress, job_id: str, attempt: int, frames: dict[str, int]
    ) -> None:
        self.progress, self.job_id, self.attempt, self.frames = progress, job_id, attempt, frames
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
        self.progress.rendering_parts(sum(self.seen.values()))

    def done(self, part: str, rendered: bool) -> None:
        """``part`` stored its chunk (``rendered``: by rendering it; its frame failures
        are added to ``failures``)."""
        record = self._record(part) if rendered else None
        for code, count in dict((record or {}).get("failures") or {}).items():
            self.failures[str(code)] = self.failures.get(str(code), 0) + int(count)
        self.seen.pop(part, None)
        self.progress.in_flight = sum(self.seen.values())
        self.progress.chunk_stored(self.frames[part], rendered=rendered)

    def _record(self, part: str) -> dict[str, Any] | None:
        key = part_progress_key(self.job_id, self.attempt, part)
        try:
            return dict(json.loads(read_from(self.progress.store, key)))
        except Exception:  # not written yet, or unreadable: progress never fails a job
            return None
