"""notify: webhook outbox rows → signed POSTs to the job's ``callback_url``.

Standard Webhooks: ``webhook-id`` is the row's ``msg_<id>`` (the same on every retry),
``webhook-timestamp`` the attempt's time, ``webhook-signature`` ``v1,<base64 HMAC>`` under
the owner's ``whsec_`` secret, body = the frozen ``payload["body"]``. Any 2xx delivers;
410 Gone gives up at once; anything else (other codes, timeouts, refused connections) is
retried with exponential backoff and jitter until the row is ``webhook_max_age_s`` old.
The URL is SSRF-checked again at send time (DNS may have changed) and the POST is pinned
to the checked address (``webapi.urls.pinned``), so DNS rebinding between the check and
the connection cannot redirect it; ``Host``, SNI and certificate checks keep the original
host name. Every attempt is a ``WebhookDelivery`` row, shown on the job as ``callbacks``.
A disabled user's webhooks are not sent: each row is closed as ``obsolete`` when due.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta

import httpx

from webapi.errors import BlockedUrl
from webapi.models import Job, Outbox, OutboxOutcome, User, WebhookDelivery, utcnow
from webapi.relay import leases
from webapi.relay.context import Relay
from webapi.urls import UrlPolicy
from webapi.webhooks import encode_body, signed_headers

log = logging.getLogger(__name__)

COUNTER = "faceflow_webhook_deliveries_total"
USER_AGENT = "FaceFlow-Webhooks/1"


@dataclass(frozen=True)
class Attempt:
    """The result of one HTTP attempt."""

    outcome: str  # delivered, retry, gave_up
    status_code: int | None
    error: str | None
    duration_ms: float


def run_once(relay: Relay) -> int:
    """Lease due webhook rows and deliver them concurrently; returns rows handled."""
    rows = relay.claim(
        "webhook", lease_s=max(relay.timings.lease_s, 3 * relay.timings.webhook_timeout_s)
    )
    if not rows:
        return 0
    workers = min(relay.timings.webhook_concurrency, len(rows))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="faceflow-webhook") as pool:
        list(pool.map(lambda row: deliver(relay, row), rows))
    return len(rows)


def deliver(relay: Relay, row: Outbox) -> Attempt | None:
    """Make one delivery attempt of a leased webhook row and record it."""
    with relay.session() as session:
        job = session.get(Job, row.job_id)
        user = session.get(User, job.owner_id) if job is not None else None
        url = job.callback_url if job is not None else None
        secret = user.webhook_secret if user is not None else None
        disabled = user is not None and user.disabled
        session.commit()
    if disabled:
        _close(relay, row, "obsolete", "the job's user is disabled")
        return None
    if not url or not secret:
        _close(relay, row, "obsolete", "the job has no callback URL any more")
        return None
    attempt = _post(relay, row, url, secret)
    now = utcnow()
    if attempt.outcome == "retry" and now - row.created_at > timedelta(
        seconds=relay.timings.webhook_max_age_s
    ):
        attempt = Attempt("gave_up", attempt.status_code, attempt.error, attempt.duration_ms)
    with relay.session() as session:
        session.add(
            WebhookDelivery(
                outbox_id=row.id,
                job_id=row.job_id,
                event=str(row.payload.get("event", "")),
                webhook_id=_webhook_id(row),
                attempt=row.attempts + 1,
                at=now,
                status_code=attempt.status_code,
                outcome=attempt.outcome,
                error=attempt.error[:500] if attempt.error else None,
                duration_ms=round(attempt.duration_ms, 1),
            )
        )
        if attempt.outcome == "retry":
            delay = leases.backoff_s(
                row.attempts + 1,
                base_s=relay.timings.webhook_backoff_base_s,
                cap_s=relay.timings.webhook_backoff_cap_s,
            )
            leases.reschedule(
                session, row, owner=relay.owner, error=attempt.error or "", delay_s=delay, now=now
            )
        else:
            outcome: OutboxOutcome = "done" if attempt.outcome == "delivered" else "gave_up"
            leases.finish(
                session, row, owner=relay.owner, outcome=outcome, error=attempt.error, now=now
            )
        session.commit()
    relay.metrics.inc(COUNTER, attempt.outcome)
    log.info(
        "webhook attempt",
        extra={
            "job_id": str(row.job_id),
            "webhook_id": _webhook_id(row),
            "status_code": attempt.status_code,
            "outcome": attempt.outcome,
        },
    )
    return attempt


def _webhook_id(row: Outbox) -> str:
    return str(row.payload.get("webhook_id") or f"msg_{row.id.hex}")


def _post(relay: Relay, row: Outbox, url: str, secret: str) -> Attempt:
    started = time.perf_counter()

    def took() -> float:
        return (time.perf_counter() - started) * 1000

    try:
        target = UrlPolicy.from_settings(relay.settings).check_and_pin(url)
    except BlockedUrl as exc:
        return Attempt("gave_up", None, f"blocked: {exc.message}", took())
    body = encode_body(row.payload.get("body") or {})
    headers = signed_headers(secret, _webhook_id(row), body)
    headers["user-agent"] = USER_AGENT
    headers.update(target.headers)
    timeout = relay.timings.webhook_timeout_s
    try:
        response = relay.http.post(
            target.url,
            content=body,
            headers=headers,
            extensions=dict(target.extensions),
            timeout=httpx.Timeout(timeout, connect=min(timeout, 5.0)),
            follow_redirects=False,
        )
    except httpx.HTTPError as exc:
        return Attempt("retry", None, f"{type(exc).__name__}", took())
    code = response.status_code
    if 200 <= code < 300:
        return Attempt("delivered", code, None, took())
    if code == 410:
        return Attempt("gave_up", code, "410 Gone: the receiver asked to stop", took())
    return Attempt("retry", code, f"HTTP {code}", took())


def _close(relay: Relay, row: Outbox, outcome: OutboxOutcome, error: str) -> None:
    with relay.session() as session:
        leases.finish(session, row, owner=relay.owner, outcome=outcome, error=error)
        session.commit()
