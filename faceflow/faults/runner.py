"""Run the fault matrix: start the stack, warm it up, run the scenarios, print the rows."""

from __future__ import annotations

import json
import platform
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from faceflow.faults.harness import Database, Harness, harness
from faceflow.faults.load import body_for
from faceflow.faults.observe import settle
from faceflow.faults.report import Submission, Tally, header
from faceflow.faults.scenarios import SCENARIOS, Profile


class FaultSuiteError(RuntimeError):
    """The stack could not be brought to a state where scenarios mean anything."""


@dataclass
class Run:
    """A finished run: its rows and what it ran on."""

    profile: str
    database: str
    worker_type: str
    rows: list[Tally] = field(default_factory=list)
    started_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(row.ok for row in self.rows)

    def machine(self) -> str:
        import os

        return f"{os.cpu_count()} CPU cores, {platform.machine()}, {platform.python_version()}"


def warm_up(h: Harness, profile: Profile) -> float:
    """One job through the whole stack; ``FaultSuiteError`` unless it succeeds."""
    user = h.users[0]
    sub = Submission(kind="good", user=user.name, idempotency_key=f"warm-{uuid.uuid4().hex[:8]}")
    started = time.monotonic()
    body = body_for("good", callback_url=None, deadline_s=180, queue_timeout_s=120)
    h.client.submit(sub, user, body, retry_for_s=60)
    if not sub.accepted:
        raise FaultSuiteError(f"warm-up job not accepted: {sub.reason}")
    seen = settle(h.client, h.users_by_name, [sub], grace_s=profile.grace_s)
    job = next(iter(seen.values())).job
    if job is None or job["status"] != "succeeded":
        raise FaultSuiteError(f"warm-up job did not succeed: {job}")
    h.known_jobs.add(str(job["id"]))
    return time.monotonic() - started


def _save(path: Path, result: Run) -> None:
    """Every row with its jobs and submissions, for looking into a run afterwards."""
    document = {
        "profile": result.profile,
        "database": result.database,
        "worker_type": result.worker_type,
        "started_at": result.started_at.isoformat(),
        "rows": [{"line": row.line(), **row.detail} for row in result.rows],
    }
    path.write_text(json.dumps(document, indent=1, default=str))


def run(
    profile: Profile,
    *,
    only: Iterable[str] | None = None,
    database: Database = "sqlite",
    worker_type: str = "faceflow-gpu",
    home: Path | None = None,
    out: Callable[[str], None] = print,
    progress: Callable[[str], None] | None = None,
) -> Run:
    """Run the scenarios (all, or the numbers in ``only``) and print one row each."""
    wanted = [n for n in SCENARIOS if only is None or n in set(only)]
    result = Run(profile=profile.name, database=database, worker_type=worker_type)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="faceflow-faults-") as tmp:
        where = home.resolve() if home is not None else Path(tmp) / "home"
        with (
            harness(
                where,
                users=profile.users,
                quota=profile.quota,
                database=database,
                worker_type=worker_type,
                progress=progress,
            ) as h,
            h.watchdog(),
        ):
            took = warm_up(h, profile)
            out(
                f"faults: profile {profile.name}, job store {database}, worker {worker_type}, "
                f"warm-up job {took:.1f} s, home {where}"
            )
            out(header())
            for number in wanted:
                row = SCENARIOS[number](h, profile)
                h.receiver.set_mode("up")
                result.rows.append(row)
                out(row.line())
                _save(where / "faults-report.json", result)
    result.seconds = time.monotonic() - started
    out(f"faults: {'OK' if result.ok else 'FAILED'} in {result.seconds:.0f} s")
    return result
