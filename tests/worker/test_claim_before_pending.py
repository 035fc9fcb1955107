"""Regression (found by the full fault matrix, scenario 1): the worker was SIGKILLed during
the API call that set its claimed run ``Pending``. Prefect recorded ``Pending`` but the
claim journal did not name the run yet, so the restarted worker did not recover it and it
held the pool's only slot until the relay's pending timeout (queued jobs expired). The
worker now journals the run *before* proposing ``Pending`` (and forgets it if the proposal
is refused), so whatever moment it dies at, a restart finds the run and puts a ``Pending``
one back to ``Scheduled``. Shown in-process, without children, against a real server."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from pathlib import Path
from typing import Any

import pytest

from faceflow.worker.claims import ClaimJournal, identity_slug
from faceflow.worker.recovery import recover_run
from faceflow.worker.worker import FaceFlowGpuWorker
from tests.worker.conftest import Api, in_process_settings, probe_pool

pytestmark = pytest.mark.prefect


def _journaled(journal: ClaimJournal) -> list[str]:
    """The run ids in the journal file on disk (what a restart would read)."""
    if not journal.path.exists():
        return []
    return [c["flow_run_id"] for c in json.loads(journal.path.read_text())["claims"]]


def test_a_claim_is_journaled_before_prefect_records_it_pending(
    prefect_api: Api, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefect.client.orchestration import get_client
    from prefect.settings import temporary_settings

    import faceflow.worker.worker as worker_module

    pool, deployment = probe_pool(prefect_api, "claim")
    claimed = prefect_api.create_run(deployment, {"fuse": False})
    taken = prefect_api.create_run(deployment, {"fuse": False})
    prefect_api.set_state(taken, "RUNNING", force=True)  # another worker has it
    assert prefect_api.state(claimed) == "SCHEDULED"

    identity = identity_slug(pool, "gpu-host-0")
    journal = ClaimJournal(tmp_path, identity)
    assert journal.acquire() == []

    # What the journal on disk names at the moment Prefect receives each Pending proposal.
    seen: dict[str, list[str]] = {}
    real_propose = worker_module.propose_state

    async def spy(client: Any, state: Any, flow_run_id: uuid.UUID, **kw: Any) -> Any:
        seen[str(flow_run_id)] = _journaled(journal)
        return await real_propose(client, state, flow_run_id=flow_run_id, **kw)

    monkeypatch.setattr(worker_module, "propose_state", spy)

    async def scenario() -> tuple[bool, bool, list[str], list[str]]:
        async with get_client() as client:
            worker = FaceFlowGpuWorker(work_pool_name=pool, name="gpu-host-0")
            worker._client = client
            worker._journal = journal
            run = await client.read_flow_run(uuid.UUID(claimed))
            accepted = await worker._propose_pending_state(run)
            after_accepted = _journaled(journal)
            state = (await client.read_flow_run(run.id)).state
            assert state is not None and state.is_pending()
            other = await client.read_flow_run(uuid.UUID(taken))
            refused = await worker._propose_pending_state(other)
            after_refused = _journaled(journal)

            # The worker dies here (its lock goes); its next incarnation takes the identity.
            journal.release()
            successor = ClaimJournal(tmp_path, identity)
            left = successor.acquire()
            assert left is not None and [c.flow_run_id for c in left] == [claimed]
            await recover_run(client, left[0], worker.name, logging.getLogger(__name__))
            successor.release()
        return accepted, refused, after_accepted, after_refused

    with temporary_settings(updates=in_process_settings(prefect_api)):
        accepted, refused, after_accepted, after_refused = asyncio.run(scenario())

    # (a) Journaled before the proposal reached Prefect; (b) accepted: Pending and journaled.
    assert claimed in seen[claimed]
    assert accepted
    assert after_accepted == [claimed]
    # (c) A proposal Prefect refuses (the run is someone else's) leaves no claim behind.
    assert taken in seen[taken]
    assert not refused
    assert after_refused == [claimed]
    assert prefect_api.state(taken) == "RUNNING"
    # (d) The restart found the Pending run that no child had and put it back to Scheduled.
    assert prefect_api.state(claimed) == "SCHEDULED"
