"""The stored video plan (``flows.video_store.save_plan``/``load_plan``): what the
analysis part writes and the render parts and the coordinator read back. Storage is shared
with other writers, so a plan is read only when its HMAC matches a run-signing key, and
even then it may name FaceFlow's classes and numpy's arrays only."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from blocks.settings import FusionSettings
from blocks.storage import read_from, write_to
from flows.binding import PREVIOUS_KEYS_ENV, SIGNING_KEY_ENV
from flows.video_store import PLAN_MAGIC, StoredPlan, load_plan, plan_mac, save_plan
from tasks.errors import InvalidInput, RunBindingInvalid, TransientError
from tasks.types import Box, Face
from tasks.video import Planned, Probed, Source, track_reports
from tasks.video_io import probe_video
from tasks.video_plan import Chunk, FacePlan, Swap, Track
from tests.stores import local_store
from tests.videos import Videos

KEY = "results/job-1/attempt-1.plan.pkl"


def a_plan(videos: Videos) -> StoredPlan:
    info = probe_video(videos.story)  # a pydantic model with a Fraction
    image = np.arange(4 * 4 * 3, dtype=np.uint8).reshape(4, 4, 3)
    probed = Probed(info=info, pts=[0, 512], images=[image], samples=[0], flags=[])
    plan = FacePlan(frames=[[], []], tracks=[], cuts=[0])
    planned = Planned(sources=[], cuts=[0], chunks=[Chunk(0, 0, 2)], plan=plan)
    return StoredPlan("digest", probed, planned)


def test_a_plan_comes_back_as_it_was_stored(videos: Videos, tmp_path: Path) -> None:
    store = local_store(tmp_path)
    stored = a_plan(videos)
    save_plan(store, KEY, stored)
    back = load_plan(store, KEY)
    assert back.digest == "digest" and back.probed.info == stored.probed.info
    assert np.array_equal(back.probed.images[0], stored.probed.images[0])
    assert back.planned is not None and back.planned.chunks == [Chunk(0, 0, 2)]


def test_a_plan_written_without_the_key_is_refused(videos: Videos, tmp_path: Path) -> None:
    store = local_store(tmp_path)
    body = pickle.dumps(a_plan(videos))
    write_to(store, KEY, body)  # a bare pickle
    with pytest.raises(InvalidInput):
        load_plan(store, KEY)
    write_to(store, KEY, PLAN_MAGIC + plan_mac("another key", body) + body)
    with pytest.raises(InvalidInput):
        load_plan(store, KEY)
    save_plan(store, KEY, a_plan(videos))
    data = bytearray(read_from(store, KEY))
    data[-1] ^= 1  # one bit of the pickle changed after signing
    write_to(store, KEY, bytes(data))
    with pytest.raises(InvalidInput):
        load_plan(store, KEY)


def test_a_signed_plan_naming_a_function_is_not_unpickled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defence in depth: a leaked key still does not run code through the plan."""
    store = local_store(tmp_path)
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, (f"touch {marker}",))

    body = pickle.dumps(Evil())
    key = "the-key"
    monkeypatch.setenv(SIGNING_KEY_ENV, key)
    write_to(store, KEY, PLAN_MAGIC + plan_mac(key, body) + body)
    with pytest.raises(InvalidInput, match="may not name"):
        load_plan(store, KEY)
    assert not marker.exists()


def test_a_signed_plan_from_another_version_is_a_transient_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plan stored before a deploy that moved or renamed its classes is ours (signed) but
    cannot be read: the attempt fails transiently, so the relay runs a new attempt that
    plans again, rather than failing the job for good or as an internal error."""
    store = local_store(tmp_path)
    key = "the-key"
    monkeypatch.setenv(SIGNING_KEY_ENV, key)
    body = pickle.dumps(Chunk(0, 0, 2)).replace(b"tasks.video_plan", b"tasks.video_gone")
    write_to(store, KEY, PLAN_MAGIC + plan_mac(key, body) + body)
    with pytest.raises(TransientError, match="another version"):
        load_plan(store, KEY)


def test_no_plan_is_stored_without_a_run_signing_key(
    videos: Videos, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FACEFLOW_ENVIRONMENT", "production")
    monkeypatch.delenv(SIGNING_KEY_ENV, raising=False)
    monkeypatch.delenv(PREVIOUS_KEYS_ENV, raising=False)
    with pytest.raises(RunBindingInvalid):
        save_plan(local_store(tmp_path), KEY, a_plan(videos))


MODELS = (
    "torch",
    "onnxruntime",
    "tasks.models",
    "tasks.pipeline",
    "tasks.stages",
    "tasks.identity",
    "tasks.detect",
    "tasks.video",
    "flows.run",
    "flows.video_steps",
)
"""What the control pool's coordinator must not import: a model runtime, the pipeline, the
model cache, the video steps that run models."""


def test_the_coordinator_imports_and_reads_its_plan_without_a_model(
    videos: Videos, tmp_path: Path
) -> None:
    """``fuse-video`` runs on the control pool (no GPU, no model): importing it, reading
    saved settings and the plan its parts stored (unpickling a face plan with a track, a
    swap and the sources' faces) and making the report per track import no model."""
    store = local_store(tmp_path)
    face = Face(Box(1, 1, 3, 3), 0.9, np.zeros((5, 2), np.float32))
    track = Track(1, detected={0: face}, faces={0: face, 1: face}, filled={1})
    plan = FacePlan(frames=[[Swap(1, face)], [Swap(1, face)]], tracks=[track], cuts=[0])
    stored = a_plan(videos)
    assert stored.planned is not None
    stored.probed.source_faces = [Source(stored.probed.images[0], face)]
    stored = StoredPlan(
        "digest",
        stored.probed,
        Planned(stored.probed.source_faces, [0], [Chunk(0, 0, 2)], plan),
        ranges=[(0, 2)],
        analysis_keys=["video-analysis/a.npz"],
        chunk_keys=["video-chunks/c.mp4"],
    )
    save_plan(store, KEY, stored)
    settings = tmp_path / "settings.json"
    settings.write_text(FusionSettings().model_dump_json())  # as the server keeps the block
    code = f"""
import sys
from pathlib import Path
from prefect.filesystems import LocalFileSystem
import flows.video
from blocks.settings import FusionSettings
from flows.video_store import load_plan
from tasks.options import FusionOptions
from tasks.video_records import track_reports
settings = FusionSettings.model_validate_json(Path({str(settings)!r}).read_text())
settings.apply_defaults(FusionOptions())
plan = load_plan(LocalFileSystem(basepath={str(tmp_path)!r}), {KEY!r})
print(track_reports(plan.planned.plan, {{1: [0.5]}}))
bad = [m for m in {MODELS!r} if m in sys.modules]
print("imported:", bad)
sys.exit(1 if bad else 0)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert str(track_reports(plan, {1: [0.5]})[0]) in proc.stdout  # the plan came back whole
