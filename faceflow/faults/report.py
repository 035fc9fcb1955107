"""One scenario's outcome, computed from what the client, the receiver and storage saw.

Everything here is pure: ``tally`` takes the submissions, the final job documents (as
``GET /v1/jobs/{id}`` returned them), the webhook deliveries and the result writers found
in storage and Prefect, and returns a ``Tally`` whose ``line()`` is the scenario's row.

Definitions (the must-be-zero columns):

- **late**: jobs not terminal by ``deadline_at + grace`` (still active when observed
  past that time, or ``finished_at`` after it);
- **lost**: accepted jobs that the API no longer knows (404) or that never reached a
  terminal state while observed (until the last deadline + grace + a margin);
- **dup-exec**: jobs with more than one *result writer*: a writer is a flow run whose
  ``store`` task completed, or an attempt whose ``ResultRef`` sidecar exists in storage.
  Both are counted and the larger number per job is used, so a zombie attempt that wrote
  its result after being fenced off is caught even if Prefect never saw it complete;
- **idem**: a replay (same user, same ``Idempotency-Key``) answered with another job;
- **untracked**: jobs the API lists that no answer ever named (a submit committed while
  its response was lost, and not found again by retrying with its key);
- **no-retry-after**: a 429/503 answered without ``Retry-After``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

TERMINAL = frozenset({"succeeded", "failed", "expired", "cancelled"})
EVENT_OF = {
    "succeeded": "job.succeeded",
    "failed": "job.failed",
    "expired": "job.expired",
    "cancelled": "job.cancelled",
}
COLUMNS = (
    "#",
    "scenario",
    "submitted",
    "accepted",
    "rejected (reason)",
    "succeeded",
    "failed (code)",
    "expired",
    "cancelled",
    "late",
    "lost",
    "dup-exec",
    "webhooks exp/deliv/dup",
    "max deadline→end",
    "notes",
)


@dataclass
class Submission:
    """One logical ``POST /v1/jobs`` as the load generator made it (retries included)."""

    kind: str
    user: str
    idempotency_key: str
    replay_of: str | None = None  # idempotency key of the original, for deliberate replays
    status_code: int | None = None
    job_id: str | None = None
    reason: str | None = None
    retry_after: str | None = None
    tries: int = 0
    callback: bool = False
    cancel_status: int | None = None  # what POST /cancel answered, for ``cancel`` kinds

    @property
    def accepted(self) -> bool:
        return self.status_code in (200, 202) and self.job_id is not None


@dataclass(frozen=True)
class Delivery:
    """One webhook POST the receiver answered with 2xx."""

    webhook_id: str
    event: str
    job_id: str
    signature_ok: bool


@dataclass(frozen=True)
class Observation:
    """A job's final document and when it was seen terminal (None: never)."""

    job: Mapping[str, Any] | None  # None: 404 at the end
    late: bool


@dataclass
class Tally:
    """The columns of one scenario's row."""

    number: str
    name: str
    submitted: int = 0
    accepted: int = 0
    replays: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    succeeded: int = 0
    failed: Counter[str] = field(default_factory=Counter)
    expired: int = 0
    cancelled: int = 0
    late: int = 0
    lost: int = 0
    dup_exec: int = 0
    idem_violations: int = 0
    untracked: int = 0
    no_retry_after: int = 0
    webhooks_expected: int = 0
    webhooks_delivered: int = 0
    webhooks_duplicates: int = 0
    webhooks_wrong: int = 0
    bad_signatures: int = 0
    max_over_deadline_s: float | None = None
    notes: list[str] = field(default_factory=list)
    skipped: str | None = None
    detail: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def must_be_zero(self) -> dict[str, int]:
        """The columns that must be zero, by name."""
        return {
            "late": self.late,
            "lost": self.lost,
            "dup_exec": self.dup_exec,
            "idem_violations": self.idem_violations,
            "untracked": self.untracked,
            "no_retry_after": self.no_retry_after,
            "webhooks_missing": max(0, self.webhooks_expected - self.webhooks_delivered),
            "webhooks_wrong": self.webhooks_wrong,
            "bad_signatures": self.bad_signatures,
        }

    @property
    def ok(self) -> bool:
        return self.skipped is not None or not any(self.must_be_zero.values())

    def cells(self) -> list[str]:
        """The row's cells, in ``COLUMNS`` order."""
        if self.skipped is not None:
            return [
                self.number,
                self.name,
                *(["-"] * (len(COLUMNS) - 3)),
                f"skipped: {self.skipped}",
            ]
        accepted = f"{self.accepted}" + (f" ({self.replays} replays)" if self.replays else "")
        webhooks = f"{self.webhooks_expected}/{self.webhooks_delivered}/{self.webhooks_duplicates}"
        over = "-" if self.max_over_deadline_s is None else f"{self.max_over_deadline_s:+.1f} s"
        notes = list(self.notes)
        for name, value in (
            ("idempotency violations", self.idem_violations),
            ("jobs the client never heard of", self.untracked),
            ("429/503 without Retry-After", self.no_retry_after),
            ("webhooks for the wrong event", self.webhooks_wrong),
            ("bad webhook signatures", self.bad_signatures),
        ):
            if value:
                notes.insert(0, f"{name}: {value}")
        return [
            self.number,
            self.name,
            str(self.submitted),
            accepted,
            _counts(self.rejected),
            str(self.succeeded),
            _counts(self.failed),
            str(self.expired),
            str(self.cancelled),
            str(self.late),
            str(self.lost),
            str(self.dup_exec),
            webhooks,
            over,
            "; ".join(notes) or "-",
        ]

    def line(self) -> str:
        """The row as one Markdown table line."""
        return "| " + " | ".join(self.cells()) + " |"


def header() -> str:
    """The table header (two Markdown lines)."""
    return "| " + " | ".join(COLUMNS) + " |\n|" + "|".join("---" for _ in COLUMNS) + "|"


def _counts(counter: Counter[str]) -> str:
    total = sum(counter.values())
    if not total:
        return "0"
    return f"{total} (" + ", ".join(f"{k} {v}" for k, v in sorted(counter.items())) + ")"


def _time(value: str | None) -> datetime | None:
    return None if value is None else datetime.fromisoformat(value.replace("Z", "+00:00"))


def tally(
    *,
    number: str,
    name: str,
    submissions: Sequence[Submission],
    observations: Mapping[str, Observation],
    deliveries: Iterable[Delivery],
    writers: Mapping[str, int],
    notes: Iterable[str] = (),
) -> Tally:
    """Compute a scenario's row.

    ``observations`` maps every accepted job id to what was last seen of it; ``writers``
    maps job ids to their number of result writers (see the module docstring).
    """
    row = Tally(number=number, name=name, notes=list(notes))
    row.submitted = len(submissions)
    first_by_key: dict[tuple[str, str], str] = {}
    for sub in submissions:
        if sub.accepted:
            row.accepted += 1
            assert sub.job_id is not None
            key = (sub.user, sub.replay_of or sub.idempotency_key)
            original = first_by_key.setdefault(key, sub.job_id)
            if original != sub.job_id:
                row.idem_violations += 1
            if sub.replay_of is not None:
                row.replays += 1
        else:
            row.rejected[sub.reason or f"HTTP {sub.status_code}"] += 1
            if sub.status_code in (429, 503) and not sub.retry_after:
                row.no_retry_after += 1
    callback_jobs = {s.job_id for s in submissions if s.accepted and s.callback}
    expected_events: dict[str, str] = {}
    overs: list[float] = []
    for job_id, seen in observations.items():
        job = seen.job
        if job is None or job.get("status") not in TERMINAL:
            row.lost += 1
            row.late += 1
            continue
        if seen.late:
            row.late += 1
        status = str(job["status"])
        if status == "succeeded":
            row.succeeded += 1
        elif status == "failed":
            row.failed[str((job.get("error") or {}).get("code") or "unknown")] += 1
        elif status == "expired":
            row.expired += 1
        else:
            row.cancelled += 1
        finished, deadline = _time(job.get("finished_at")), _time(job.get("deadline_at"))
        if finished is not None and deadline is not None:
            overs.append((finished - deadline).total_seconds())
        if job_id in callback_jobs and EVENT_OF[status] in (job.get("callback_events") or []):
            expected_events[job_id] = EVENT_OF[status]
    row.max_over_deadline_s = max(overs) if overs else None
    row.dup_exec = sum(1 for job_id in observations if writers.get(job_id, 0) > 1)
    row.webhooks_expected = len(expected_events)
    seen_ids: set[str] = set()
    delivered: set[str] = set()
    for d in deliveries:
        if d.job_id not in observations:
            continue  # another scenario's job (a late retry)
        if not d.signature_ok:
            row.bad_signatures += 1
        if d.webhook_id in seen_ids:
            row.webhooks_duplicates += 1
            continue
        seen_ids.add(d.webhook_id)
        if expected_events.get(d.job_id) == d.event:
            delivered.add(d.job_id)
        elif d.event != "job.running":
            row.webhooks_wrong += 1
    row.webhooks_delivered = len(delivered)
    cancels = Counter(
        str(s.cancel_status) for s in submissions if s.kind == "cancel" and s.accepted
    )
    if cancels:
        row.notes.append(
            "cancel answered " + ", ".join(f"{k} x{v}" for k, v in sorted(cancels.items()))
        )
    row.detail = {
        "submissions": [vars(sub) for sub in submissions],
        "jobs": {job_id: seen.job for job_id, seen in observations.items()},
        "late": sorted(job_id for job_id, seen in observations.items() if seen.late),
        "writers": dict(writers),
    }
    return row
