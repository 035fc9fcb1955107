"""Submit-time strictness: truncated images are a 422 before a job is queued; numbers
and booleans must be given as JSON numbers and booleans; JSON shape bounds."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from PIL import Image
from sqlalchemy.engine import Engine

from faceflow.client import FaceFlowAPIError, FaceFlowClient
from faceflow.testing.jobs import (
    auth,
    data_uri,
    job_body,
    jobs_of,
    make_user,
    source_jpeg,
    target_jpeg,
)
from tests.webapi.conftest import make_settings, serve
from webapi.bodies import check_json_shape
from webapi.config import Settings
from webapi.crud import NewUser
from webapi.errors import JsonTooComplex
from webapi.main import create_app


def _png(width: int = 64, height: int = 64) -> bytes:
    buffer = io.BytesIO()
    Image.effect_noise((width, height), 64).convert("RGB").save(buffer, format="PNG")
    return buffer.getvalue()


TRUNCATED = {
    "jpeg, half": (source_jpeg()[: len(source_jpeg()) // 2], "image/jpeg"),
    "jpeg, no end marker": (source_jpeg()[:-2], "image/jpeg"),
    "png, half": (_png()[: len(_png()) // 2], "image/png"),
    "png, no IEND": (_png()[:-12], "image/png"),
}


@pytest.mark.parametrize("case", sorted(TRUNCATED))
def test_truncated_images_are_422_at_submit(
    client: TestClient, engine: Engine, settings: Settings, case: str
) -> None:
    data, media_type = TRUNCATED[case]
    user = make_user(engine, settings)
    as_json = client.post(
        "/v1/jobs", json=job_body(target=data_uri(data, media_type)), headers=auth(user)
    )
    assert as_json.status_code == 422, as_json.text
    assert as_json.json()["error"]["code"] == "invalid_input"
    as_file = client.post(
        "/v1/jobs",
        headers=auth(user),
        files={"source": ("s.jpg", source_jpeg()), "target": ("t", data)},
    )
    assert as_file.status_code == 422, as_file.text
    assert jobs_of(engine) == []
    whole = client.post(
        "/v1/jobs", json=job_body(target=data_uri(_png(), "image/png")), headers=auth(user)
    )
    assert whole.status_code == 202, whole.text


@pytest.mark.parametrize(
    "overrides",
    [
        {"deadline_seconds": True},
        {"deadline_seconds": "120"},
        {"deadline_seconds": 120.0},
        {"queue_timeout_seconds": False},
        {"queue_timeout_seconds": "30"},
        {"options": {"face": True}},
        {"options": {"face": "1"}},
        {"options": {"identity_weight": "0.5"}},
        {"options": {"identity_weight": True}},
        {"options": {"color_transfer": 1}},
        {"options": {"color_transfer": "false"}},
        {"options": {"jpeg_quality": "90"}},
        {"options": {"sharpen": False}},
        {"options": {"min_identity": "0.5"}},
        {"options": {"mapping": [{"source": True, "target": 0}]}},
        {"options": {"mapping": [{"source": 0, "target": "0"}]}},
    ],
)
def test_numbers_and_booleans_are_strict(
    client: TestClient, engine: Engine, user: NewUser, overrides: dict[str, Any]
) -> None:
    response = client.post("/v1/jobs", json=job_body(**overrides), headers=auth(user))
    assert response.status_code == 422, response.text
    assert response.json()["error"]["code"] == "invalid_request"
    assert jobs_of(engine) == []


def test_json_numbers_of_the_right_kind_are_accepted(
    client: TestClient, engine: Engine, user: NewUser
) -> None:
    body = job_body(
        deadline_seconds=120,
        queue_timeout_seconds=30,
        options={"identity_weight": 1, "sharpen": 0, "color_transfer": False, "face": 0},
    )
    response = client.post("/v1/jobs", json=body, headers=auth(user))
    assert response.status_code == 202, response.text
    assert response.json()["options"]["identity_weight"] == 1.0
    # the multipart params field is held to the same rules
    refused = client.post(
        "/v1/jobs",
        headers=auth(user),
        data={"params": json.dumps({"deadline_seconds": True})},
        files={"source": ("s.jpg", source_jpeg()), "target": ("t.jpg", source_jpeg())},
    )
    assert refused.status_code == 422, refused.text


def test_strict_options_still_validate_flow_parameters() -> None:
    """The flows receive the options as JSON-decoded parameters (Prefect validates them
    against the flow's signature): ints where floats are expected, lists for tuples."""
    from flows.fuse import fuse_faces

    options = {
        "identity_weight": 1,
        "sharpen": 0,
        "color_transfer": True,
        "jpeg_quality": 90,
        "min_identity": 0.5,
        "mapping": [{"source": 0, "target": 1}, {"source": 1, "reference": 0}],
    }
    params = {
        "job_id": "j",
        "owner_id": "o",
        "source_key": "s",
        "target_key": "t",
        "deadline_at": "2030-01-01T00:00:00Z",
        "options": json.loads(json.dumps(options)),
    }
    validated = fuse_faces.validate_parameters(params)
    assert validated["options"].identity_weight == 1.0
    assert validated["options"].mapping[1].reference == 0
    with pytest.raises(Exception, match="identity_weight"):
        fuse_faces.validate_parameters({**params, "options": {"identity_weight": "1"}})


def test_json_shape_bounds() -> None:
    body = json.dumps(
        job_body(
            options={"mapping": [{"source": i % 8, "target": i} for i in range(16)]},
            callback_url='https://example.test/hook?a=[{"b":1}]',
        )
    ).encode()
    check_json_shape(body, max_items=1000, max_depth=16)
    # brackets, braces, commas and escaped quotes inside strings count for nothing
    check_json_shape(b'{"a": "[[[[{{{{,,,,\\"[[[["}', max_items=2, max_depth=1)
    with pytest.raises(JsonTooComplex, match="deeper"):
        check_json_shape(b'{"a": [[[]]]}', max_items=100, max_depth=3)
    with pytest.raises(JsonTooComplex, match="keys"):
        check_json_shape(b'{"a": 1, "b": 2, "c": 3}', max_items=4, max_depth=3)
    with pytest.raises(JsonTooComplex, match="keys"):
        check_json_shape(b"[" + b"0," * 10 + b"0]", max_items=5, max_depth=3)
    # an unterminated string is left to the parser (and costs one pass)
    check_json_shape(b'{"a": "' + b"x" * 1_000_000, max_items=5, max_depth=3)


def test_the_client_sends_files_as_multipart_past_the_json_limit(
    database_url: str, tmp_path: Path, engine: Engine
) -> None:
    """Two photos whose data: URIs exceed the JSON limit still go through the project's
    client: it sends files and bytes as multipart; data: URIs and URLs as JSON."""
    settings = make_settings(database_url, tmp_path, max_json_bytes=100_000)
    user = make_user(engine, settings)
    assert len(data_uri(source_jpeg())) + len(data_uri(target_jpeg())) > 100_000
    photo = tmp_path / "target.jpg"
    photo.write_bytes(target_jpeg())
    with serve(create_app(settings)) as url, FaceFlowClient(url, user.api_key) as client:
        job = client.submit(
            source_jpeg(), photo, options={"identity_weight": 0.7}, deadline_seconds=90
        )
        assert job["status"] == "queued" and job["options"]["identity_weight"] == 0.7
        mapped = client.submit(
            source_jpeg(),
            photo,
            extra_sources=[target_jpeg()],
            references=[source_jpeg()],
            options={"mapping": [{"source": 1, "reference": 0}, {"source": 0, "target": 1}]},
        )
        assert mapped["status"] == "queued"
        with pytest.raises(FaceFlowAPIError) as refused:  # as data: URIs: JSON, over its limit
            client.submit(data_uri(source_jpeg()), data_uri(target_jpeg()))
        assert refused.value.status == 413
    assert len(jobs_of(engine)) == 2
