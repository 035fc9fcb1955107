"""The fault matrix: one function per scenario, each returning its ``Tally`` row.

Every scenario runs a mixed load (``faceflow.faults.load``) against the running stack while
injecting one fault, then ``finish`` watches every accepted job to its end, collects the
webhooks and the result writers, and computes the row. ``Profile`` sizes the load and the
outages: ``SHORT`` for ``make test``, ``FULL`` on demand.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import httpx

from faceflow.faults.harness import WORKER, Harness, restart_postgres
from faceflow.faults.load import Load, LoadSpec, body_for, fire_together
from faceflow.faults.observe import parse_time, result_writers, settle
from faceflow.faults.report import EVENT_OF, Observation, Submission, Tally, tally
from faceflow.testing.wait import poll

# The grace after a deadline within which every job must be terminal: the relay reaps a
# run still going at deadline + 30 s (RelayTimings.running_grace_s), plus a pass or two.
GRACE_S = 45.0


@dataclass(frozen=True)
class Profile:
    """Sizes of one run (seconds unless named otherwise)."""

    name: str
    users: int
    jobs: int
    interval_s: float
    deadline_s: int
    queue_timeout_s: int
    worker_outage_s: float
    prefect_outage_s: float
    webapi_outage_s: float
    receiver_down_s: float
    receiver_error_s: float
    webhook_jobs: int
    webhook_wait_s: float
    hang_deadline_s: int
    jobs_behind_hang: int
    burst_users: int
    burst_extra: int
    postgres_restart: bool
    grace_s: float = GRACE_S
    duplicates: int = 20
    quota: int = 10

    def spec(self, **changes: Any) -> LoadSpec:
        base = LoadSpec(
            jobs=self.jobs,
            interval_s=self.interval_s,
            deadline_s=self.deadline_s,
            queue_timeout_s=self.queue_timeout_s,
        )
        return replace(base, **changes)


def _short_and_full(**sizes: tuple[Any, Any]) -> tuple[Profile, Profile]:
    """The two profiles from each size's (short, full) pair."""
    short = Profile(name="short", **{field: pair[0] for field, pair in sizes.items()})
    full = Profile(name="full", **{field: pair[1] for field, pair in sizes.items()})
    return short, full


SHORT, FULL = _short_and_full(
    users=(2, 8),
    jobs=(5, 16),
    interval_s=(0.5, 2.0),
    deadline_s=(30, 120),
    queue_timeout_s=(25, 60),
    worker_outage_s=(3, 10),
    prefect_outage_s=(8, 30),
    webapi_outage_s=(3, 10),
    receiver_down_s=(4, 60),
    receiver_error_s=(4, 30),
    webhook_jobs=(2, 6),
    webhook_wait_s=(90, 300),
    hang_deadline_s=(12, 30),
    jobs_behind_hang=(1, 3),
    burst_users=(2, 8),
    burst_extra=(2, 5),
    postgres_restart=(False, True),
)


# --------------------------------------------------------------------------- common


def finish(
    h: Harness,
    p: Profile,
    *,
    number: str,
    name: str,
    submissions: Sequence[Submission],
    notes: Iterable[str] = (),
    webhook_wait_s: float | None = None,
    note_of: Callable[[Mapping[str, Observation]], str] | None = None,
) -> Tally:
    """Watch the scenario's jobs to their end and compute its row (``note_of`` adds a
    note made from what was seen of the jobs)."""
    owners = {s.job_id: s.user for s in submissions if s.accepted and s.job_id}

    def webhooks_done(jobs: Mapping[str, Mapping[str, Any]]) -> bool:
        wanted = {
            job_id
            for job_id, job in jobs.items()
            if job.get("callback_url") and EVENT_OF[str(job["status"])] in job["callback_events"]
        }
        got = {d.job_id for d in h.receiver.deliveries(h.secrets, owners)}
        return wanted <= got

    observations = settle(
        h.client,
        h.users_by_name,
        submissions,
        grace_s=p.grace_s,
        webhooks_done=webhooks_done,
        webhook_wait_s=p.webhook_wait_s if webhook_wait_s is None else webhook_wait_s,
    )
    writers, writer_notes = result_writers(h.prefect_api, h.store, observations, h.prefect_headers)
    listed: set[str] = set()
    for user in h.users_by_name.values():
        listed |= h.client.job_ids(user)
    untracked = listed - h.known_jobs - set(observations)
    h.known_jobs |= listed | set(observations)
    row = tally(
        number=number,
        name=name,
        submissions=submissions,
        observations=observations,
        deliveries=h.receiver.deliveries(h.secrets, owners),
        writers=writers,
        notes=[*notes, *writer_notes, *h.take_restarts()],
    )
    if note_of is not None:
        row.notes.append(note_of(observations))
    row.untracked = len(untracked)
    return row


def wait_until(check: Callable[[], bool], timeout_s: float) -> bool:
    """Poll ``check`` every 0.3 s until it is true or ``timeout_s`` passes; whether it
    became true (an HTTP error counts as not yet)."""
    return poll(check, timeout_s, step_s=0.3, ignore=(httpx.HTTPError,))


def running_job(h: Harness, load: Load) -> str | None:
    """An accepted job of ``load`` that is running now, if any."""
    users = h.users_by_name
    for sub in list(load.submissions):
        if sub.accepted and sub.job_id and sub.kind in ("good", "callback"):
            job = h.client.get_job(users[sub.user], sub.job_id)
            if job is not None and job["status"] == "running":
                return sub.job_id
    return None


def _answered(load: Load, n: int) -> Callable[[], bool]:
    return lambda: len(load.submissions) >= n or load.done.is_set()


def _load(h: Harness, spec: LoadSpec, label: str, **kwargs: Any) -> Load:
    return Load(h.client, spec, callback_url=h.receiver.url, label=label, **kwargs)


# --------------------------------------------------------------------------- scenarios


def worker_sigkill(h: Harness, p: Profile) -> Tally:
    """1: SIGKILL the worker (and its flow-run children) while a job runs; restart it."""
    load = _load(h, p.spec(), "s1").start()
    notes = []
    victim: list[str | None] = [None]

    def find() -> bool:
        victim[0] = running_job(h, load)
        return victim[0] is not None

    if wait_until(find, timeout_s=60):
        notes.append(f"SIGKILL while job {str(victim[0])[:8]} ran")
    else:
        notes.append("no job was running within 60 s: killed anyway")
    h.take_down(WORKER, kill=True)
    time.sleep(p.worker_outage_s)
    h.bring_up(WORKER)
    return finish(
        h, p, number="1", name="worker SIGKILL mid-job", submissions=load.wait(), notes=notes
    )


def prefect_outage(h: Harness, p: Profile) -> Tally:
    """2: stop the Prefect server during submissions for ``prefect_outage_s``; restart it."""
    load = _load(h, p.spec(), "s2").start()
    wait_until(_answered(load, max(1, p.jobs // 3)), timeout_s=120)
    h.take_down("prefect-server")
    time.sleep(p.prefect_outage_s)
    h.bring_up("prefect-server")
    took = h.wait_prefect()
    notes = [f"Prefect down {p.prefect_outage_s:.0f} s, healthy {took:.1f} s after restart"]
    return finish(
        h, p, number="2", name="Prefect server down", submissions=load.wait(), notes=notes
    )


def webapi_kill(h: Harness, p: Profile) -> Tally:
    """3: SIGKILL the webapi (and its in-process relay) right after a submit was accepted,
    while the relay is dispatching it; restart it after ``webapi_outage_s``."""
    killed = threading.Event()
    notes: list[str] = []

    def on_submitted(sub: Submission) -> None:
        if sub.accepted and sub.kind != "dup" and not killed.is_set():
            killed.set()
            h.take_down("webapi", kill=True)
            notes.append(f"SIGKILL right after the 202 of job {str(sub.job_id)[:8]}")
            threading.Thread(target=restart, daemon=True).start()

    def restart() -> None:
        time.sleep(p.webapi_outage_s)
        h.bring_up("webapi")
        notes.append(f"webapi back {h.wait_api():.1f} s after restart")

    load = _load(h, p.spec(interval_s=p.interval_s / 2), "s3", on_submitted=on_submitted)
    subs = load.start().wait()
    wait_until(lambda: h.service("webapi").alive() and "webapi back" in " ".join(notes), 120)
    retried = sum(1 for s in subs if s.tries > 1)
    notes.append(f"{retried} submissions retried through the outage")
    return finish(h, p, number="3", name="webapi+relay SIGKILL", submissions=subs, notes=notes)


def webhook_receiver(h: Harness, p: Profile) -> Tally:
    """4: the receiver refuses connections, then answers 500, then 204.

    Each phase lasts its time *and* until the relay has tried in it at least once, so
    every delivery sees all three."""
    receiver = h.receiver
    receiver.set_mode("down")
    spec = p.spec(jobs=p.webhook_jobs, kinds=("callback",))
    load = _load(h, spec, "s4").start()
    users = h.users_by_name

    def attempts(outcome: Callable[[dict[str, Any]], bool]) -> bool:
        for sub in list(load.submissions):
            if sub.accepted and sub.job_id:
                job = h.client.get_job(users[sub.user], sub.job_id)
                if job and any(outcome(c) for c in job.get("callbacks") or []):
                    return True
        return False

    started = time.monotonic()
    refused = wait_until(lambda: attempts(lambda c: c["status_code"] is None), 120)
    time.sleep(max(0.0, p.receiver_down_s - (time.monotonic() - started)))
    down_for = time.monotonic() - started
    receiver.set_mode("error")
    started = time.monotonic()
    errors = wait_until(lambda: receiver.count(lambda code: code == 500) > 0, 180)
    time.sleep(max(0.0, p.receiver_error_s - (time.monotonic() - started)))
    receiver.set_mode("up")
    notes = [
        f"refused {down_for:.0f} s ({'attempted' if refused else 'no attempt seen'}), "
        f"500 for {time.monotonic() - started:.0f} s ({receiver.count(lambda c: c == 500)} answered)"
        + ("" if errors else ", no attempt in the 500 phase")
    ]
    return finish(
        h, p, number="4", name="webhook receiver down/500/up", submissions=load.wait(), notes=notes
    )


def postgres_restart(h: Harness, p: Profile) -> Tally:
    """5: restart PostgreSQL (the job store) under load."""
    if not p.postgres_restart:
        return Tally(
            "5",
            "PostgreSQL restart",
            skipped="this machine's PostgreSQL is shared with other tests: full run only",
        )
    if h.database != "postgres":
        return Tally("5", "PostgreSQL restart", skipped="job store is SQLite (--database postgres)")
    load = _load(h, p.spec(), "s5").start()
    wait_until(_answered(load, max(1, p.jobs // 3)), timeout_s=120)
    took = restart_postgres()
    notes = [f"pg_ctlcluster restart took {took:.1f} s"]
    return finish(h, p, number="5", name="PostgreSQL restart", submissions=load.wait(), notes=notes)


def hang_past_deadline(h: Harness, p: Profile) -> Tally:
    """6: the detect stage of one job hangs far past its deadline (uninterruptible from
    inside the flow); jobs queued behind it must still end."""
    h.set_fault_plan(
        {
            "hang": [
                {
                    "stage": "detect",
                    "owner_ids": [h.hang_user.id],
                    "seconds": 20 * p.hang_deadline_s,
                }
            ]
        }
    )
    body = body_for(
        "callback",
        callback_url=h.receiver.url,
        deadline_s=p.hang_deadline_s,
        queue_timeout_s=p.hang_deadline_s,
    )
    hung = Submission(
        kind="hang",
        user=h.hang_user.name,
        idempotency_key=f"s6-{uuid.uuid4().hex[:8]}",
        callback=True,
    )
    h.client.submit(hung, h.hang_user, body, retry_for_s=30)
    behind = _load(h, p.spec(jobs=p.jobs_behind_hang, kinds=("good",)), "s6").start()
    try:
        row = finish(
            h, p, number="6", name="stage hangs past deadline", submissions=[hung, *behind.wait()]
        )
    finally:
        h.set_fault_plan({})
    job = h.client.get_job(h.hang_user, hung.job_id) if hung.job_id else None
    if job is not None:
        row.notes.insert(
            0, f"hung job ended {job['status']} ({(job.get('error') or {}).get('code')})"
        )
    return row


def idempotency_race(h: Harness, p: Profile) -> Tally:
    """7: ``duplicates`` concurrent submissions with one Idempotency-Key."""
    user = h.users[0]
    key = f"s7-{uuid.uuid4().hex[:8]}"
    body = body_for(
        "good", callback_url=None, deadline_s=p.deadline_s, queue_timeout_s=p.queue_timeout_s
    )
    requests = [
        (Submission(kind="race", user=user.name, idempotency_key=key), user, body)
        for _ in range(p.duplicates)
    ]
    subs = fire_together(h.client, requests)
    created = sum(1 for s in subs if s.status_code == 202)
    ids = {s.job_id for s in subs if s.accepted}
    row = finish(h, p, number="7", name="20 concurrent duplicates", submissions=subs)
    row.idem_violations += max(0, created - 1) + max(0, len(ids) - 1)
    row.notes.insert(
        0,
        f"202 x{created}, 200 x{sum(1 for s in subs if s.status_code == 200)}, {len(ids)} job id(s)",
    )
    return row


def burst(h: Harness, p: Profile) -> Tally:
    """8: every user submits quota + ``burst_extra`` jobs at once (backpressure)."""
    requests = []
    for user in h.users[: p.burst_users]:
        for index in range(p.quota + p.burst_extra):
            kind = "callback" if index % 4 == 0 else "good"
            body = body_for(
                kind,
                callback_url=h.receiver.url,
                deadline_s=p.deadline_s,
                queue_timeout_s=p.queue_timeout_s,
            )
            sub = Submission(
                kind=kind,
                user=user.name,
                idempotency_key=f"s8-{uuid.uuid4().hex[:10]}",
                callback=kind == "callback",
            )
            requests.append((sub, user, body))
    subs = fire_together(h.client, requests)
    return finish(
        h,
        p,
        number="8",
        name="burst beyond capacity",
        submissions=subs,
        note_of=lambda seen: admitted_share(
            subs, seen, quota=p.quota, queue_timeout_s=p.queue_timeout_s
        ),
    )


def admitted_share(
    subs: Sequence[Submission],
    observations: Mapping[str, Observation],
    *,
    quota: int,
    queue_timeout_s: float,
) -> str:
    """What admission made of a burst (issue 24): the jobs it admitted against those that
    could have started within the queue timeout, at the rate the pool then finished the
    admitted ones (at most each user's quota)."""
    per_user: dict[str, int] = {}
    for sub in subs:
        per_user[sub.user] = per_user.get(sub.user, 0) + 1
    eligible = sum(min(count, quota) for count in per_user.values())
    admitted = sum(1 for sub in subs if sub.accepted)
    spans = [
        (parse_time(job.get("started_at")), parse_time(job.get("finished_at")))
        for observation in observations.values()
        if (job := observation.job) is not None and job.get("status") == "succeeded"
    ]
    starts = [start for start, end in spans if start is not None and end is not None]
    ends = [end for start, end in spans if start is not None and end is not None]
    if len(ends) < 2:
        return f"admitted {admitted} of {eligible} within quota"
    rate = len(ends) / max((max(ends) - min(starts)).total_seconds(), 1e-3)
    could = min(eligible, round(rate * queue_timeout_s))
    return (
        f"admitted {admitted} of {could} that could start within {queue_timeout_s:g} s "
        f"({rate:.2f} jobs/s; {eligible} within quota): {admitted / max(could, 1):.0%}"
    )


SCENARIOS: dict[str, Callable[[Harness, Profile], Tally]] = {
    "1": worker_sigkill,
    "2": prefect_outage,
    "3": webapi_kill,
    "4": webhook_receiver,
    "5": postgres_restart,
    "6": hang_past_deadline,
    "7": idempotency_race,
    "8": burst,
}
