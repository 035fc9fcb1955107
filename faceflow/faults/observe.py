"""Watching a scenario's jobs to their end, and finding who wrote results.

``settle`` polls every accepted job through the API (as its owner) until all are terminal
and the expected webhooks have arrived, or until the last deadline + grace + a margin.
``result_writers`` counts, per job, the flow runs whose ``store`` task completed (Prefect)
and the attempts whose ``ResultRef`` sidecar exists (storage), and keeps the larger.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx

from faceflow.faults.load import Client, User
from faceflow.faults.report import TERMINAL, Observation, Submission
from flows.params import STAGE_LINE, result_meta_key
from webapi.storage import ObjectStore

POLL_S = 1.0
MARGIN_S = 15.0


def parse_time(value: str | None) -> datetime | None:
    """A job document's timestamp (ISO 8601, ``Z`` allowed), or None."""
    return None if value is None else datetime.fromisoformat(value.replace("Z", "+00:00"))


def settle(
    client: Client,
    users: Mapping[str, User],
    submissions: Sequence[Submission],
    *,
    grace_s: float,
    webhooks_done: Callable[[Mapping[str, Mapping[str, Any]]], bool] | None = None,
    webhook_wait_s: float = 0.0,
) -> dict[str, Observation]:
    """Poll the accepted jobs to their end; returns each job's ``Observation``."""
    owner = {s.job_id: users[s.user] for s in submissions if s.accepted and s.job_id}
    latest: dict[str, dict[str, Any] | None] = {}
    late: set[str] = set()
    started = datetime.now(UTC)
    give_up = started + timedelta(hours=1)
    terminal_at: datetime | None = None
    while True:
        now = datetime.now(UTC)
        for job_id, user in owner.items():
            job = latest.get(job_id)
            if job is not None and job.get("status") in TERMINAL:
                continue
            try:
                latest[job_id] = client.get_job(user, job_id)
            except httpx.HTTPError:
                continue  # the API is down or busy: keep the last view
        for job_id in owner:
            job = latest.get(job_id)
            if job is None:
                continue
            deadline = parse_time(job.get("deadline_at"))
            if deadline is None:
                continue
            limit = deadline + timedelta(seconds=grace_s)
            finished = parse_time(job.get("finished_at"))
            if (job.get("status") not in TERMINAL and now > limit) or (
                finished is not None and finished > limit
            ):
                late.add(job_id)
        deadlines = [parse_time((j or {}).get("deadline_at")) for j in latest.values()]
        last_deadline = max((d for d in deadlines if d is not None), default=started)
        give_up = min(give_up, last_deadline + timedelta(seconds=grace_s + MARGIN_S))
        all_ended = len(latest) == len(owner) and all(
            j is not None and j.get("status") in TERMINAL for j in latest.values()
        )
        if all_ended and terminal_at is None:
            terminal_at = now
        if all_ended:
            ended = {k: v for k, v in latest.items() if v is not None}
            waited = (now - (terminal_at or now)).total_seconds()
            if webhooks_done is None or webhooks_done(ended) or waited > webhook_wait_s:
                break
        elif now > give_up:
            break
        time.sleep(POLL_S)
    return {job_id: Observation(latest.get(job_id), job_id in late) for job_id in owner}


Headers = Mapping[str, str]


def _post(
    prefect_api: str, path: str, body: dict[str, Any], headers: Headers
) -> list[dict[str, Any]]:
    for attempt in range(5):
        try:
            response = httpx.post(f"{prefect_api}{path}", json=body, headers=headers, timeout=30)
            response.raise_for_status()
            return list(response.json())
        except httpx.HTTPError:
            if attempt == 4:
                raise
            time.sleep(2)
    return []


def prefect_writers(
    prefect_api: str, job_ids: Iterable[str], headers: Headers | None = None
) -> dict[str, int]:
    """Per job: flow runs whose ``store`` stage completed for it (a completed ``store``
    task run, or the run's log line of an inline ``store``: ``inline_stages``). A
    ``fuse-faces`` run is named by its job id; a ``fuse-batch`` run is tagged ``job:<id>``
    for each job it carried and counts for the jobs its per-job table artifact says it
    stored. ``headers``: the API's credential (``webapi.prefect_api.auth_headers``)."""
    headers = headers or {}
    ids = sorted(set(job_ids))
    runs: dict[str, dict[str, Any]] = {}
    for start in range(0, len(ids), 100):
        chunk = ids[start : start + 100]
        for body in (
            {"flow_runs": {"name": {"any_": chunk}}, "limit": 200},
            {"flow_runs": {"tags": {"any_": [f"job:{j}" for j in chunk]}}, "limit": 200},
        ):
            runs.update(
                {run["id"]: run for run in _post(prefect_api, "/flow_runs/filter", body, headers)}
            )
    found: dict[str, int] = dict.fromkeys(ids, 0)
    run_ids = sorted(runs)
    for start in range(0, len(run_ids), 100):
        chunk = run_ids[start : start + 100]
        stores = _post(
            prefect_api,
            "/task_runs/filter",
            {
                "flow_runs": {"id": {"any_": chunk}},
                "task_runs": {
                    "name": {"any_": ["store"]},
                    "state": {"type": {"any_": ["COMPLETED"]}},
                },
                "limit": 200,
            },
            headers,
        )
        inline = inline_stages(prefect_api, chunk, headers)
        stored = {task["flow_run_id"] for task in stores}
        stored |= {run_id for run_id, stages in inline.items() if "store" in stages}
        for run_id in stored:
            for job_id in _stored_by(prefect_api, runs[run_id], headers):
                if job_id in found:
                    found[job_id] += 1
    return found


def inline_stages(
    prefect_api: str, run_ids: Sequence[str], headers: Headers | None = None
) -> dict[str, set[str]]:
    """Per flow run: the stages it ran inline and finished (``flows.deadline.STAGE_LINE``
    log lines with ``done``; a run whose stages are task runs logs none)."""
    done: dict[str, set[str]] = {run_id: set() for run_id in run_ids}
    for start in range(0, len(run_ids), 50):
        chunk = list(run_ids[start : start + 50])
        offset = 0
        while True:
            body = {
                "logs": {"flow_run_id": {"any_": chunk}, "text": {"query": "attempt"}},
                "limit": 200,
                "offset": offset,
            }
            logs = _post(prefect_api, "/logs/filter", body, headers or {})
            for log in logs:
                line = STAGE_LINE.match(str(log.get("message", "")))
                if line is not None and line["how"] == "done" and log.get("flow_run_id"):
                    done.setdefault(str(log["flow_run_id"]), set()).add(line["stage"])
            if len(logs) < 200:
                break
            offset += len(logs)
    return done


def _stored_by(prefect_api: str, run: dict[str, Any], headers: Headers) -> list[str]:
    """The jobs a run whose store task completed stored a result for."""
    if "batch" not in (run.get("tags") or []):
        return [str(run["name"])]
    tables = _post(
        prefect_api,
        "/artifacts/filter",
        {"artifacts": {"flow_run_id": {"any_": [run["id"]]}, "type": {"any_": ["table"]}}},
        headers,
    )
    stored: list[str] = []
    for table in tables:
        rows = table.get("data")
        rows = json.loads(rows) if isinstance(rows, str) else rows
        stored += [str(row["job"]) for row in rows or [] if row.get("outcome") == "succeeded"]
    return stored


def storage_writers(
    store: ObjectStore, jobs: Mapping[str, Mapping[str, Any] | None], max_attempts: int = 4
) -> dict[str, int]:
    """Per job: attempts whose ``ResultRef`` sidecar exists in storage."""
    found = {}
    for job_id, job in jobs.items():
        attempts = max(int((job or {}).get("attempts") or 0), 1) + max_attempts
        found[job_id] = sum(
            1 for n in range(1, attempts + 1) if store.exists(result_meta_key(job_id, n))
        )
    return found


def result_writers(
    prefect_api: str,
    store: ObjectStore,
    observations: Mapping[str, Observation],
    headers: Headers | None = None,
) -> tuple[dict[str, int], list[str]]:
    """Writers per job (the larger of Prefect's and storage's count) and any notes."""
    notes: list[str] = []
    jobs = {job_id: seen.job for job_id, seen in observations.items()}
    stored = storage_writers(store, jobs)
    try:
        ran = prefect_writers(prefect_api, jobs, headers)
    except httpx.HTTPError as exc:
        ran = {}
        notes.append(f"Prefect not readable for dup-exec ({type(exc).__name__}): storage only")
    writers = {job_id: max(stored.get(job_id, 0), ran.get(job_id, 0)) for job_id in jobs}
    dups = sorted(job_id for job_id, n in writers.items() if n > 1)
    if dups:
        notes.append("jobs with >1 result writer: " + ", ".join(dups[:3]))
    return writers, notes
