"""Helpers of the orchestration tests: job parameters, task-run counts over the Prefect API."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect.client.schemas.objects import TaskRun


def job_params(
    source_key: str, target_key: str, *, seconds: float = 120.0, **extra: Any
) -> dict[str, Any]:
    """Parameters of one job, as ``FuseFacesParams`` fields, deadline ``seconds`` from now."""
    return {
        "job_id": str(uuid.uuid4()),
        "owner_id": "user-1",
        "source_key": source_key,
        "target_key": target_key,
        "deadline_at": datetime.now(UTC) + timedelta(seconds=seconds),
        **extra,
    }


def task_runs(flow_run_id: UUID) -> dict[str, TaskRun]:
    """The task runs of a flow run by name (stage tasks are named after their stage)."""
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )
    return {run.name: run for run in runs}
