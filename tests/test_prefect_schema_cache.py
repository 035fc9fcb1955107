"""``faceflow.prefect_schema_cache``: Prefect's validator checks each schema against the
meta-schema once; what it accepts and refuses is unchanged."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prefect.utilities.schema_tools import ValidationError, is_valid_schema, validate
from prefect.utilities.schema_tools import validation as prefect_validation

from faceflow import prefect_schema_cache
from faceflow.prefect_schema_cache import SchemaCheckCache

SCHEMA = {
    "type": "object",
    "properties": {
        "grace": {"type": "number", "minimum": 0},
        "name": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None},
    },
    "required": ["grace"],
}


@pytest.fixture
def cache() -> Iterator[SchemaCheckCache]:
    """The cache installed in this process, Prefect's own check restored afterwards."""
    validator = prefect_validation._VALIDATOR
    original = validator.__dict__["check_schema"]
    installed = prefect_schema_cache.install({})
    assert installed is not None
    try:
        yield installed
    finally:
        validator.check_schema = original


def test_a_schema_is_checked_against_the_meta_schema_once(cache: SchemaCheckCache) -> None:
    for _ in range(3):
        is_valid_schema(SCHEMA, preprocess=False)
        validate({"grace": 2.0}, SCHEMA, raise_on_error=True, preprocess=False)
    assert cache.checks == 2  # once per way Prefect asks: with its format checker, without
    changed = {**SCHEMA, "required": ["grace", "name"]}
    validate({"grace": 2.0, "name": "x"}, changed, raise_on_error=True, preprocess=False)
    validate({"grace": 2.0, "name": "x"}, changed, raise_on_error=True, preprocess=False)
    assert cache.checks == 3  # another schema is checked, once
    assert prefect_schema_cache.install({}) is cache  # installed once per process


def test_what_is_refused_stays_refused(cache: SchemaCheckCache) -> None:
    validate({"grace": 1}, SCHEMA, raise_on_error=True, preprocess=False)
    for _ in range(2):  # a bad instance of a remembered schema
        with pytest.raises(ValidationError, match="grace"):
            validate({"grace": -1}, SCHEMA, raise_on_error=True, preprocess=False)
    invalid = {"type": "object", "properties": {"grace": {"type": 5}}}
    for _ in range(2):  # an invalid schema is checked, and refused, every time
        with pytest.raises(ValueError, match="Invalid schema"):
            is_valid_schema(invalid, preprocess=False)
    assert cache.checks == 3


def test_it_forgets_past_its_limit() -> None:
    calls: list[object] = []
    cache = SchemaCheckCache(lambda cls, schema, **_: calls.append(schema), limit=2)
    for n in (1, 2, 1, 3, 1):
        cache(object, {"maxLength": n})
    assert calls == [{"maxLength": 1}, {"maxLength": 2}, {"maxLength": 3}, {"maxLength": 1}]


def test_switched_off_prefect_checks_as_it_does() -> None:
    original = prefect_validation._VALIDATOR.__dict__["check_schema"]
    assert prefect_schema_cache.install({prefect_schema_cache.ENV: "false"}) is None
    assert prefect_validation._VALIDATOR.__dict__["check_schema"] is original
