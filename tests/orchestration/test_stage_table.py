"""A stage added to ``tasks.stages.PIPELINE`` runs in both flows (inline in a single job's
run, as its own task run in a batch's, by default), with its own timing in each job's
result: the flows drive the table, they do not list stages."""

from __future__ import annotations

import pytest

from flows.batch import fuse_batch
from flows.fuse import fuse_faces
from flows.params import ResultRef
from tests.orchestration.conftest import Home
from tests.orchestration.helpers import (
    batch_outcomes,
    job_params,
    stages_seen,
    stored_result,
    task_runs,
)
from tests.samples import astronaut_jpeg_bytes, grace_hopper_jpeg_bytes
from tests.test_stages import marking_stage, with_stage


def test_a_stage_added_to_the_table_runs_in_both_flows(
    prefect_harness: Home, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[str] = []
    with_stage(monkeypatch, marking_stage(seen), after="postprocess")
    source = prefect_harness.put_input(astronaut_jpeg_bytes())
    target = prefect_harness.put_input(grace_hopper_jpeg_bytes())

    single = job_params(source, target)
    state = fuse_faces(**single, return_state=True)
    assert state.is_completed(), state.message
    assert "mark" in ResultRef.model_validate(state.result()).timings_ms
    assert stages_seen(state.state_details.flow_run_id, inline=True)["mark"] == (1, "Completed")

    jobs = [job_params(source, target, attempt=1) for _ in range(2)]
    state = fuse_batch(jobs=jobs, deadline_at=jobs[0]["deadline_at"], return_state=True)
    assert state.is_completed(), state.message
    assert set(batch_outcomes(state).values()) == {"succeeded"}
    # stages inline by default (FusionSettings.stage_task_runs), in batches too
    assert stages_seen(state.state_details.flow_run_id, inline=True)["mark"] == (1, "Completed")
    assert task_runs(state.state_details.flow_run_id) == {}
    for job in jobs:
        assert "mark" in stored_result(job["job_id"]).timings_ms
    assert seen == ["png"] * 3
