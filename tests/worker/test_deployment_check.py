"""Issue 24: Prefect's worker reads a claimed run's deployment before it proposes ``Pending``
(a run whose deployment was deleted is cancelled instead), one API round trip on every
run's way to its child. The faceflow-gpu worker makes that read beside the ``Pending``
proposal; a run whose deployment is gone is still cancelled and never handed to a child.
Shown in-process, without children, against a real server."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import pytest

from faceflow.worker.claims import ClaimJournal, identity_slug
from faceflow.worker.worker import FaceFlowGpuWorker
from tests.worker.conftest import PROBE_ENTRYPOINT, Api, in_process_settings, probe_pool

pytestmark = pytest.mark.prefect


def test_pending_is_proposed_beside_the_deployment_check_and_a_gone_one_cancels(
    prefect_api: Api, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.responses import DeploymentResponse
    from prefect.settings import temporary_settings

    import faceflow.worker.worker as worker_module

    pool, deployment = probe_pool(prefect_api, "gone")
    run_id = prefect_api.create_run(deployment, {"fuse": False})
    # Deleting a deployment deletes its Scheduled runs: the run is kept out of Scheduled
    # while its deployment is deleted, then scheduled again (a run found by a poll just
    # before its deployment went away).
    prefect_api.set_state(run_id, "PENDING", force=True)
    prefect_api.call("DELETE", f"/deployments/{deployment}")
    prefect_api.set_state(run_id, "SCHEDULED", force=True)

    journal = ClaimJournal(tmp_path, identity_slug(pool, "gpu-host-0"))
    assert journal.acquire() == []
    reads_done: list[str] = []
    reads_done_at_pending: list[int] = []
    real_propose = worker_module.propose_state

    async def spy(client: Any, state: Any, flow_run_id: uuid.UUID, **kw: Any) -> Any:
        reads_done_at_pending.append(len(reads_done))
        return await real_propose(client, state, flow_run_id=flow_run_id, **kw)

    monkeypatch.setattr(worker_module, "propose_state", spy)

    async def scenario() -> None:
        async with get_client() as client:
            real_read = client.read_deployment

            async def read_deployment(deployment_id: uuid.UUID | str) -> DeploymentResponse:
                try:
                    return await real_read(deployment_id)
                finally:
                    reads_done.append(str(deployment_id))

            client.read_deployment = read_deployment  # type: ignore[method-assign]
            worker = FaceFlowGpuWorker(work_pool_name=pool, name="gpu-host-0")
            worker._client = client
            worker._journal = journal
            run = await client.read_flow_run(uuid.UUID(run_id))  # as a poll found it
            worker._submitting_flow_run_ids.add(run.id)
            await worker._submit_run(run)
            assert run.id not in worker._submitting_flow_run_ids

    with temporary_settings(updates=in_process_settings(prefect_api)):
        asyncio.run(scenario())

    # Pending was proposed while the deployment read was still under way ...
    assert reads_done_at_pending == [0]
    assert reads_done == [deployment]
    # ... and the run of the deleted deployment was cancelled, its claim forgotten.
    run = prefect_api.run(run_id)
    assert run["state_type"] == "CANCELLED", run["state"]
    assert "no longer exists" in (run["state"]["message"] or "")
    assert journal.claims() == []
    journal.release()


def test_the_check_leaves_the_run_configuration_nothing_to_read(prefect_api: Api) -> None:
    """The check's deployment read and the run's flow go to the definition cache beside
    ``Pending``: the configuration made once ``Pending`` is accepted reads nothing, also
    for a run claimed after idle time (both older than the cache's few seconds)."""
    from prefect.client.orchestration import get_client
    from prefect.settings import temporary_settings

    from faceflow.worker.job import DEFINITIONS, FaceFlowJobConfiguration

    pool, deployment = probe_pool(prefect_api, "fresh")
    run_id = prefect_api.create_run(deployment, {"fuse": False})

    async def scenario() -> tuple[bool, int]:
        async with get_client() as client:
            worker = FaceFlowGpuWorker(work_pool_name=pool, name="gpu-host-0")
            worker._client = client
            run = await client.read_flow_run(uuid.UUID(run_id))
            gone, limited = await worker._deployment_check(run)
            assert not limited  # no concurrency limit: a child's Running may claim it
            reads = DEFINITIONS.reads
            config = await FaceFlowJobConfiguration.resolve_for_flow_run(
                run,
                client=client,
                work_pool=await client.read_work_pool(pool),
                worker_name="gpu-host-0",
            )
            assert config.entrypoint == PROBE_ENTRYPOINT  # from the remembered deployment
            return gone, DEFINITIONS.reads - reads

    with temporary_settings(updates=in_process_settings(prefect_api)):
        gone, reads_after_pending = asyncio.run(scenario())

    assert not gone
    assert reads_after_pending == 0


def test_runs_of_a_deployment_read_fresh_in_the_cache_read_nothing_beside_pending(
    prefect_api: Api,
) -> None:
    """The check asks the definition cache: the first run of a deployment reads it (and
    its flow) beside ``Pending``; the next one within the cache's TTL reads nothing, so
    its ``Pending`` proposal is the only request of its claim."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.responses import DeploymentResponse
    from prefect.settings import temporary_settings

    from faceflow.worker.job import DEFINITIONS

    pool, deployment = probe_pool(prefect_api, "cached")
    first = prefect_api.create_run(deployment, {"fuse": False})
    second = prefect_api.create_run(deployment, {"fuse": False})
    deployment_reads: list[str] = []

    async def scenario() -> tuple[list[bool], list[int]]:
        async with get_client() as client:
            real_read = client.read_deployment

            async def read_deployment(deployment_id: uuid.UUID | str) -> DeploymentResponse:
                deployment_reads.append(str(deployment_id))
                return await real_read(deployment_id)

            client.read_deployment = read_deployment  # type: ignore[method-assign]
            worker = FaceFlowGpuWorker(work_pool_name=pool, name="gpu-host-0")
            worker._client = client
            gone, reads = [], []
            for run_id in (first, second):
                run = await client.read_flow_run(uuid.UUID(run_id))
                before = DEFINITIONS.reads
                gone.append((await worker._deployment_check(run))[0])
                reads.append(DEFINITIONS.reads - before)
            return gone, reads

    with temporary_settings(updates=in_process_settings(prefect_api)):
        gone, reads = asyncio.run(scenario())

    assert gone == [False, False]
    # the deployment (and the flow, unless an earlier test read it) for the first run only
    assert reads[0] >= 1 and reads[1] == 0, reads
    assert deployment_reads == [deployment]


def test_a_deployment_with_a_concurrency_limit_is_claimed_with_pending(prefect_api: Api) -> None:
    """Prefect takes a deployment's concurrency slot on ``Pending``: the check tells the
    worker so, and a run of such a deployment is never claimed by its child's ``Running``."""
    from prefect.client.orchestration import get_client
    from prefect.settings import temporary_settings

    pool, deployment = probe_pool(prefect_api, "limited")
    held = prefect_api.call("GET", f"/deployments/{deployment}")
    body = {
        "name": f"limited-{uuid.uuid4().hex[:6]}",
        "flow_id": held["flow_id"],
        "work_pool_name": pool,
        "entrypoint": held["entrypoint"],
        "concurrency_limit": 1,
    }
    limited_deployment = str(prefect_api.call("POST", "/deployments/", body)["id"])
    runs = [prefect_api.create_run(d, {"fuse": False}) for d in (deployment, limited_deployment)]

    async def scenario() -> list[tuple[bool, bool]]:
        async with get_client() as client:
            worker = FaceFlowGpuWorker(work_pool_name=pool, name="gpu-host-0")
            worker._client = client
            return [
                await worker._deployment_check(await client.read_flow_run(uuid.UUID(run_id)))
                for run_id in runs
            ]

    with temporary_settings(updates=in_process_settings(prefect_api)):
        checks = asyncio.run(scenario())

    assert checks == [(False, False), (False, True)]
