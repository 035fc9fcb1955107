"""``bench/job_work.py``, the work the benches' bare loop and Celery task compare FaceFlow's
runs with: a real job on stored inputs does what a run does for it (reads the inputs from
storage, marks the result as the settings say, writes the result and its sidecar)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.job_work import JobWork, bench_settings
from blocks.settings import FusionSettings
from blocks.signing import dev_chain
from faceflow.testing.inputs import put_input
from flows.params import ResultRef
from tasks import watermark
from tasks.provenance import dev_root_path, inspect_file
from tests.samples import astronaut_jpeg_bytes, grace_hopper_jpeg_bytes


@pytest.fixture
def stored(tmp_path: Path) -> tuple[Path, str, str]:
    """A FaceFlow home whose local storage holds the two sample inputs; (home, keys)."""
    home = tmp_path / "faceflow"
    storage = home / "storage"
    keys = [
        put_input(storage, data) for data in (astronaut_jpeg_bytes(), grace_hopper_jpeg_bytes())
    ]
    return home, keys[0], keys[1]


def test_a_job_is_read_marked_and_written_as_a_run_does(stored: tuple[Path, str, str]) -> None:
    home, source_key, target_key = stored
    work = JobWork.local(home, bench_settings(gpu_shaped=False))
    ref = work.run(source_key, target_key)

    assert ref.marks == ["c2pa", "watermark"]
    job_id = ref.key.split("/")[1]  # results/<job id>/attempt-1.<ext>
    sidecar = home / "storage" / "results" / job_id / "attempt-1.json"
    assert ResultRef.model_validate_json(sidecar.read_text()) == ref
    found = inspect_file((home / "storage" / ref.key).read_bytes(), dev_root_path(home).read_text())
    assert found.manifest.valid and found.manifest.trusted and found.manifest.ours
    assert found.watermark == watermark.payload_for(job_id)
    assert dev_chain(home).credentials == work.ctx.marker.credentials  # type: ignore[union-attr]

    again = work.run(source_key, target_key)  # a new job id each time: nothing overwritten
    assert again.key != ref.key and (home / "storage" / ref.key).is_file()


def test_marking_off_leaves_the_result_unmarked(stored: tuple[Path, str, str]) -> None:
    home, source_key, target_key = stored
    work = JobWork.local(home, FusionSettings(marking="off"))
    assert work.ctx.marker is None
    ref = work.run(source_key, target_key)
    assert ref.marks == []
    assert (home / "storage" / ref.key).is_file()
