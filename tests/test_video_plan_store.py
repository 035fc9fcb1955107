"""The stored video plan (``flows.video_steps.save_plan``/``load_plan``): what the
analysis part writes and the render parts and the coordinator read back. Storage is shared
with other writers, so a plan is read only when its HMAC matches a run-signing key, and
even then it may name FaceFlow's classes and numpy's arrays only."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest
from prefect.filesystems import LocalFileSystem

from blocks.storage import read_from, write_to
from flows.binding import PREVIOUS_KEYS_ENV, SIGNING_KEY_ENV
from flows.video_steps import PLAN_MAGIC, StoredPlan, load_plan, plan_mac, save_plan
from tasks.errors import InvalidInput, RunBindingInvalid
from tasks.video import Planned, Probed
from tasks.video_io import probe_video
from tasks.video_plan import Chunk, FacePlan
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
    store = LocalFileSystem(basepath=str(tmp_path))
    stored = a_plan(videos)
    save_plan(store, KEY, stored)
    back = load_plan(store, KEY)
    assert back.digest == "digest" and back.probed.info == stored.probed.info
    assert np.array_equal(back.probed.images[0], stored.probed.images[0])
    assert back.planned.chunks == [Chunk(0, 0, 2)]


def test_a_plan_written_without_the_key_is_refused(videos: Videos, tmp_path: Path) -> None:
    store = LocalFileSystem(basepath=str(tmp_path))
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
    store = LocalFileSystem(basepath=str(tmp_path))
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


def test_no_plan_is_stored_without_a_run_signing_key(
    videos: Videos, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FACEFLOW_ENVIRONMENT", "production")
    monkeypatch.delenv(SIGNING_KEY_ENV, raising=False)
    monkeypatch.delenv(PREVIOUS_KEYS_ENV, raising=False)
    with pytest.raises(RunBindingInvalid):
        save_plan(LocalFileSystem(basepath=str(tmp_path)), KEY, a_plan(videos))
