"""Standard Webhooks signing, and the relay's notify step against a real loopback receiver.

Signatures are checked with ``independent_verify`` (faceflow/testing/webhooks.py), which
is written from the spec and shares no code with ``webapi.webhooks``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from faceflow.testing.jobs import auth, make_user, outbox_of, succeed
from faceflow.testing.relay import FAST, Receiver, receiver, submit
from faceflow.testing.wait import poll_value
from faceflow.testing.webhooks import independent_verify
from tests.webapi.conftest import make_settings
from webapi import crud, webhooks
from webapi.main import create_app
from webapi.models import Outbox, WebhookDelivery, utcnow
from webapi.relay import notify
from webapi.relay.context import Relay
from webapi.relay.metrics import METRICS
from webapi.relay.runner import build_relay
from webapi.storage import LocalObjectStore

# The example of the Standard Webhooks specification (its reference libraries test it).
SPEC_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
SPEC_ID = "msg_p5jXN8AQM9LWM0D4loKWxJek"
SPEC_TIMESTAMP = 1614265330
SPEC_BODY = b'{"test": 2432232314}'
SPEC_SIGNATURE = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


# --------------------------------------------------------------------------- signing


def test_sign_matches_the_specification_example() -> None:
    assert webhooks.sign(SPEC_SECRET, SPEC_ID, SPEC_TIMESTAMP, SPEC_BODY) == SPEC_SIGNATURE


def test_signed_headers_verify_independently_and_with_verify() -> None:
    secret = webhooks.new_secret()
    assert secret.startswith("whsec_") and len(webhooks.secret_bytes(secret)) == 32
    body = webhooks.encode_body({"type": "job.succeeded", "data": {"id": "x", "é": 1}})
    headers = webhooks.signed_headers(secret, "msg_1", body)
    assert independent_verify(secret, headers, body)
    webhooks.verify(secret, headers, body)


@pytest.mark.parametrize(
    "change",
    ["body", "id", "timestamp", "secret", "old"],
)
def test_verify_rejects_tampering(change: str) -> None:
    secret, body = webhooks.new_secret(), b'{"a":1}'
    now = int(time.time())
    headers = webhooks.signed_headers(secret, "msg_1", body, timestamp=now)
    if change == "body":
        body = b'{"a":2}'
    elif change == "id":
        headers["webhook-id"] = "msg_2"
    elif change == "timestamp":
        headers["webhook-timestamp"] = str(now + 1)
    elif change == "secret":
        secret = webhooks.new_secret()
    else:
        headers = webhooks.signed_headers(secret, "msg_1", body, timestamp=now - 600)
    with pytest.raises(webhooks.WebhookVerificationError):
        webhooks.verify(secret, headers, body)
    assert not independent_verify(secret, headers, body)


def test_verify_accepts_any_of_several_signatures() -> None:
    old, new = webhooks.new_secret(), webhooks.new_secret()
    body = b"{}"
    headers = webhooks.signed_headers(new, "msg_1", body)
    rotated = webhooks.signed_headers(
        old, "msg_1", body, timestamp=int(headers["webhook-timestamp"])
    )
    headers["webhook-signature"] = f"{rotated['webhook-signature']} {headers['webhook-signature']}"
    webhooks.verify(new, headers, body)
    webhooks.verify(old, headers, body)
    with pytest.raises(webhooks.WebhookVerificationError):
        webhooks.verify(new, {"webhook-id": "msg_1"}, body)


# --------------------------------------------------------------------------- notify


@pytest.fixture
def relay(engine: Engine, database_url: str, tmp_path: Path) -> Iterator[Relay]:
    """A relay for notify only (its Prefect URL is never used)."""
    settings = make_settings(database_url, tmp_path)
    store = LocalObjectStore(tmp_path / "storage")
    instance = build_relay(settings, engine=engine, store=store, timings=FAST)
    yield instance
    instance.close()


@pytest.fixture
def hooks() -> Iterator[Receiver]:
    with receiver() as instance:
        yield instance


def finished_job(relay: Relay, hooks: Receiver, owner: crud.NewUser) -> uuid.UUID:
    """A job that subscribed to webhooks and has just succeeded (one webhook row)."""
    new = submit(
        relay.engine, relay.settings, relay.store, owner, callback_url=f"{hooks.url}/hook?x=1"
    )
    succeed(relay.engine, new.id, result_key=f"results/{new.id}/attempt-1.png")
    return new.id


def webhook_row(relay: Relay, job_id: uuid.UUID) -> Outbox:
    [row] = [row for row in outbox_of(relay.engine, job_id) if row.kind == "webhook"]
    return row


def deliveries(relay: Relay, job_id: uuid.UUID) -> list[WebhookDelivery]:
    with Session(relay.engine) as session:
        query = (
            select(WebhookDelivery)
            .where(col(WebhookDelivery.job_id) == job_id)
            .order_by(col(WebhookDelivery.attempt))
        )
        return list(session.exec(query))


def notify_until_closed(relay: Relay, job_id: uuid.UUID, timeout_s: float = 15.0) -> Outbox:
    def closed() -> Outbox | None:
        notify.run_once(relay)
        row = webhook_row(relay, job_id)
        return row if row.done_at is not None else None

    row = poll_value(closed, timeout_s, step_s=0.05)
    if row is None:
        pytest.fail("the webhook row was not closed in time")
    return row


def test_retries_after_500_with_the_same_webhook_id_until_delivered(
    relay: Relay, hooks: Receiver
) -> None:
    owner = make_user(relay.engine, relay.settings)
    hooks.statuses = [500, 503, 200]
    job_id = finished_job(relay, hooks, owner)
    delivered_before = METRICS.value("faceflow_webhook_deliveries_total", "delivered")

    row = notify_until_closed(relay, job_id)
    assert row.outcome == "done"
    posts = hooks.posts()
    assert len(posts) == 3 and {p.path for p in posts} == {"/hook?x=1"}
    assert {p.headers["webhook-id"] for p in posts} == {row.payload["webhook_id"]}
    assert len({p.body for p in posts}) == 1  # the frozen body, byte for byte
    for post in posts:
        assert independent_verify(owner.webhook_secret, post.headers, post.body)
        assert post.headers["content-type"] == "application/json"
    event = json.loads(posts[0].body)
    assert event["type"] == "job.succeeded" and event["data"]["id"] == str(job_id)
    attempts = deliveries(relay, job_id)
    assert [(d.attempt, d.status_code, d.outcome) for d in attempts] == [
        (1, 500, "retry"),
        (2, 503, "retry"),
        (3, 200, "delivered"),
    ]
    assert METRICS.value("faceflow_webhook_deliveries_total", "delivered") == delivered_before + 1

    # The owner sees every attempt on the job.
    with TestClient(create_app(relay.settings)) as client:
        shown = client.get(f"/v1/jobs/{job_id}", headers=auth(owner)).json()
    assert [(c["attempt"], c["status_code"], c["outcome"]) for c in shown["callbacks"]] == [
        (1, 500, "retry"),
        (2, 503, "retry"),
        (3, 200, "delivered"),
    ]


def test_gives_up_on_410(relay: Relay, hooks: Receiver) -> None:
    owner = make_user(relay.engine, relay.settings)
    hooks.statuses = [410]
    job_id = finished_job(relay, hooks, owner)
    row = notify_until_closed(relay, job_id)
    assert row.outcome == "gave_up"
    time.sleep(FAST.webhook_backoff_cap_s + 0.1)
    notify.run_once(relay)
    assert len(hooks.posts()) == 1
    assert [(d.status_code, d.outcome) for d in deliveries(relay, job_id)] == [(410, "gave_up")]


def test_refused_connection_is_retried(relay: Relay, hooks: Receiver) -> None:
    owner = make_user(relay.engine, relay.settings)
    job_id = finished_job(relay, hooks, owner)
    port = hooks.server.server_address[1]
    hooks.close()  # nothing listens now
    notify.run_once(relay)
    row = webhook_row(relay, job_id)
    assert row.done_at is None and row.attempts == 1 and row.next_attempt_at > utcnow()
    [attempt] = deliveries(relay, job_id)
    assert attempt.outcome == "retry" and attempt.status_code is None and attempt.error
    assert str(port) not in (attempt.error or "")  # no URL in the recorded error


def test_gives_up_after_the_retry_window(relay: Relay, hooks: Receiver) -> None:
    owner = make_user(relay.engine, relay.settings)
    hooks.statuses = [500]
    job_id = finished_job(relay, hooks, owner)
    with Session(relay.engine) as session:
        session.exec(
            sa.update(Outbox)
            .where(col(Outbox.job_id) == job_id, col(Outbox.kind) == "webhook")
            .values(created_at=utcnow() - timedelta(hours=24, minutes=1))
        )
        session.commit()
    row = notify_until_closed(relay, job_id)
    assert row.outcome == "gave_up" and len(hooks.posts()) == 1


def test_callback_url_is_checked_again_at_send_time(relay: Relay, hooks: Receiver) -> None:
    owner = make_user(relay.engine, relay.settings)
    job_id = finished_job(relay, hooks, owner)
    strict = replace(
        relay, settings=relay.settings.model_copy(update={"allow_private_urls": False})
    )
    row = notify_until_closed(strict, job_id)
    assert row.outcome == "gave_up" and hooks.requests == []  # no connection made
    [attempt] = deliveries(relay, job_id)
    assert attempt.outcome == "gave_up" and (attempt.error or "").startswith("blocked")


def test_each_event_is_received_at_least_once(relay: Relay, hooks: Receiver) -> None:
    owner = make_user(relay.engine, relay.settings, quota=20)
    hooks.statuses = [500, 200]  # the first POST of all fails, then every one succeeds
    jobs = [finished_job(relay, hooks, owner) for _ in range(5)]
    for job_id in jobs:
        notify_until_closed(relay, job_id)
    received = {json.loads(p.body)["data"]["id"] for p in hooks.posts()}
    assert received == {str(job_id) for job_id in jobs}
    for post in hooks.posts():
        assert independent_verify(owner.webhook_secret, post.headers, post.body)


def test_a_disabled_users_webhooks_are_not_sent(relay: Relay, hooks: Receiver) -> None:
    """Pending rows (a success before the disable, the cancellation it caused) are closed
    as obsolete when due, with no attempt; another user's webhook still goes out."""
    alice = make_user(relay.engine, relay.settings)
    bob = make_user(relay.engine, relay.settings)
    succeeded = finished_job(relay, hooks, alice)
    queued = submit(
        relay.engine,
        relay.settings,
        relay.store,
        alice,
        callback_url=f"{hooks.url}/hook",
        callback_events=["job.cancelled"],
    ).id
    bobs = finished_job(relay, hooks, bob)
    with Session(relay.engine, expire_on_commit=False) as session:
        assert crud.disable_user(session, name=alice.user.name).cancelled == 1
    for job_id in (succeeded, queued):
        row = notify_until_closed(relay, job_id)
        assert (row.outcome, row.last_error) == ("obsolete", "the job's user is disabled")
        assert deliveries(relay, job_id) == []
    assert notify_until_closed(relay, bobs).outcome == "done"
    assert [json.loads(r.body)["data"]["id"] for r in hooks.requests] == [str(bobs)]
