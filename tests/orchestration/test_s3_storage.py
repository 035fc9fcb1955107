"""S3 result storage (prefect-aws S3Bucket) against a moto server on 127.0.0.1."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import pytest
from PIL import Image

from blocks.storage import load_storage, location_of, read_bytes, s3_storage, write_bytes
from faceflow.testing.s3 import s3_client
from flows.fuse import fuse_faces
from flows.params import ResultRef, input_key, result_meta_key
from tasks.errors import InvalidInput
from tests.orchestration.conftest import S3_BUCKET as BUCKET
from tests.orchestration.conftest import Home
from tests.orchestration.helpers import check_file_transfer, job_params
from tests.samples import astronaut_jpeg_bytes, grace_hopper_jpeg_bytes

FOLDER = "prod"
BLOCK = "s3-bucket/faceflow-s3-test"


@pytest.fixture(scope="module")
def s3_block(moto: str, prefect_harness: Home) -> str:
    s3_storage(
        BUCKET,
        bucket_folder=FOLDER,
        endpoint_url=moto,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    ).save(BLOCK.split("/", 1)[1], overwrite=True)
    return BLOCK


def _object(moto: str, key: str) -> bytes:
    body = s3_client(moto).get_object(Bucket=BUCKET, Key=f"{FOLDER}/{key}")["Body"]
    return bytes(body.read())


def test_s3_bytes_round_trip(moto: str, s3_block: str) -> None:
    write_bytes(s3_block, "results/j/attempt-1.png", b"result")
    assert read_bytes(s3_block, "results/j/attempt-1.png") == b"result"
    assert _object(moto, "results/j/attempt-1.png") == b"result"
    location = location_of(load_storage(s3_block), "results/j/attempt-1.png")
    assert location == f"s3://{BUCKET}/{FOLDER}/results/j/attempt-1.png"
    with pytest.raises(InvalidInput):
        read_bytes(s3_block, "inputs/00/missing.jpg")


def test_s3_moves_files_by_path(moto: str, s3_block: str, tmp_path: Path) -> None:
    check_file_transfer(s3_block, tmp_path)


def test_flow_reads_inputs_and_writes_results_on_s3(moto: str, s3_block: str) -> None:
    keys = []
    for data in (astronaut_jpeg_bytes(), grace_hopper_jpeg_bytes()):
        key = input_key(hashlib.sha256(data).hexdigest(), "jpg")
        write_bytes(s3_block, key, data)
        keys.append(key)
    params = job_params(*keys, storage_block=s3_block, attempt=2)
    state = fuse_faces(**params, return_state=True)
    assert state.is_completed(), state.message
    ref = ResultRef.model_validate(state.result())
    assert ref.key == f"results/{params['job_id']}/attempt-2.png"
    assert Image.open(io.BytesIO(_object(moto, ref.key))).format == "PNG"
    sidecar = ResultRef.model_validate_json(_object(moto, result_meta_key(params["job_id"], 2)))
    assert sidecar == ref
