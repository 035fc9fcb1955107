"""What the worker benches share (``warm_worker``, ``run_profile``, ``worker_memory``,
``prefect_costs``, ``relay_bench``, ``video_fanout``): the sample inputs and default blocks,
a job's signed ``fuse-faces`` parameters, a pool's base job template, Prefect's timestamps
and the Prefect API requests per job from a server's access log."""

from __future__ import annotations

import json
import re
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from faceflow.testing.inputs import put_input
from flows.binding import signed_parameters, worker_keys

REPO = Path(__file__).resolve().parents[1]
TEMPLATES = {"process": "gpu-process.json", "warm": "faceflow-gpu.json"}
"""The base job template (``work_pools/``) of each worker type's pool."""


def ts(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def prepare_inputs(
    url: str, home: Path, *, gpu_shaped: bool = False, stage_task_runs: str | None = None
) -> tuple[str, str, bytes, bytes]:
    """Default blocks saved; the sample photos stored as the webapi would. ``gpu_shaped``:
    the settings a GPU host gets, ``stage_task_runs``: which runs have a task run per stage
    (``bench.job_work.bench_settings``)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from bench.job_work import bench_settings
    from blocks import init_default_blocks
    from blocks.defaults import SETTINGS_NAME
    from faceflow import samples

    with temporary_settings(updates={PREFECT_API_URL: url}):
        saved = init_default_blocks(home)
        if gpu_shaped or stage_task_runs:
            settings = bench_settings(gpu_shaped=gpu_shaped, stage_task_runs=stage_task_runs)
            settings.save(SETTINGS_NAME, overwrite=True)
    source, target = samples.astronaut_jpeg_bytes(), samples.grace_hopper_jpeg_bytes()
    keys = [put_input(saved.storage_path, data) for data in (source, target)]
    return keys[0], keys[1], source, target


def job_parameters(source_key: str, target_key: str, **extra: Any) -> dict[str, Any]:
    """A ``fuse-faces`` job's parameters, due in 30 minutes, with ``extra`` (its blocks, as
    ``settings_block=...``, more inputs, options, ``attempt``), bound to the job as the
    relay binds them (the workers a bench starts hold this process's run-signing key)."""
    params = {
        "job_id": str(uuid.uuid4()),
        "owner_id": "bench",
        "source_key": source_key,
        "target_key": target_key,
        "deadline_at": (datetime.now(UTC) + timedelta(minutes=30)).isoformat(),
        **extra,
    }
    return signed_parameters(params, worker_keys()[0])


ACCESS_LINE = re.compile(r'uvicorn\.access - \S+ - "(\w+) (/api/\S*) HTTP')
ID_IN_PATH = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def requests_per_job(log: Path, start: int, jobs: int) -> dict[str, float]:
    """Prefect API requests per job by endpoint, from the server's access log lines after
    byte ``start`` (the server runs with ``--count-requests``); ids become ``{id}``."""
    counts: dict[str, int] = {}
    with log.open("rb") as fh:
        fh.seek(start)
        for raw in fh:
            match = ACCESS_LINE.search(raw.decode(errors="replace"))
            if match:
                path = ID_IN_PATH.sub("{id}", match.group(2).split("?", 1)[0])
                key = f"{match.group(1)} {path}"
                counts[key] = counts.get(key, 0) + 1
    ordered = sorted(counts.items(), key=lambda item: -item[1])
    out = {key: round(n / jobs, 2) for key, n in ordered}
    out["total"] = round(sum(counts.values()) / jobs, 2)
    return out


def pool_template(mode: str) -> dict[str, Any]:
    """The base job template of a worker type's pool (``work_pools/``)."""
    return dict(json.loads((REPO / "work_pools" / TEMPLATES[mode]).read_text()))
