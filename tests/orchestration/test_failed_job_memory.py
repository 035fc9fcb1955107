"""A job that fails after decoding its images leaves none of them behind in a warm worker
(issue 22: memory after a large job).

The failed stage's exception carried a traceback whose frames held the job's ``Work`` and
its decoded images; the flow run's final Prefect state kept that exception, and Prefect's
engine context (captured by its log worker thread) kept the state past the run: a warm
child kept one failed job's images until the next one replaced them (≈ 300 MB after an
80 MP job). The run here goes through the warm child's own code (``WarmChild.run``:
``run_flow`` on an existing flow run) against a real Prefect server.
"""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Iterator
from multiprocessing import Pipe
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client

from faceflow.samples import flat_png
from faceflow.worker.child import WarmChild
from faceflow.worker.protocol import ChildSpec, RunRequest, RunStarted
from flows.fuse import fuse_faces
from tasks.errors import NoFaceFound, drop_frames
from tasks.stages import Work
from tests.orchestration.conftest import Home
from tests.orchestration.helpers import job_params

REPO = Path(__file__).resolve().parents[2]
ENTRYPOINT = "flows/fuse.py:fuse_faces"
WIDTH, HEIGHT = 4000, 3000  # 12 MP: 36 MB as RGB, from a PNG of a few KB
DECODED = WIDTH * HEIGHT * 3


@pytest.fixture
def no_cyclic_gc() -> Iterator[None]:
    """The cyclic collector off: what is kept must be freed by reference counts, as in a
    warm child, where a full collection of the run's cycles may come much later."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _alive_works() -> int:
    return sum(1 for o in gc.get_objects() if isinstance(o, Work))


def test_a_failed_large_job_keeps_none_of_its_images(
    prefect_harness: Home, no_cyclic_gc: None
) -> None:
    flat = prefect_harness.put_input(flat_png(WIDTH, HEIGHT), "png")  # no face in it
    params = job_params(flat, flat)
    parent, conn = Pipe()
    child = WarmChild(conn, ChildSpec(index=0, working_dir=str(REPO)))
    with get_client(sync_client=True) as client:
        flow_run = client.create_flow_run(fuse_faces, parameters=params, name=params["job_id"])
        child.run(RunRequest(str(flow_run.id), ENTRYPOINT, working_dir=str(REPO)), client)
        child.load_flow(ENTRYPOINT, str(REPO))  # the flow loaded before measuring
        flow_run = client.create_flow_run(
            fuse_faces, parameters=job_params(flat, flat), name="second"
        )
        before_works = _alive_works()
        tracemalloc.start()
        try:
            before, _ = tracemalloc.get_traced_memory()
            finished = child.run(
                RunRequest(str(flow_run.id), ENTRYPOINT, working_dir=str(REPO)), client
            )
            after, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert isinstance(parent.recv(), RunStarted)
    assert finished.state_type == "FAILED", finished
    assert (finished.state_message or "").startswith("[no_face_found]"), finished
    assert peak - before > 2 * DECODED  # both images were decoded in the run
    # Neither image (nor the job's Work) outlives the run: what stays is Prefect's and
    # the logs' bookkeeping, well under one image.
    assert after - before < DECODED // 4, f"{(after - before) / 1e6:.0f} MB kept"
    assert _alive_works() == before_works == 0


def test_drop_frames_frees_what_the_frames_held_and_keeps_the_error() -> None:
    """The error keeps its code and message; the frames it was raised through, and those
    of the exception it chains, let go of their locals."""
    import weakref

    import numpy as np

    def fail(image: np.ndarray) -> None:
        try:
            raise ValueError(image.shape)
        except ValueError as exc:
            raise NoFaceFound("No face.") from exc

    image = np.zeros((10, 10, 3), np.uint8)
    held = weakref.ref(image)
    try:
        fail(image)
    except NoFaceFound as caught:
        error = caught
    del image
    assert held() is not None  # the traceback's frames hold it
    assert drop_frames(error) is error
    assert held() is None
    assert error.__traceback__ is None and error.__cause__ is not None
    assert error.__cause__.__traceback__ is None
    assert str(error) == "[no_face_found] No face." and error.permanent
