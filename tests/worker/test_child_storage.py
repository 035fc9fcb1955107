"""A warm child resolves Prefect's default result storage while idle, not in each run."""

from __future__ import annotations

import time
from multiprocessing import Pipe
from typing import Any

import pytest
from prefect import flow
from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.context import FlowRunContext
from prefect.filesystems import LocalFileSystem
from prefect.flow_engine import run_flow
from prefect.settings import temporary_settings

from faceflow.worker.child import STORAGE_TTL_S, WarmChild
from tests.worker.conftest import Api, in_process_settings

SEEN: list[Any] = []


@flow(name="storage-probe", persist_result=False)
def storage_probe() -> None:
    context = FlowRunContext.get()
    assert context is not None
    SEEN.append(context.result_store.result_storage)


def bare_child() -> WarmChild:
    child = WarmChild.__new__(WarmChild)  # no connection or spec needed here
    child.variants, child.default_storage = {}, None
    return child


def test_a_child_uses_a_fresh_resolved_storage_on_a_copy_of_the_flow(tmp_path: Any) -> None:
    child = bare_child()
    assert child.with_default_storage(storage_probe) is storage_probe  # nothing resolved yet
    storage = LocalFileSystem(basepath=str(tmp_path))
    child.default_storage = (time.monotonic(), storage)
    copied = child.with_default_storage(storage_probe)
    assert copied is not storage_probe and copied.result_storage is storage
    assert copied.fn is storage_probe.fn and copied.persist_result is False
    assert storage_probe.result_storage is None  # the loaded flow is left as it is
    assert child.with_default_storage(storage_probe) is copied  # one copy per flow
    own = storage_probe.with_options(result_storage="local-file-system/elsewhere")
    assert child.with_default_storage(own) is own  # a flow's own storage stays
    child.default_storage = (time.monotonic() - STORAGE_TTL_S - 1, storage)
    assert child.with_default_storage(storage_probe) is storage_probe  # too old: Prefect's


def test_the_engine_runs_with_the_storage_resolved_while_idle_without_reading_it(
    prefect_api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads: list[float] = []
    read = SyncPrefectClient.read_server_default_result_storage

    def counted(self: SyncPrefectClient) -> Any:
        reads.append(time.monotonic())
        return read(self)

    monkeypatch.setattr(SyncPrefectClient, "read_server_default_result_storage", counted)
    with temporary_settings(updates=in_process_settings(prefect_api)):
        child = bare_child()
        child.resolve_default_storage()
        assert child.default_storage is not None and len(reads) == 1
        client = get_client(sync_client=True)
        SEEN.clear()
        for probe in (storage_probe, child.with_default_storage(storage_probe)):
            run = client.create_flow_run(storage_probe)
            state = run_flow(probe, flow_run=run, return_type="state")
            assert state.is_completed()  # type: ignore[union-attr]
        # Prefect's own lookup read the server once; the child's copy did not
        assert len(reads) == 2
        assert SEEN[0] is SEEN[1] is child.default_storage[1]  # the same result storage

        child.conn, worker_end = Pipe()
        fresh = child.default_storage
        worker_end.send("run 1")  # waiting already, resolution fresh: no read before it
        assert child.next_message() == "run 1" and child.default_storage is fresh
        child.default_storage = (time.monotonic() - STORAGE_TTL_S - 1, fresh[1])
        worker_end.send("run 2")  # too old to use: resolved again before the run
        assert child.next_message() == "run 2" and len(reads) == 3
        assert child.default_storage[0] > fresh[0] and child.default_storage[1] is fresh[1]
