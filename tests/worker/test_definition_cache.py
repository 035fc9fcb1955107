"""The worker reads a run's deployment and flow once per few seconds, not once per run, and
a run's job variables never leak into the cached deployment (Prefect merges them in place).
Against a real Prefect server, in-process, with Prefect's own client."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from faceflow.worker.job import DefinitionCache, FaceFlowJobConfiguration
from faceflow.worker.worker import WORKER_TYPE
from tests.worker.conftest import PROBE_ENTRYPOINT, Api, pool_template

pytestmark = pytest.mark.prefect


def test_definitions_are_read_once_per_ttl_and_runs_do_not_share_job_variables(
    prefect_api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, PREFECT_LOGGING_TO_API_ENABLED, temporary_settings

    import faceflow.worker.job as job

    pool = f"definitions-{uuid.uuid4().hex[:6]}"
    prefect_api.create_pool(pool, WORKER_TYPE, pool_template())
    deployment_id = prefect_api.deploy("warm-probe", PROBE_ENTRYPOINT, pool)
    prefect_api.call(
        "PATCH",
        f"/deployments/{deployment_id}",
        {"job_variables": {"env": {"FROM_DEPLOYMENT": "1"}}},
    )
    first = prefect_api.create_run(deployment_id, {"fuse": False}, {"env": {"RUN": "first"}})
    second = prefect_api.create_run(deployment_id, {"fuse": False})
    cache = DefinitionCache(ttl_s=60.0)
    monkeypatch.setattr(job, "DEFINITIONS", cache)

    async def scenario() -> tuple[list[dict[str, Any]], int, int]:
        async with get_client() as client:
            work_pool = await client.read_work_pool(pool)
            envs = []
            for run_id in (first, second):
                run = await client.read_flow_run(uuid.UUID(run_id))
                config = await FaceFlowJobConfiguration.resolve_for_flow_run(
                    run, client=client, work_pool=work_pool, worker_name="gpu-host-0"
                )
                assert config.entrypoint == PROBE_ENTRYPOINT  # from the cached deployment
                envs.append(config.env)
            reads_while_fresh = cache.reads
            cache.ttl_s = 0.0  # expired: read again
            run = await client.read_flow_run(uuid.UUID(second))
            await FaceFlowJobConfiguration.resolve_for_flow_run(
                run, client=client, work_pool=work_pool, worker_name="gpu-host-0"
            )
            return envs, reads_while_fresh, cache.reads

    api = {PREFECT_API_URL: prefect_api.server.api_url, PREFECT_LOGGING_TO_API_ENABLED: False}
    with temporary_settings(updates=api):
        envs, reads_while_fresh, reads_after = asyncio.run(scenario())

    assert reads_while_fresh == 2  # one deployment and one flow read for both runs
    assert reads_after == 4
    assert envs[0]["FROM_DEPLOYMENT"] == "1" and envs[0]["RUN"] == "first"
    assert envs[1]["FROM_DEPLOYMENT"] == "1"
    assert "RUN" not in envs[1], "the first run's job variables leaked into the deployment"
    assert envs[0]["PREFECT__FLOW_RUN_ID"] == first and envs[1]["PREFECT__FLOW_RUN_ID"] == second
