"""Job configuration and variables of the ``faceflow-gpu`` work pool (one set of fields).

The pool's base job template (``work_pools/faceflow-gpu.json``) is generated from these
classes; deployments and single runs override the variables through ``job_variables``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self, cast

from prefect.settings import Settings, get_current_settings
from prefect.workers.base import BaseJobConfiguration, BaseVariables
from pydantic import BaseModel, Field, field_validator

if TYPE_CHECKING:
    from uuid import UUID

    from prefect.client.orchestration import PrefectClient
    from prefect.client.schemas.objects import Flow as APIFlow
    from prefect.client.schemas.objects import FlowRun, WorkPool
    from prefect.client.schemas.responses import DeploymentResponse

SET_WORKING_DIRECTORY = "prefect.deployments.steps.set_working_directory"
_BASE_ENVIRONMENT: dict[str, tuple[Settings, dict[str, str]]] = {}


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

    @classmethod
    def _base_environment(cls) -> dict[str, str]:
        """Prefect's settings as environment variables, computed once per settings object.

        Prefect serialises every setting for every run (≈ 15 ms of the worker's CPU per run
        here, a third of its per-run work); the settings of a running worker do not change
        unless a ``temporary_settings`` block swaps the object, which the cache notices.
        """
        settings = get_current_settings()
        cached = _BASE_ENVIRONMENT.get("entry")
        if cached is None or cached[0] is not settings:
            cached = (settings, settings.to_environment_variables(exclude_unset=True))
            _BASE_ENVIRONMENT["entry"] = cached
        return dict(cached[1])

    @classmethod
    async def resolve_for_flow_run(
        cls,
        flow_run: FlowRun,
        *,
        client: PrefectClient,
        work_pool: WorkPool,
        worker_name: str,
        worker_id: UUID | None = None,
        deployment: DeploymentResponse | None = None,
    ) -> Self:
        """Prefect's job configuration of ``flow_run``, with its deployment and flow read
        through ``DEFINITIONS`` (two requests per run fewer on the way to the child)."""
        if deployment is None and flow_run.deployment_id is not None:
            deployment = await DEFINITIONS.deployment(client, flow_run.deployment_id)
        flow = await DEFINITIONS.flow(client, flow_run.flow_id)
        return await super().resolve_for_flow_run(
            flow_run,
            client=cast("PrefectClient", _KnownFlow(client, flow)),
            work_pool=work_pool,
            worker_name=worker_name,
            worker_id=worker_id,
            deployment=deployment,
        )

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


class DefinitionCache:
    """Deployments and flows as the worker last read them, for ``ttl_s`` seconds.

    Every run of a burst names the same deployment and flow; reading them once per
    ``ttl_s`` instead of once per run saves two API requests per run. The worker's check
    of a claimed run's deployment (a deleted deployment's runs are cancelled) asks this
    cache beside the ``Pending`` proposal, with the run's flow: what is older than
    ``ttl_s`` is read there, so a run's configuration needs no request after ``Pending``,
    after idle time too. A deployment or flow changed on the server applies ``ttl_s``
    later. Each caller gets its own deep copy: Prefect merges a run's job variables into
    the deployment's in place.
    """

    def __init__(self, ttl_s: float = 5.0) -> None:
        self.ttl_s = ttl_s
        self.reads = 0
        self._entries: dict[tuple[str, UUID], tuple[float, BaseModel]] = {}

    async def deployment(self, client: PrefectClient, deployment_id: UUID) -> DeploymentResponse:
        """The deployment, read at most once per ``ttl_s``."""
        read = await self._get("deployment", deployment_id, client.read_deployment)
        return cast("DeploymentResponse", read)

    async def flow(self, client: PrefectClient, flow_id: UUID) -> APIFlow:
        """The flow, read at most once per ``ttl_s``."""
        return cast("APIFlow", await self._get("flow", flow_id, client.read_flow))

    async def _get(
        self, kind: str, key: UUID, read: Callable[[UUID], Awaitable[BaseModel]]
    ) -> BaseModel:
        now = time.monotonic()
        entry = self._entries.get((kind, key))
        if entry is None or now - entry[0] > self.ttl_s:
            entry = (now, await read(key))
            self.reads += 1
            self._entries[(kind, key)] = entry
        return entry[1].model_copy(deep=True)


DEFINITIONS = DefinitionCache()
"""The worker process's cache of deployments and flows (``DefinitionCache``)."""


class _KnownFlow:
    """A Prefect client whose ``read_flow`` answers ``flow`` without a request."""

    def __init__(self, client: PrefectClient, flow: APIFlow) -> None:
        self._client, self._flow = client, flow

    async def read_flow(self, flow_id: UUID) -> APIFlow:
        if flow_id == self._flow.id:
            return self._flow
        return await self._client.read_flow(flow_id)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


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
