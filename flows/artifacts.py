"""The operator's view of one fuse-faces run (a single job) in the Prefect UI.

A progress artifact names the current stage while the run works; at the end a table
artifact lists per-stage timings, faces found, device and GPU memory, and a markdown
artifact links the result (or states the failure code). Artifact failures are logged and
never fail the job.

Artifacts cost API round trips (≈ 12-20 ms each on a 2-core machine), which a warm worker
pays on every run, so the progress artifact is published by ``DeferredProgress``: a stage
shows up once it has been the current one for ``PROGRESS_DELAY_S`` (from a timer thread,
off the flow's path), fast stages in between are coalesced, and the final value is written
when the run ends. A run that finishes within the delay writes its progress artifact once,
already final: three artifact calls per run instead of ten, and those three are written
one after another (on a SQLite Prefect server concurrent writers only contend for its
lock) right after the engine has recorded the run's final state, before the flow call
returns (see ``OperatorView.publish``): written beside it, they delayed the final state on
a busy server, and with it the relay's notice of the job's end (a batch's artifacts,
``flows.batch_view``, are still written beside its final state).
Stage-by-stage detail stays in the run's logs, its task runs and the final table. The
relay's sync reads the progress description (``Stage i/n: <stage> ...``) of running runs,
so a job's ``stage`` can lag by up to the delay; on success the relay records the last
stage itself.
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any
from uuid import UUID

from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.actions import ArtifactCreate, ArtifactUpdate
from prefect.client.schemas.objects import FlowRun
from prefect.context import FlowRunContext
from prefect.states import State

from tasks.gpu import GpuStats
from tasks.report import QualityReport

if TYPE_CHECKING:
    from flows.run import Job

logger = logging.getLogger("faceflow.flows.artifacts")

PROGRESS_DELAY_S = 0.5
"""How long a stage must be the current one before the progress artifact names it."""
FINISH_TIMEOUT_S = 30.0
"""How long a run's final state hooks wait for its last artifacts to be written."""

UNHOOKED_PUBLISH_S = 5.0
"""How long final artifacts held for the final state wait for a state hook that may never
run (a final state the server refused: the run was cancelled meanwhile) before they are
written anyway."""


@dataclass
class _Finishing:
    """The thread writing a run's final artifacts, and the signal it waits for."""

    thread: threading.Thread
    go: threading.Event


_FINISHING: dict[UUID, _Finishing] = {}
"""Flow-run id → the writer of that run's final artifacts (``publish_at_end``)."""


def artifact_key(job_id: str, kind: str) -> str:
    """A valid artifact key (lowercase letters, digits, dashes) for a job."""
    slug = re.sub(r"[^a-z0-9-]+", "-", job_id.lower()).strip("-") or "job"
    return f"fuse-{slug}-{kind}"


class DeferredProgress:
    """One run's progress artifact, written at most once per ``delay_s`` while the run
    works (from a timer thread) and once more, synchronously, when it ends.

    ``show`` records the latest value and description; a timer started by the first
    unpublished change writes whatever is latest when it fires (creating the artifact the
    first time). ``close`` cancels a pending timer and writes the final value; a write
    already in flight finishes first, and none lands after the final one.
    """

    def __init__(
        self,
        client: SyncPrefectClient,
        flow_run_id: UUID,
        key: str,
        delay_s: float = PROGRESS_DELAY_S,
    ) -> None:
        self.client, self.flow_run_id, self.key, self.delay_s = client, flow_run_id, key, delay_s
        self.artifact_id: UUID | None = None
        self.writes = 0
        self._pending: tuple[float, str] | None = None
        self._timer: threading.Timer | None = None
        self._closed = False
        self._lock = threading.Lock()  # guards _pending and _timer
        self._write_lock = threading.Lock()  # orders writes; guards _closed

    def show(self, value: float, description: str) -> None:
        """Make ``value`` / ``description`` the latest progress; written within ``delay_s``."""
        with self._lock:
            self._pending = (value, description)
            if self._timer is None and not self._closed:
                self._timer = threading.Timer(self.delay_s, in_this_context(self._flush))
                self._timer.daemon = True
                self._timer.start()

    def close(self, value: float, description: str) -> None:
        """Write the final progress now; later ``show`` calls are ignored."""
        with self._lock:
            timer, self._timer, self._pending = self._timer, None, None
        if timer is not None:
            timer.cancel()
        with self._write_lock:
            self._closed = True
            self._write(value, description)

    def _flush(self) -> None:
        with self._lock:
            pending, self._pending, self._timer = self._pending, None, None
        if pending is None:
            return
        with self._write_lock:
            if not self._closed:
                self._write(*pending)

    def _write(self, value: float, description: str) -> None:
        try:
            if self.artifact_id is None:
                created = self.client.create_artifact(
                    ArtifactCreate(
                        key=self.key,
                        type="progress",
                        description=description,
                        data=value,
                        flow_run_id=self.flow_run_id,
                    )
                )
                self.artifact_id = created.id
            else:
                update = ArtifactUpdate(data=value, description=description)
                self.client.update_artifact(self.artifact_id, update)
            self.writes += 1
        except Exception as exc:
            logger.warning("Could not publish the progress artifact: %r", exc)


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
    progress: DeferredProgress | None = None

    def __post_init__(self) -> None:
        self.records = {s: StageRecord(s) for s in self.stages}

    def start(self) -> None:
        """Set up the progress artifact of this flow run (written later, see the module)."""
        self.progress = start_progress(artifact_key(self.job_id, "progress"))
        self._progress(0.0, f"Job {self.job_id} attempt {self.attempt}: starting.")

    def stage_started(self, stage: str, live: int = 1) -> None:
        """Name ``stage`` as the current one (``live``: the run's one job)."""
        self.records[stage].status = "running"
        index = list(self.stages).index(stage)
        self._progress(
            100.0 * index / len(self.stages),
            f"Stage {index + 1}/{len(self.stages)}: {stage} (attempt {self.attempt}).",
        )

    def stage_skipped(self, stage: str) -> None:
        """Record that the settings turned ``stage`` off for this run."""
        self.records[stage].status = "skipped"

    def stage_finished(self, stage: str, ms: float, attempts: int, ok: bool) -> None:
        """Record a stage's outcome."""
        record = self.records[stage]
        record.status, record.ms, record.attempts = ("done" if ok else "failed"), ms, attempts

    def finish(self, jobs: Sequence[Job], *, device: str, gpu: GpuStats) -> None:
        """``publish`` the outcome of the run's one job."""
        (job,) = jobs
        detections, ref = job.work.detections, job.ref
        faces = {}
        if detections is not None:
            faces = {
                "source": detections.source_count,
                "target": detections.target_count,
                "replaced": len(detections.target_faces),
            }
        self.publish(
            outcome=job.outcome,
            device=device,
            gpu=gpu,
            faces=faces,
            result_key=ref.key if ref is not None and job.outcome == "succeeded" else None,
            result_uri=job.work.location,
            quality=job.work.report,
            marks=job.work.marks if job.outcome == "succeeded" else None,
        )

    def publish(
        self,
        *,
        outcome: str,
        device: str,
        gpu: GpuStats,
        faces: dict[str, int],
        result_key: str | None = None,
        result_uri: str | None = None,
        quality: QualityReport | None = None,
        marks: list[str] | None = None,
    ) -> None:
        """Close the progress bar and publish the table and markdown artifacts.

        In a flow run they are written by a thread (with this run's context) once the
        engine has recorded the final state, so that the state (and the relay's notice of
        it) does not queue behind them on the server; the run's state hooks start and wait
        for it (``wait_for_operator_view``), so they are in place when the flow call
        returns.
        """
        done = outcome == "succeeded"
        progress = (100.0 if done else self._fraction_done(), f"Finished: {outcome}.")
        table = self.table(device=device, gpu=gpu, faces=faces)
        lines = [f"# Job `{self.job_id}`, attempt {self.attempt}: {outcome}", ""]
        if result_key is not None:
            link = f"[`{result_key}`]({result_uri})" if result_uri else f"`{result_key}`"
            lines.append(f"Result: {link}")
        else:
            lines.append(f"Outcome: `{outcome}`")
        if marks is not None:
            lines += ["", marked_line(marks)]
        if quality is not None:
            lines += ["", *quality_markdown(quality)]

        def publish() -> None:
            if self.progress is not None:
                self.progress.close(*progress)
            safely(
                create_table_artifact,
                table=table,
                key=artifact_key(self.job_id, "timings"),
                description=f"Job {self.job_id} attempt {self.attempt}: stage timings and device.",
            )
            safely(
                create_markdown_artifact,
                markdown="\n".join(lines),
                key=artifact_key(self.job_id, "result"),
                description=f"Job {self.job_id} attempt {self.attempt}: result.",
            )

        publish_at_end(self.progress, publish, after_final_state=True)

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
        done = sum(1 for r in self.records.values() if r.status in ("done", "skipped"))
        return 100.0 * done / len(self.stages)

    def _progress(self, value: float, description: str) -> None:
        if self.progress is not None:
            self.progress.show(value, description)


def publish_at_end(
    progress: DeferredProgress | None,
    publish: Callable[[], None],
    *,
    after_final_state: bool = False,
) -> None:
    """Run ``publish`` (the final artifacts) in a thread with this run's context, at once
    (while the engine records the run's final state) or, ``after_final_state``, when the
    final state is recorded (its state hook runs; after ``UNHOOKED_PUBLISH_S`` without
    one); ``wait_for_operator_view`` joins it. Without a flow run (no progress artifact)
    it runs here and now."""
    if progress is None:
        publish()
        return
    go = threading.Event()
    if not after_final_state:
        go.set()

    def when_due() -> None:
        go.wait(UNHOOKED_PUBLISH_S)
        publish()

    thread = threading.Thread(
        target=in_this_context(when_due), name="faceflow-operator-view", daemon=True
    )
    for run_id, old in list(_FINISHING.items()):  # runs whose hooks never ran
        if not old.thread.is_alive():
            _FINISHING.pop(run_id, None)
    _FINISHING[progress.flow_run_id] = _Finishing(thread, go)
    thread.start()


def start_progress(key: str) -> DeferredProgress | None:
    """The deferred progress artifact of the current flow run (None outside a flow run)."""
    run = FlowRunContext.get()
    if run is None or run.flow_run is None:
        logger.warning("No flow run: the operator view publishes no progress.")
        return None
    return DeferredProgress(get_client(sync_client=True), run.flow_run.id, key)


def quality_markdown(report: QualityReport) -> list[str]:
    """Markdown lines of a quality report: a summary, then the whole report as JSON."""

    def fmt(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    settings = report.settings
    return [
        "## Quality",
        "",
        f"- identity similarity to the source: {fmt(report.source_similarity)}, "
        f"to the target: {fmt(report.target_similarity)} ({report.identity_model}; "
        "0.5 is the same-person threshold)",
        f"- faces lost: {report.faces_lost}; pose mismatch: {report.pose_mismatch}",
        f"- settings: {settings.fuser}, identity weight {settings.identity_weight:g}, "
        f"{settings.blend} blend ({len(report.attempts)} attempt(s)"
        + (f", floor {report.min_identity:g}" if report.min_identity is not None else "")
        + ")",
        "",
        "```json",
        json.dumps(report.as_json(), indent=2),
        "```",
    ]


def in_this_context(fn: Callable[[], None]) -> Callable[[], None]:
    """``fn``, to be called from another thread in a copy of this context: the flow run's
    context and Prefect's settings travel with it. Where those settings live only in a
    context (``temporary_settings``: tests, in-process runs), a bare thread would use the
    process defaults, and Prefect would start a temporary server for the artifact's event."""
    return partial(contextvars.copy_context().run, fn)


MARK_NAMES = {"c2pa": "signed C2PA Content Credentials", "watermark": "invisible watermark"}


def marked_line(marks: list[str], *, video: bool = False) -> str:
    """The artifacts' "Marked:" line for a result's marks (``ResultRef.marks``)."""
    names = (
        {**MARK_NAMES, "watermark": "invisible watermark in every frame"} if video else MARK_NAMES
    )
    said = ", ".join(names.get(m, m) for m in marks) or "no (marking is off)"
    return f"Marked: {said}"


def publish_video_result(
    job_id: str, attempt: int, key: str, marks: list[str], facts: list[str]
) -> None:
    """The markdown artifact of a succeeded video job attempt (as a photo job's): its
    result, how it is marked, and ``facts`` (one line each)."""
    lines = [
        f"# Video job `{job_id}`, attempt {attempt}: succeeded",
        "",
        f"Result: `{key}`",
        "",
        marked_line(marks, video=True),
        "",
        *(f"- {fact}" for fact in facts),
    ]
    safely(
        create_markdown_artifact,
        markdown="\n".join(lines),
        key=artifact_key(job_id, "result"),
        description=f"Video job {job_id} attempt {attempt}: result.",
    )


def safely(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Call an artifact function; log and swallow any failure."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:
        logger.warning("Could not publish an operator artifact: %r", exc)
        return None


def wait_for_operator_view(flow: object, flow_run: FlowRun, state: State[Any]) -> None:
    """Flow state hook: let this run's final artifacts be written and wait until they are
    (a no-op when the run published none)."""
    finishing = _FINISHING.pop(flow_run.id, None)
    if finishing is not None:
        finishing.go.set()
        finishing.thread.join(FINISH_TIMEOUT_S)
        if finishing.thread.is_alive():
            logger.warning("Final artifacts of flow run %s still unwritten", flow_run.id)
