"""Fuzz ``POST /v1/jobs`` with schemathesis against the app's own OpenAPI spec: never a 5xx.

Half the generated JSON bodies get two valid images, so the fuzzing reaches option
validation, storage and the job store, not only the input checks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hypothesis
import schemathesis
from hypothesis import HealthCheck
from sqlalchemy.engine import Engine

from faceflow.testing.jobs import auth, data_uri, make_user, source_jpeg, target_jpeg
from tests.webapi.conftest import make_settings
from webapi.main import create_app

EXAMPLES = 50


def test_fuzz_submit_never_answers_5xx(database_url: str, tmp_path: Path, engine: Engine) -> None:
    settings = make_settings(database_url, tmp_path, worker_slots=100_000)
    app = create_app(settings)
    user = make_user(engine, settings, quota=100_000)
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    operation = schema["/v1/jobs"]["POST"]
    valid = {"source": data_uri(source_jpeg()), "target": data_uri(target_jpeg())}
    seen: dict[int, int] = {}
    media: dict[str, int] = {}

    @hypothesis.given(case=operation.as_strategy(), with_images=hypothesis.strategies.booleans())
    @hypothesis.settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,  # the same cases every run: the deep-path check cannot flake
        suppress_health_check=list(HealthCheck),
    )
    def check(case: Any, with_images: bool) -> None:
        if with_images and isinstance(case.body, dict):
            case.body = {**case.body, **valid}
        media[case.media_type] = media.get(case.media_type, 0) + 1
        response = case.call(headers=auth(user))
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        assert response.status_code < 500, (response.status_code, response.text[:500])
        body = response.json()
        if response.status_code >= 400:
            assert set(body["error"]) == {"code", "message"}
        else:
            assert body["status"] == "queued"

    check()
    assert set(media) == {"application/json", "multipart/form-data"}, media
    assert sum(seen.values()) >= EXAMPLES
    assert any(code in seen for code in (200, 202)), seen  # the deep path was reached
