"""``flows.binding``: what the relay signs is what the flow checks, field by field, across
the JSON round trip the parameters make through Prefect; key rotation and production."""

from __future__ import annotations

import json
import stat
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from flows.binding import (
    DEV_RUN_SIGNING_KEY,
    PREVIOUS_KEYS_ENV,
    SIGNING_KEY_ENV,
    sign,
    signed_parameters,
    verify,
    worker_keys,
)
from flows.params import FuseBatchParams, FuseFacesParams, JobAttempt
from tasks.options import FusionOptions
from webapi.prefect_api import sent_parameters

KEY = "current-key"


def bound(job: JobAttempt, key: str, **blocks: str) -> Any:
    """``job`` with its binding under ``key``, as the relay sends it."""
    return job.model_copy(update={"binding": sign(job, key, **blocks)})


def _params(**fields: Any) -> FuseFacesParams:
    values: dict[str, Any] = {
        "job_id": "6a1f2c1e-0000-4000-8000-000000000001",
        "owner_id": "owner-a",
        "source_key": "inputs/aa/a.jpg",
        "target_key": "inputs/bb/b.jpg",
        "extra_source_keys": ["inputs/cc/c.jpg"],
        "reference_keys": ["inputs/dd/d.jpg"],
        "options": FusionOptions.model_validate({"identity_weight": 0.7, "face": "largest"}),
        "deadline_at": datetime(2026, 12, 4, 20, 0, 0, 123456, tzinfo=UTC),
        "attempt": 1,
        **fields,
    }
    return FuseFacesParams(**values)


def _as_received(params: FuseFacesParams) -> FuseFacesParams:
    """The parameters as the flow gets them: sent as JSON, parsed again."""
    return FuseFacesParams.model_validate(json.loads(json.dumps(sent_parameters(params))))


def test_a_binding_survives_the_trip_through_prefect() -> None:
    sent = bound(_params(), KEY)
    assert sent.binding is not None and sent.binding.startswith("v2=")
    assert verify(_as_received(sent), [KEY])
    # A deadline in another zone names the same instant: the same binding.
    local = sent.model_copy(
        update={"deadline_at": sent.deadline_at.astimezone(timezone_plus_two())}
    )
    assert verify(local, [KEY])


def timezone_plus_two() -> Any:
    from datetime import timezone

    return timezone(timedelta(hours=2))


@pytest.mark.parametrize(
    "change",
    [
        {"job_id": "6a1f2c1e-0000-4000-8000-000000000002"},
        {"owner_id": "owner-b"},
        {"source_key": "inputs/ee/someone-elses.jpg"},
        {"target_key": "inputs/ee/someone-elses.jpg"},
        {"extra_source_keys": ["inputs/ee/someone-elses.jpg"]},
        {"reference_keys": []},
        {"options": FusionOptions.model_validate({"identity_weight": 0.7})},
        {"options": FusionOptions.model_validate({"identity_weight": 0.7, "face": "all"})},
        {"deadline_at": datetime(2026, 12, 4, 20, 0, 1, 123456, tzinfo=UTC)},
        {"attempt": 2},
        {"storage_block": "local-file-system/elsewhere"},
        {"settings_block": "fusion-settings/no-moderation"},
        {"signing_block": "secret/someone-elses-certificate"},
    ],
)
def test_any_bound_field_changed_breaks_the_binding(change: dict[str, Any]) -> None:
    sent = bound(_params(), KEY)
    forged = _as_received(sent).model_copy(update=change)
    assert not verify(forged, [KEY], **_blocks(forged))


def _blocks(params: FuseFacesParams) -> dict[str, str]:
    return {
        "storage_block": params.storage_block,
        "settings_block": params.settings_block,
        "signing_block": params.signing_block,
    }


def test_a_flow_cannot_be_made_to_sign_with_another_block() -> None:
    other = "secret/someone-elses-certificate"
    sent = _as_received(bound(_params(signing_block=other), KEY, signing_block=other))
    assert verify(sent, [KEY], **_blocks(sent))
    # The same binding offered for the default block (or the default's for another) fails.
    assert not verify(sent, [KEY])
    default = _as_received(bound(_params(), KEY))
    assert not verify(default, [KEY], signing_block=other)


def test_a_v1_binding_holds_only_for_the_default_signing_block() -> None:
    params = _params()
    legacy = params.model_copy(update={"binding": sign(params, KEY, version="v1")})
    assert legacy.binding is not None and legacy.binding.startswith("v1=")
    assert verify(_as_received(legacy), [KEY])
    assert not verify(legacy, [KEY], signing_block="secret/someone-elses-certificate")
    changed = legacy.model_copy(update={"owner_id": "owner-b"})
    assert not verify(changed, [KEY])
    unknown = legacy.model_copy(update={"binding": "v9=" + legacy.binding[3:]})
    assert not verify(unknown, [KEY])


def test_the_attempt_a_flow_reads_from_its_parameters_keeps_the_binding() -> None:
    """``JobAttempt.of_run(locals())`` at a flow's start: the job fields only (the blocks,
    ``chunk_s`` and later locals left out), a ``None`` list or options as the default."""
    received = _as_received(bound(_params(), KEY))
    run_locals = {**dict(received), "chunk_s": None, "signing_block": "signing/x"}
    spec = JobAttempt.of_run(run_locals)
    assert type(spec) is JobAttempt and verify(spec, [KEY])
    assert spec == JobAttempt.model_validate(
        received.model_dump(exclude={"storage_block", "settings_block", "signing_block"})
    )
    bare = JobAttempt.of_run(
        {**dict(received), "extra_source_keys": None, "reference_keys": None, "options": None}
    )
    assert (bare.extra_source_keys, bare.reference_keys) == ([], [])
    assert bare.options == FusionOptions.model_validate({})


def test_no_binding_or_another_key_is_refused() -> None:
    assert not verify(_params(), [KEY])
    assert not verify(bound(_params(), "someone-elses-key"), [KEY])
    assert not verify(bound(_params(), KEY), [])


def test_each_job_of_a_batch_carries_its_own_binding() -> None:
    jobs = [
        bound(
            JobAttempt(
                **_params(job_id=f"job-{n}").model_dump(
                    exclude={"storage_block", "settings_block", "signing_block"}
                )
            ),
            KEY,
        )
        for n in range(2)
    ]
    batch = FuseBatchParams(jobs=jobs, deadline_at=max(j.deadline_at for j in jobs))
    received = FuseBatchParams.model_validate_json(batch.model_dump_json())
    assert all(verify(job, [KEY]) for job in received.jobs)
    swapped = received.jobs[0].model_copy(update={"binding": received.jobs[1].binding})
    assert not verify(swapped, [KEY])


def test_signed_parameters_match_what_the_relay_signs() -> None:
    blocks = {"settings_block": "fusion-settings/test", "signing_block": "secret/test"}
    params = _params(**blocks)
    raw = sent_parameters(params)  # options as the client set them
    assert signed_parameters(raw, KEY)["binding"] == bound(params, KEY, **blocks).binding


def test_rotation_accepts_the_current_and_previous_keys() -> None:
    env = {SIGNING_KEY_ENV: "new", PREVIOUS_KEYS_ENV: " old , older,"}
    keys = worker_keys(env)
    assert keys == ["new", "old", "older"]
    assert verify(bound(_params(), "old"), keys)
    assert not verify(bound(_params(), "retired"), keys)


def test_the_development_key_is_refused_in_production() -> None:
    assert worker_keys({}) == [DEV_RUN_SIGNING_KEY]
    assert worker_keys({"FACEFLOW_ENVIRONMENT": "production"}) == []
    production = {"FACEFLOW_ENVIRONMENT": "production", SIGNING_KEY_ENV: DEV_RUN_SIGNING_KEY}
    assert worker_keys(production) == []
    # The relay's side: tests/webapi/test_app.py::test_production_refuses_development_secrets.


def test_the_local_stack_makes_one_key_kept_private(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from faceflow.stack import StackConfig

    monkeypatch.delenv(SIGNING_KEY_ENV, raising=False)
    config = StackConfig(home=tmp_path)
    key = config.run_signing_env()[SIGNING_KEY_ENV]
    assert len(key) >= 40 and key != DEV_RUN_SIGNING_KEY
    assert stat.S_IMODE((tmp_path / "run-signing.key").stat().st_mode) == 0o600
    assert StackConfig(home=tmp_path).run_signing_env() == {SIGNING_KEY_ENV: key}  # kept
    assert SIGNING_KEY_ENV not in config.env()  # not every part gets it (Prefect server)
    monkeypatch.setenv(SIGNING_KEY_ENV, "operator-key")
    assert config.run_signing_env() == {SIGNING_KEY_ENV: "operator-key"}
