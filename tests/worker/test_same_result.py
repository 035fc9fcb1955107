"""A ``fuse-faces`` job gives the same image through the warm worker as through Prefect's
process worker (same inputs, same code, same machine)."""

from __future__ import annotations

import io
import json
import uuid
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from prefect.settings import PREFECT_API_URL, temporary_settings

from blocks.settings import FusionSettings
from faceflow.supervisor import Service
from faceflow.testing.prefect import PREFECT
from flows.params import ResultRef, result_key, result_meta_key
from tests.worker.conftest import FUSE_ENTRYPOINT, REPO, Api, WarmWorker, fuse_params

pytestmark = [pytest.mark.prefect, pytest.mark.slow]


def _result(api: Api, job_id: str) -> tuple[np.ndarray, ResultRef]:
    storage = api.home.storage
    ref = ResultRef.model_validate_json((storage / result_meta_key(job_id, 1)).read_text())
    data = (storage / result_key(job_id, 1, "png")).read_bytes()
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB")), ref


def test_warm_worker_result_matches_the_process_worker(
    prefect_api: Api, warm_worker: WarmWorker, inputs: tuple[str, str], tmp_path: Path
) -> None:
    pool = f"proc-{uuid.uuid4().hex[:6]}"
    template = json.loads((REPO / "work_pools" / "gpu-process.json").read_text())
    prefect_api.create_pool(pool, "process", template)
    deployment_id = prefect_api.deploy("fuse-faces", FUSE_ENTRYPOINT, pool)
    worker = Service(
        "process-worker",
        [PREFECT, "worker", "start", "--pool", pool, "--type", "process", "--limit", "1"],
        log=tmp_path / "process-worker.log",
        env=prefect_api.server.env,
        cwd=REPO,
    )
    # Unmarked: each job's watermark carries its own id, and the pixels are compared.
    with temporary_settings(updates={PREFECT_API_URL: prefect_api.server.api_url}):
        FusionSettings(marking="off").save("same-result-unmarked", overwrite=True)
    unmarked = {"settings_block": "fusion-settings/same-result-unmarked"}
    params = fuse_params(*inputs, **unmarked)
    worker.start()
    try:
        run_id = prefect_api.create_run(deployment_id, params)
        assert prefect_api.wait_final(run_id, timeout=300)["state_type"] == "COMPLETED"
    finally:
        worker.stop(grace=15)
    warm_id, warm_job = warm_worker.submit_fuse(*inputs, **unmarked)
    assert warm_worker.api.wait_final(warm_id, timeout=180)["state_type"] == "COMPLETED"

    process_image, process_ref = _result(prefect_api, params["job_id"])
    warm_image, warm_ref = _result(prefect_api, warm_job)
    assert warm_image.shape == process_image.shape
    assert np.array_equal(warm_image, process_image)
    assert (warm_ref.width, warm_ref.height, warm_ref.faces_replaced) == (
        process_ref.width,
        process_ref.height,
        process_ref.faces_replaced,
    )
