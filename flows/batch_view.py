"""The operator's view of one ``fuse-batch`` run in the Prefect UI.

While the run works, one progress artifact names the stage and how many jobs are still
in it (``Stage i/n: <stage> (k of K jobs).``, the form the relay's sync reads for each
job's ``stage``). At the end one table artifact lists every job the run carried: its
attempt, outcome (``succeeded`` or the error code, ``stopped`` when the relay ended it
early), the stage it reached, its time in each stage and its result; a markdown artifact
sums the run up. An operator with a job id finds the run by the tag ``job:<id>`` and the
job's row in the table. The artifacts are written as ``flows.artifacts`` writes a single
job's (deferred progress, final artifacts beside the final state).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prefect.artifacts import create_markdown_artifact, create_table_artifact

from flows.artifacts import DeferredProgress, artifact_key, publish_at_end, safely, start_progress
from tasks.gpu import GpuStats

if TYPE_CHECKING:
    from flows.run import Job


@dataclass
class JobRow:
    """What the table shows for one job of the batch."""

    job_id: str
    attempt: int
    outcome: str = "pending"
    stage: str = "queued"
    timings_ms: dict[str, float] = field(default_factory=dict)
    result_key: str | None = None
    result_uri: str | None = None

    def as_row(self, stages: Sequence[str]) -> dict[str, Any]:
        """The table row (stage columns in ms, blank where the job did not get)."""
        row: dict[str, Any] = {
            "job": self.job_id,
            "attempt": self.attempt,
            "outcome": self.outcome,
            "stage": self.stage,
            "total_ms": round(sum(self.timings_ms.values()), 1),
        }
        for stage in stages:
            ms = self.timings_ms.get(stage)
            row[f"{stage}_ms"] = round(ms, 1) if ms is not None else ""
        row["result"] = self.result_uri or self.result_key or ""
        return row


@dataclass
class BatchView:
    """Progress and per-job outcome of one batch run, published as artifacts."""

    rows: list[JobRow]
    stages: Sequence[str]
    progress: DeferredProgress | None = None

    @property
    def key(self) -> str:
        """Artifact key stem: the first job's id (the run is named after it too)."""
        return artifact_key(self.rows[0].job_id, "batch")

    def start(self) -> None:
        """Set up the progress artifact (written later, see ``flows.artifacts``)."""
        self.progress = start_progress(f"{self.key}-progress")
        self._show(0.0, f"Batch of {len(self.rows)} jobs: starting.")

    def stage_started(self, stage: str, live: int) -> None:
        """Name ``stage`` as the current one, with how many jobs are still in the run."""
        index = list(self.stages).index(stage)
        self._show(
            100.0 * index / len(self.stages),
            f"Stage {index + 1}/{len(self.stages)}: {stage} ({live} of {len(self.rows)} jobs).",
        )

    def stage_finished(self, stage: str, ms: float, attempts: int, ok: bool) -> None:
        """Nothing to show: the table gives each job's time per stage at the end."""

    def stage_skipped(self, stage: str) -> None:
        """Nothing to show: a skipped stage's column stays blank."""

    def finish(self, jobs: Sequence[Job], *, device: str, gpu: GpuStats) -> None:
        """Close the progress bar and publish the per-job table and the summary."""
        for row, job in zip(self.rows, jobs, strict=True):
            row.outcome, row.stage = job.outcome, job.stage
            row.timings_ms = dict(job.work.timings_ms)
            row.result_key = job.ref.key if job.ref is not None else None
            row.result_uri = job.work.location
        counts: dict[str, int] = {}
        for row in self.rows:
            counts[row.outcome] = counts.get(row.outcome, 0) + 1
        summary = ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items()))
        table = [row.as_row(self.stages) for row in self.rows]
        lines = [f"# Batch of {len(self.rows)} jobs: {summary}", "", f"Device: `{device}`"]
        if gpu.available:
            lines.append(f"GPU: {gpu.name}, {gpu.memory_used_mb:.0f} MB used")
        lines += ["", "| job | outcome | result |", "|---|---|---|"]
        for row in self.rows:
            link = f"[`{row.result_key}`]({row.result_uri})" if row.result_uri else "-"
            lines.append(f"| `{row.job_id}` | {row.outcome} | {link} |")
        progress = self.progress

        def publish() -> None:
            if progress is not None:
                progress.close(100.0, f"Finished: {summary}.")
            safely(
                create_table_artifact,
                table=table,
                key=f"{self.key}-jobs",
                description=f"Batch of {len(self.rows)} jobs: outcome and stage timings per job.",
            )
            safely(
                create_markdown_artifact,
                markdown="\n".join(lines),
                key=f"{self.key}-result",
                description=f"Batch of {len(self.rows)} jobs: {summary}.",
            )

        publish_at_end(progress, publish)

    def _show(self, value: float, description: str) -> None:
        if self.progress is not None:
            self.progress.show(value, description)
