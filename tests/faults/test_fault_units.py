"""The fault suite's own parts, without a stack: the row arithmetic, the receiver's modes,
and the flow's fault-injection hook."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from faceflow.faults.receiver import Receiver
from faceflow.faults.report import Delivery, Observation, Submission, tally
from faceflow.testing.webhooks import independent_verify
from flows import faults
from webapi.webhooks import encode_body, new_secret, signed_headers


def _job(status: str, *, code: str | None = None, over_s: float = -10.0, events=None) -> dict:
    deadline = "2026-01-01T00:01:00+00:00"
    finished = (
        f"2026-01-01T00:01:{int(max(0, over_s)):02d}+00:00"
        if over_s >= 0
        else (f"2026-01-01T00:00:{int(60 + over_s):02d}+00:00")
    )
    return {
        "status": status,
        "error": {"code": code, "message": code} if code else None,
        "deadline_at": deadline,
        "finished_at": finished,
        "callback_url": "http://127.0.0.1/hook" if events else None,
        "callback_events": events or [],
        "attempts": 1,
    }


def test_tally_counts_outcomes_rejections_and_the_must_be_zero_columns() -> None:
    subs = [
        Submission("good", "a", "k1", status_code=202, job_id="j1"),
        Submission("callback", "a", "k2", status_code=202, job_id="j2", callback=True),
        Submission("dup", "a", "k2", replay_of="k2", status_code=200, job_id="j2", callback=True),
        Submission("dup", "a", "k1", replay_of="k1", status_code=200, job_id="jX"),  # wrong
        Submission("bad", "b", "k3", status_code=422, reason="422 invalid_input"),
        Submission("good", "b", "k4", status_code=503, reason="503 overloaded", retry_after="3"),
        Submission("good", "b", "k5", status_code=429, reason="429 quota_exceeded"),
        Submission("good", "b", "k6", status_code=202, job_id="j3"),
        Submission("good", "b", "k7", status_code=202, job_id="j4"),
    ]
    observations = {
        "j1": Observation(_job("succeeded"), late=False),
        "j2": Observation(_job("failed", code="no_face_found", events=["job.failed"]), False),
        "jX": Observation(_job("succeeded"), late=False),
        "j3": Observation(_job("failed", code="deadline_exceeded", over_s=50), late=True),
        "j4": Observation(None, late=False),  # 404 at the end
    }
    deliveries = [
        Delivery("msg_1", "job.failed", "j2", signature_ok=True),
        Delivery("msg_1", "job.failed", "j2", signature_ok=True),  # an at-least-once repeat
        Delivery("msg_2", "job.succeeded", "j2", signature_ok=False),  # wrong event, bad sig
        Delivery("msg_9", "job.failed", "other-scenario", signature_ok=True),
    ]
    row = tally(
        number="0",
        name="unit",
        submissions=subs,
        observations=observations,
        deliveries=deliveries,
        writers={"j1": 1, "j2": 0, "j3": 2},
    )
    assert (row.submitted, row.accepted, row.replays) == (9, 6, 2)
    assert row.rejected == Counter(
        {"422 invalid_input": 1, "503 overloaded": 1, "429 quota_exceeded": 1}
    )
    assert row.no_retry_after == 1
    assert row.idem_violations == 1
    assert (row.succeeded, row.expired, row.cancelled) == (2, 0, 0)
    assert row.failed == Counter({"no_face_found": 1, "deadline_exceeded": 1})
    assert (row.late, row.lost, row.dup_exec) == (2, 1, 1)
    assert (row.webhooks_expected, row.webhooks_delivered, row.webhooks_duplicates) == (1, 1, 1)
    assert (row.webhooks_wrong, row.bad_signatures) == (1, 1)
    assert row.max_over_deadline_s == pytest.approx(50.0)
    assert not row.ok
    cells = row.cells()
    assert cells[4] == "3 (422 invalid_input 1, 429 quota_exceeded 1, 503 overloaded 1)"
    assert "idempotency violations: 1" in cells[-1]
    assert row.line().startswith("| 0 | unit | 9 | 6 (2 replays) |")


def test_a_clean_scenario_is_ok_and_a_skipped_one_says_why() -> None:
    row = tally(
        number="1",
        name="clean",
        submissions=[Submission("good", "a", "k", status_code=202, job_id="j")],
        observations={"j": Observation(_job("succeeded"), late=False)},
        deliveries=[],
        writers={"j": 1},
    )
    assert row.ok and row.max_over_deadline_s == pytest.approx(-10.0)
    assert "-10.0 s" in row.line()
    skipped = tally(
        number="5", name="pg", submissions=[], observations={}, deliveries=[], writers={}
    )
    skipped.skipped = "shared database"
    assert skipped.ok and skipped.line().endswith("skipped: shared database |")


def test_receiver_refuses_then_answers_500_then_accepts_and_checks_signatures() -> None:
    receiver = Receiver()
    secret = new_secret()
    body = encode_body({"type": "job.succeeded", "data": {"id": "job-1"}})
    headers = signed_headers(secret, "msg_abc", body)
    try:
        with httpx.Client(timeout=5) as http:
            receiver.set_mode("down")
            with pytest.raises(httpx.ConnectError):
                http.post(receiver.url, content=body, headers=headers)
            receiver.set_mode("error")
            assert http.post(receiver.url, content=body, headers=headers).status_code == 500
            receiver.set_mode("up")
            assert http.post(receiver.url, content=body, headers=headers).status_code == 204
    finally:
        receiver.close()
    assert receiver.count(lambda code: code == 500) == 1
    [delivery] = receiver.deliveries({"alice": secret}, {"job-1": "alice"})
    assert (delivery.webhook_id, delivery.event, delivery.job_id) == (
        "msg_abc",
        "job.succeeded",
        "job-1",
    )
    assert delivery.signature_ok
    lower = {k.lower(): v for k, v in headers.items()}
    assert not independent_verify(new_secret(), lower, body, tolerance_s=None)


class HangClock:
    """A fault plan of ``entries`` and a clock that only ``faults``' sleeps move: ``slept``
    holds each sleep; ``on_sleep(now)`` runs after each (a test rewrites the plan there)."""

    def __init__(
        self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, entries: list[dict[str, Any]]
    ) -> None:
        self.plan = tmp_path / "faults.json"
        self.plan.write_text(json.dumps({"hang": entries}))
        self.now = 0.0
        self.slept: list[float] = []
        self.on_sleep: Callable[[float], None] = lambda _now: None
        self.monkeypatch = monkeypatch
        monkeypatch.setenv(faults.FILE_VAR, str(self.plan))
        monkeypatch.setattr(faults.time, "sleep", self.sleep)
        monkeypatch.setattr(faults.time, "monotonic", lambda: self.now)

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds
        self.on_sleep(self.now)

    def run_parameters(self, parameters: dict[str, Any]) -> None:
        """The current flow run's parameters, as ``prefect.runtime`` gives them."""
        from prefect.runtime import flow_run

        self.monkeypatch.setattr(flow_run, "parameters", parameters, raising=False)


def test_fault_hook_is_inert_unless_enabled(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    clock = HangClock(
        monkeypatch, tmp_path, [{"stage": "detect", "owner_ids": ["u1"], "seconds": 5}]
    )
    clock.run_parameters({"owner_id": "u1"})
    monkeypatch.delenv(faults.ENABLE_VAR, raising=False)
    faults.inject("detect")
    assert clock.slept == []
    monkeypatch.setenv(faults.ENABLE_VAR, "true")
    faults.inject("load")
    faults.inject("detect")
    assert sum(clock.slept) == pytest.approx(5.0) and max(clock.slept) <= faults.HANG_STEP_S
    clock.run_parameters({"owner_id": "someone-else"})
    clock.slept.clear()
    faults.inject("detect")
    assert clock.slept == []


def test_a_hang_ends_once_the_plan_drops_its_entry(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A test lets a held run go on by emptying the plan; an entry's stage may be a
    pattern (a video part's name: ``analyse-000000-*``)."""
    entry = {"stage": "analyse-000000-*", "owner_ids": ["u1"], "seconds": 600}
    clock = HangClock(monkeypatch, tmp_path, [entry])

    def let_go_at_3_s(now: float) -> None:
        if now >= 3.0:
            clock.plan.write_text("{}")

    clock.on_sleep = let_go_at_3_s
    clock.run_parameters({"job": {"owner_id": "u1"}, "part": "x"})
    monkeypatch.setenv(faults.ENABLE_VAR, "true")
    faults.inject("analyse-000030-000060")  # another range: no hang
    assert clock.now == 0.0
    faults.inject("analyse-000000-000030")
    assert clock.now == pytest.approx(3.0)


def test_fault_plan_reading_tolerates_missing_and_malformed_files(tmp_path: Path) -> None:
    assert faults.read_plan(tmp_path / "missing.json") == {}
    (tmp_path / "bad.json").write_text("{not json")
    assert faults.read_plan(tmp_path / "bad.json") == {}
    (tmp_path / "list.json").write_text("[1, 2]")
    assert faults.read_plan(tmp_path / "list.json") == {}
    plan = {"hang": [{"stage": "fuse", "owner_ids": ["u"], "seconds": 2}, "junk"]}
    assert faults.hang_seconds(plan, stage="fuse", owner_ids={"u"}) == 2.0
    assert faults.hang_seconds(plan, stage="fuse", owner_ids=set()) == 0.0
    assert faults.hang_seconds(plan, stage="detect", owner_ids={"u"}) == 0.0
    assert faults.hang_seconds(plan, stage="fuse", owner_ids={"v", "u"}) == 2.0  # a batch


def test_the_owners_of_a_run_are_its_jobs_owners() -> None:
    assert faults.run_owners({"owner_id": "a", "job_id": "j"}) == {"a"}
    batch = {"jobs": [{"owner_id": "a"}, {"owner_id": "b"}, {"owner_id": "a"}], "deadline_at": 1}
    assert faults.run_owners(batch) == {"a", "b"}
    assert faults.run_owners({}) == set()
    part = {"job": {"job_id": "j", "owner_id": "c"}, "part": "chunk-0001"}  # a video part
    assert faults.run_owners(part) == {"c"}
    assert faults.run_owners({"job": SimpleNamespace(owner_id="d"), "part": "probe"}) == {"d"}
