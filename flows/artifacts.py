"""The operator's view of one fuse-faces run in the Prefect UI.

A progress artifact names the current stage while the run works; at the end a table
artifact lists per-stage timings, faces found, device and GPU memory, and a markdown
artifact links the result (or states the failure code). Artifact failures are logged and
never fail the job.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from tasks.gpu import GpuStats

logger = logging.getLogger("faceflow.flows.artifacts")


def artifact_key(job_id: str, kind: str) -> str:
    """A valid artifact key (lowercase letters, digits, dashes) for a job."""
    slug = re.sub(r"[^a-z0-9-]+", "-", job_id.lower()).strip("-") or "job"
    return f"fuse-{slug}-{kind}"


@dataclass
class StageRecord:
    """What the table shows for one stage."""

    stage: str
    status: str = "pending"
    ms: float | None = None
    attempts: int = 0


@dataclass
class OperatorView:
    """Progress, timings and result of one flow run, published as artifacts."""

    job_id: str
    attempt: int
    stages: Sequence[str]
    records: dict[str, StageRecord] = field(default_factory=dict)
    _progress_id: UUID | None = None

    def __post_init__(self) -> None:
        self.records = {s: StageRecord(s) for s in self.stages}

    def start(self) -> None:
        """Create the progress artifact."""
        self._progress_id = _safely(
            create_progress_artifact,
            progress=0.0,
            key=artifact_key(self.job_id, "progress"),
            description=f"Job {self.job_id} attempt {self.attempt}: starting.",
        )

    def stage_started(self, stage: str) -> None:
        """Name ``stage`` as the current one."""
        self.records[stage].status = "running"
        index = list(self.stages).index(stage)
        self._progress(
            100.0 * index / len(self.stages),
            f"Stage {index + 1}/{len(self.stages)}: {stage} (attempt {self.attempt}).",
        )

    def stage_finished(self, stage: str, ms: float, attempts: int, ok: bool) -> None:
        """Record a stage's outcome."""
        record = self.records[stage]
        record.status, record.ms, record.attempts = ("done" if ok else "failed"), ms, attempts

    def finish(
        self,
        *,
        outcome: str,
        device: str,
        gpu: GpuStats,
        faces: dict[str, int],
        result_key: str | None = None,
        result_uri: str | None = None,
    ) -> None:
        """Publish the table and markdown artifacts and close the progress bar."""
        done = outcome == "succeeded"
        self._progress(100.0 if done else self._fraction_done(), f"Finished: {outcome}.")
        _safely(
            create_table_artifact,
            table=self.table(device=device, gpu=gpu, faces=faces),
            key=artifact_key(self.job_id, "timings"),
            description=f"Job {self.job_id} attempt {self.attempt}: stage timings and device.",
        )
        lines = [f"# Job `{self.job_id}`, attempt {self.attempt}: {outcome}", ""]
        if result_key is not None:
            link = f"[`{result_key}`]({result_uri})" if result_uri else f"`{result_key}`"
            lines.append(f"Result: {link}")
        else:
            lines.append(f"Outcome: `{outcome}`")
        _safely(
            create_markdown_artifact,
            markdown="\n".join(lines),
            key=artifact_key(self.job_id, "result"),
            description=f"Job {self.job_id} attempt {self.attempt}: result.",
        )

    def table(self, *, device: str, gpu: GpuStats, faces: dict[str, int]) -> list[dict[str, Any]]:
        """Rows: one per stage, then faces, device and GPU memory."""
        rows: list[dict[str, Any]] = [
            {
                "item": r.stage,
                "value": f"{r.ms:.1f} ms" if r.ms is not None else "-",
                "detail": f"{r.status}, {r.attempts} attempt(s)" if r.attempts else r.status,
            }
            for r in self.records.values()
        ]
        rows += [{"item": f"faces {k}", "value": str(v), "detail": ""} for k, v in faces.items()]
        rows.append({"item": "device", "value": device, "detail": gpu.name or gpu.reason or ""})
        if gpu.available:
            rows.append(
                {
                    "item": "gpu memory",
                    "value": f"{gpu.memory_used_mb:.0f} / {gpu.memory_total_mb:.0f} MB",
                    "detail": f"torch peak {gpu.torch_peak_mb or 0:.0f} MB, "
                    f"utilisation {gpu.utilization_pct or 0:.0f} %",
                }
            )
        return rows

    def _fraction_done(self) -> float:
        done = sum(1 for r in self.records.values() if r.status == "done")
        return 100.0 * done / len(self.stages)

    def _progress(self, value: float, description: str) -> None:
        if self._progress_id is not None:
            _safely(update_progress_artifact, self._progress_id, value, description=description)


def _safely(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Call an artifact function; log and swallow any failure."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:
        logger.warning("Could not publish an operator artifact: %r", exc)
        return None
