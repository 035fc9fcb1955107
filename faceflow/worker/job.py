"""Job configuration and variables of the ``faceflow-gpu`` work pool (one set of fields).

The pool's base job template (``work_pools/faceflow-gpu.json``) is generated from these
classes; deployments and single runs override the variables through ``job_variables``.
"""

from __future__ import annotations

import contextlib
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefect.workers.base import BaseJobConfiguration, BaseVariables
from pydantic import BaseModel, Field, field_validator

if TYPE_CHECKING:
    from uuid import UUID

    from prefect.client.schemas.objects import Flow as APIFlow
    from prefect.client.schemas.objects import FlowRun, WorkPool
    from prefect.client.schemas.responses import DeploymentResponse

SET_WORKING_DIRECTORY = "prefect.deployments.steps.set_working_directory"


class RunFields(BaseModel):
    """The per-run settings a warm child needs beyond Prefect's (env, name, labels)."""

    working_dir: Path | None = Field(
        default=None,
        title="Working Directory",
        description="Directory the flow entrypoint is imported from (default: the worker's).",
    )
    entrypoint: str | None = Field(
        default=None, description="Flow entrypoint; default: the deployment's entrypoint."
    )
    deadline_parameter: str = Field(
        default="deadline_at", description="Flow parameter holding the run's UTC deadline."
    )
    deadline_grace_seconds: float = Field(
        default=2.0, ge=0, description="Seconds after the deadline before the child is killed."
    )
    max_run_seconds: float | None = Field(
        default=None, gt=0, description="Hard limit for runs without a deadline parameter."
    )

    @field_validator("working_dir", mode="before")
    @classmethod
    def _blank_dir(cls, v: Any) -> Any:
        return None if v in ("", None) else v


class FaceFlowVariables(BaseVariables, RunFields):
    """Job variables of the ``faceflow-gpu`` pool (overridable per deployment and run)."""


class FaceFlowJobConfiguration(BaseJobConfiguration, RunFields):
    """Per-run configuration of a ``faceflow-gpu`` run (rendered from the pool template)."""

    def prepare_for_flow_run(
        self,
        flow_run: FlowRun,
        deployment: DeploymentResponse | None = None,
        flow: APIFlow | None = None,
        work_pool: WorkPool | None = None,
        worker_name: str | None = None,
        worker_id: UUID | None = None,
    ) -> None:
        """Prefect's preparation, plus the entrypoint and directory from the deployment."""
        super().prepare_for_flow_run(flow_run, deployment, flow, work_pool, worker_name, worker_id)
        if deployment is None:
            return
        if self.entrypoint is None:
            self.entrypoint = deployment.entrypoint
        if self.working_dir is None:
            self.working_dir = deployment_directory(deployment)

    def kill_at(self, flow_run: FlowRun, started: float) -> float | None:
        """Epoch seconds after which the run's child is killed, or None."""
        raw = (flow_run.parameters or {}).get(self.deadline_parameter)
        deadline: float | None = None
        if isinstance(raw, datetime):
            deadline = _epoch(raw)
        elif isinstance(raw, str):
            with contextlib.suppress(ValueError):
                deadline = _epoch(datetime.fromisoformat(raw.replace("Z", "+00:00")))
        if deadline is not None:
            return deadline + self.deadline_grace_seconds
        if self.max_run_seconds is not None:
            return started + self.max_run_seconds
        return None


def deployment_directory(deployment: DeploymentResponse) -> Path | None:
    """An existing absolute directory named by the deployment (``path`` or its
    ``set_working_directory`` pull step); other pull steps are not run by this worker."""
    candidates: list[Any] = [deployment.path]
    for step in deployment.pull_steps or []:
        if isinstance(step, dict) and isinstance(step.get(SET_WORKING_DIRECTORY), dict):
            candidates.append(step[SET_WORKING_DIRECTORY].get("directory"))
    for candidate in candidates:
        if isinstance(candidate, str) and candidate:
            path = Path(candidate)
            if path.is_absolute() and path.is_dir():
                return path
    return None


def _epoch(value: datetime) -> float:
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.timestamp()
