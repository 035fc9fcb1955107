"""A video's frames through the analysis pass, the face plan and the render pass, in
memory (no container): the render pass runs the table's own frame stages."""

from __future__ import annotations

from typing import Any

import cv2
import numpy as np
import pytest

from tasks import pipeline
from tasks.options import FusionOptions
from tasks.pipeline import PipelineContext
from tasks.video import Analysis, FrameRunner, analyse, render, sources_of
from tasks.video_plan import plan_faces, scene_cuts
from tests import samples

CTX = PipelineContext()


def pan_frames(n: int = 12) -> list[np.ndarray]:
    """A slow pan and zoom over grace_hopper (320x240), then two frames without a face."""
    photo = samples.grace_hopper_rgb()
    frames = []
    for i in range(n):
        x, y, w = 60 + 3 * i, 20 + 2 * i, 380 - 4 * i
        crop = photo[y : y + w * 3 // 4, x : x + w]
        frames.append(np.ascontiguousarray(cv2.resize(crop, (320, 240))))
    blank = np.full((240, 320, 3), 90, np.uint8)
    return [*frames, blank, blank]


def test_every_frame_with_the_face_is_fused_by_the_table_stages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    frames = pan_frames()
    options = FusionOptions()
    sources = sources_of([samples.astronaut_rgb()], options, CTX)
    found = analyse(frames, options, CTX, Analysis())
    assert all(found.faces[:12]) and found.faces[12:] == [[], []]
    cuts = scene_cuts(found.signatures)
    assert cuts == [12]
    plan = plan_faces(found.faces, cuts, options.face)

    fused_calls: list[int] = []
    real_fuse = pipeline.fuse_stage

    def counting_fuse(*args: Any, **kwargs: Any) -> Any:
        fused_calls.append(1)
        return real_fuse(*args, **kwargs)

    monkeypatch.setattr(pipeline, "fuse_stage", counting_fuse)
    runner = FrameRunner(CTX)
    out = list(render(enumerate(frames), plan, sources, options, CTX, runner))
    assert [i for i, _ in out] == list(range(len(frames)))
    assert len(fused_calls) == 12 and runner.failures == {}
    for (index, image), frame in zip(out, frames, strict=True):
        changed = np.abs(image.astype(int) - frame.astype(int)).mean()
        if index < 12:
            assert changed > 0.3, index  # the face is replaced in every frame that has it
        else:
            assert changed == 0.0  # no face: the frame passes unchanged


def test_a_frame_a_stage_fails_on_keeps_its_pixels(monkeypatch: pytest.MonkeyPatch) -> None:
    frames = pan_frames(4)[:4]
    options = FusionOptions()
    sources = sources_of([samples.astronaut_rgb()], options, CTX)
    plan = plan_faces(analyse(frames, options, CTX, Analysis()).faces, [], options.face)
    from tasks.errors import InvalidInput

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise InvalidInput("degenerate face")

    monkeypatch.setattr(pipeline, "align_stage", broken)
    runner = FrameRunner(CTX)
    out = list(render(enumerate(frames), plan, sources, options, CTX, runner))
    assert runner.failures == {"invalid_input": 4}
    assert all(np.array_equal(image, frame) for (_, image), frame in zip(out, frames, strict=True))
