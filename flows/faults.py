"""Fault injection for the reliability suite (``faceflow selftest faults``); inert by default.

Only when the flow run's environment has ``FACEFLOW_ENABLE_FAULTS=true`` does
``inject(stage)`` read a JSON plan from ``FACEFLOW_FAULTS_FILE`` (default
``$FACEFLOW_HOME/faults.json``) at the start of every stage::

    {"hang": [{"stage": "detect", "owner_ids": ["<user uuid>"], "seconds": 600}]}

A matching entry (its ``stage`` the stage's name or a shell-style pattern of it, an owner
of one of the run's jobs listed) blocks the flow's main thread in a plain sleep *outside*
the stage's task, so no stage timeout can end it: the worker's deadline kill and the
relay's reaper must. The sleep ends early once the plan no longer holds a matching entry
(read every ``HANG_STEP_S``): a test lets a held run go on by emptying the plan. A video
part is a "stage" too, under its part name (``chunk-0001``, ``analyse-000000-000030``): it
hangs once its first frames are done (``flows.video_parts.PartFrames``), inside its render
or analysis task, mid-part. Nothing here runs in production unless an operator sets the
variable on a worker.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

ENABLE_VAR = "FACEFLOW_ENABLE_FAULTS"
FILE_VAR = "FACEFLOW_FAULTS_FILE"
PLAN_NAME = "faults.json"
HANG_STEP_S = 0.1
"""How often a hang reads the plan again (it ends once its entry is gone)."""

log = logging.getLogger("faceflow.flows.faults")


def enabled() -> bool:
    """Whether fault injection is switched on in this process's environment."""
    return os.environ.get(ENABLE_VAR, "").strip().lower() in ("1", "true", "yes")


def plan_path() -> Path:
    """Where the fault plan is read from."""
    explicit = os.environ.get(FILE_VAR)
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("FACEFLOW_HOME", ".faceflow")) / PLAN_NAME


def read_plan(path: Path) -> dict[str, Any]:
    """The plan at ``path``; empty when it is missing or not a JSON object."""
    try:
        plan = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return plan if isinstance(plan, dict) else {}


def hang_seconds(plan: dict[str, Any], *, stage: str, owner_ids: Collection[str]) -> float:
    """Seconds the plan makes ``stage`` of a run carrying a job of one of ``owner_ids``
    hang (0: none)."""
    for entry in plan.get("hang") or []:
        if not isinstance(entry, dict) or not fnmatch.fnmatchcase(stage, str(entry.get("stage"))):
            continue
        if set(owner_ids) & set(entry.get("owner_ids") or []):
            return float(entry.get("seconds", 0.0))
    return 0.0


def run_owners(parameters: dict[str, Any]) -> set[str]:
    """The owners of the jobs a run carries: ``owner_id`` of a ``fuse-faces`` run, every
    job's ``owner_id`` of a ``fuse-batch`` run, its ``job``'s of a video part."""
    owners = {str(parameters["owner_id"])} if parameters.get("owner_id") else set()
    for job in [*(parameters.get("jobs") or []), parameters.get("job")]:
        owner = job.get("owner_id") if isinstance(job, dict) else getattr(job, "owner_id", None)
        if owner:
            owners.add(str(owner))
    return owners


def inject(stage: str) -> None:
    """Apply the fault plan to the current flow run's ``stage`` (no-op unless enabled)."""
    if not enabled():
        return
    from prefect.runtime import flow_run

    owners = run_owners(dict(flow_run.parameters or {}))
    path = plan_path()
    seconds = hang_seconds(read_plan(path), stage=stage, owner_ids=owners)
    if seconds > 0:
        log.warning("fault injection: stage %s hangs for %.0f s", stage, seconds)
        until = time.monotonic() + seconds
        while (left := until - time.monotonic()) > 0:
            time.sleep(min(left, HANG_STEP_S))
            if hang_seconds(read_plan(path), stage=stage, owner_ids=owners) <= 0:
                log.warning("fault injection: stage %s let go", stage)
                return
