"""Helpers of the orchestration tests: job parameters, what a run stored and published, the
prefect CLI, the REST API."""

from __future__ import annotations

import io
import json
import os
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, cast
from uuid import UUID

import httpx
import numpy as np
import pytest
from PIL import Image
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    FlowRunFilter,
    FlowRunFilterId,
    LogFilter,
    LogFilterFlowRunId,
)
from prefect.client.schemas.objects import Artifact, State, TaskRun

from blocks.storage import read_bytes
from faceflow.testing.prefect import PrefectServer
from flows.binding import signed_parameters, worker_keys
from flows.params import (
    DEFAULT_STORAGE_BLOCK,
    STAGE_LINE,
    JobFailure,
    ResultRef,
    result_error_key,
    result_meta_key,
)
from tasks.stages import STAGE_NAMES
from tests.orchestration.conftest import BIN, REPO_ROOT

STAGE_RUNS = set(STAGE_NAMES) - {"enhance"}
"""The stage task runs of a job that asks for no enhancer."""
TIMED_STAGES = STAGE_RUNS - {"store"}
"""The stages such a job's ``ResultRef.timings_ms`` names (it is written before ``store``)."""


def job_params(
    source_key: str, target_key: str, *, seconds: float = 120.0, **extra: Any
) -> dict[str, Any]:
    """Parameters of one job, as ``FuseFacesParams`` fields, deadline ``seconds`` from now,
    bound to the job as the relay binds them (``flows.binding``, this process's key)."""
    params = {
        "job_id": str(uuid.uuid4()),
        "owner_id": "user-1",
        "source_key": source_key,
        "target_key": target_key,
        "deadline_at": datetime.now(UTC) + timedelta(seconds=seconds),
        **extra,
    }
    return signed_parameters(params, worker_keys()[0])


def task_runs(flow_run_id: UUID | None) -> dict[str, TaskRun]:
    """The task runs of a flow run by name (stage tasks are named after their stage)."""
    assert flow_run_id is not None
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )
    return {run.name: run for run in runs}


def run_artifacts(flow_run_id: UUID | None) -> dict[str, Artifact]:
    """The artifacts of a flow run by type (``markdown``, ``progress``, ``table``): one of
    each type at most."""
    assert flow_run_id is not None
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    by_type = {str(artifact.type): artifact for artifact in artifacts}
    assert len(by_type) == len(artifacts), [artifact.type for artifact in artifacts]
    return by_type


def table_rows(artifact: Artifact) -> list[dict[str, Any]]:
    """The rows of a table artifact (the API gives its data as JSON text or as rows)."""
    data = artifact.data
    return cast(list[dict[str, Any]], json.loads(data) if isinstance(data, str) else data)


def stored_result(job_id: str, attempt: int = 1) -> ResultRef:
    """The result record (sidecar) an attempt of a job wrote to the default storage."""
    raw = read_bytes(DEFAULT_STORAGE_BLOCK, result_meta_key(job_id, attempt))
    return ResultRef.model_validate_json(raw)


def stored_failure(job_id: str, attempt: int = 1) -> JobFailure:
    """The failure record an attempt of a job wrote to the default storage."""
    raw = read_bytes(DEFAULT_STORAGE_BLOCK, result_error_key(job_id, attempt))
    return JobFailure.model_validate_json(raw)


def result_pixels(ref: ResultRef) -> np.ndarray:
    """The decoded result image ``ref`` names, from the default storage."""
    return np.asarray(Image.open(io.BytesIO(read_bytes(DEFAULT_STORAGE_BLOCK, ref.key))))


STAGE_MODES = pytest.mark.parametrize("inline", [False, True], ids=["task-runs", "inline"])
"""Run a flow test with each stage as a task run and inline (``stage_task_runs``)."""


def batch_outcomes(state: State[Any]) -> dict[str, str]:
    """A completed ``fuse-batch`` run's ``{job id: outcome}`` (the flow returns a ``State``
    of its own only when it fails)."""
    return cast(dict[str, str], state.result())


def stage_settings(inline: bool, name: str = "", *, mode: str | None = None, **fields: Any) -> str:
    """A saved ``FusionSettings`` block with ``fields`` whose runs call their stages inline
    (``stage_task_runs="never"``) or as task runs (``"always"``), or as ``mode`` says when
    given (``"batches"``); its block name."""
    from blocks.settings import FusionSettings

    mode = mode or ("never" if inline else "always")
    block = f"test-{name or 'stages'}-{mode}"
    FusionSettings(stage_task_runs=mode, **fields).save(block, overwrite=True)
    return f"fusion-settings/{block}"


def stages_seen(flow_run_id: UUID | None, inline: bool) -> dict[str, tuple[int, str]]:
    """Each stage a flow run ran, with its attempts and end (``Completed``, ``Failed`` or
    ``TimedOut``): from its task runs, or, ``inline``, from the run's stage log lines (it
    then has no task run)."""
    runs = task_runs(flow_run_id)
    if not inline:
        return {n: (r.run_count, (r.state and r.state.name) or "") for n, r in runs.items()}
    assert runs == {}, set(runs)
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=15.0)  # the run's logs reach the server in batches
    with get_client(sync_client=True) as client:
        logs = client.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))
        )
    seen: dict[str, tuple[int, str]] = {}
    for log in sorted(logs, key=lambda log: log.timestamp):
        line = STAGE_LINE.match(log.message)
        if line is None:
            continue
        end = "Completed" if line["how"] == "done" else "Failed"
        if "StageTimedOut(" in log.message:
            end = "TimedOut"
        seen[line["stage"]] = (int(line["attempt"]), end)
    return seen


def prefect_cli(server: PrefectServer, *args: str, timeout: float = 180) -> str:
    """Run the prefect CLI against ``server``; its output (``AssertionError`` on failure)."""
    return prefect_cli_concurrently(server, list(args), timeout=timeout)[0]


def prefect_cli_concurrently(
    server: PrefectServer, *commands: list[str], timeout: float = 180
) -> list[str]:
    """Run several prefect CLI commands at once (each pays ~4 s of imports); their outputs."""
    procs = [
        subprocess.Popen(
            [str(BIN / "prefect"), *args],
            cwd=REPO_ROOT,
            env=server.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for args in commands
    ]
    outputs = []
    for args, proc in zip(commands, procs, strict=True):
        out, err = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, f"prefect {' '.join(args)} failed:\n{out}\n{err}"
        outputs.append(out)
    return outputs


def api(server: PrefectServer, method: str, path: str, **kwargs: Any) -> httpx.Response:
    """One REST call; 503 and dropped connections (a busy SQLite server) are retried.

    Only send non-idempotent POSTs with an idempotency key.
    """
    for delay in (0.5, 1.0, 2.0, 4.0):
        try:
            response = httpx.request(method, f"{server.api_url}{path}", timeout=30.0, **kwargs)
        except (httpx.ReadError, httpx.RemoteProtocolError, httpx.ConnectError):
            time.sleep(delay)
            continue
        if response.status_code != 503:
            return response
        time.sleep(delay)
    return httpx.request(method, f"{server.api_url}{path}", timeout=30.0, **kwargs)


@dataclass
class Overlap:
    """Whether work ran beside the stage that does not need it: ``waited[name]`` is True
    when the stage ``name`` saw its companion start (on a ``faceflow-stage`` thread) while
    it was running itself."""

    waited: dict[str, list[bool]] = field(default_factory=dict)
    threads: dict[str, set[str]] = field(default_factory=dict)


def probe_overlap(monkeypatch: pytest.MonkeyPatch, timeout_s: float = 5.0) -> Overlap:
    """Make ``align_stage`` wait for ``reference_stage`` to start, and ``checked_stage`` for
    ``moderate_result_stage`` and ``marked_encode_stage`` (the store stage's encoding): run
    one after the other (the stage first), each waits ``timeout_s`` in vain and records
    False."""
    from tasks import pipeline

    overlap = Overlap()
    pairs = {
        "align_stage": ("reference_stage",),
        "checked_stage": ("moderate_result_stage", "marked_encode_stage"),
    }
    started = {companion: threading.Event() for names in pairs.values() for companion in names}

    def companion(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            overlap.threads.setdefault(name, set()).add(threading.current_thread().name)
            started[name].set()
            return real(*args, **kwargs)

        return run

    def waiting(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            saw = [started[companion].wait(timeout_s) for companion in pairs[name]]
            overlap.waited.setdefault(name, []).append(all(saw))
            return real(*args, **kwargs)

        return run

    for stage, others in pairs.items():
        for other in others:
            monkeypatch.setattr(pipeline, other, companion(other, getattr(pipeline, other)))
        monkeypatch.setattr(pipeline, stage, waiting(stage, getattr(pipeline, stage)))
    return overlap


def check_file_transfer(block_name: str, tmp_path: Path) -> None:
    """``put_from`` / ``is_stored`` / ``fetch_to`` on the storage block ``block_name``:
    a 3 MiB file goes in and comes back byte for byte; a missing key reads as missing."""
    from prefect.filesystems import LocalFileSystem

    from blocks.storage import fetch_to, is_stored, load_storage, put_from, read_locally
    from tasks.errors import InvalidInput

    store = load_storage(block_name)
    data = os.urandom(3 << 20)
    source = tmp_path / "in.bin"
    source.write_bytes(data)
    key = f"video-chunks/test-{uuid.uuid4().hex}.mp4"
    assert not is_stored(store, key)
    put_from(store, key, source)
    assert is_stored(store, key)
    assert not is_stored(store, key[:-4])  # a prefix of a stored key is not stored
    back = fetch_to(store, key, tmp_path / "deep" / "out.bin")
    assert back.read_bytes() == data
    with pytest.raises(InvalidInput):
        fetch_to(store, f"{key}.missing", tmp_path / "missing.bin")
    read = read_locally(store, key, tmp_path / "deep" / "read.bin")
    assert read.read_bytes() == data
    assert read.is_symlink() == isinstance(store, LocalFileSystem)  # local: not copied
    with pytest.raises(InvalidInput):
        read_locally(store, f"{key}.missing", tmp_path / "missing.bin")
