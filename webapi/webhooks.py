"""Standard Webhooks signing and verification (https://www.standardwebhooks.com).

A message is signed as ``base64(HMAC-SHA256(secret_bytes, f"{id}.{timestamp}.{body}"))``
and sent with the headers ``webhook-id`` (stable across retries), ``webhook-timestamp``
(integer Unix seconds) and ``webhook-signature: v1,<signature>``. Secrets are written
``whsec_<base64 of the key bytes>``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Mapping
from typing import Any

SECRET_PREFIX = "whsec_"
SIGNATURE_VERSION = "v1"
DEFAULT_TOLERANCE_S = 5 * 60
SECRET_BYTES = 32


class WebhookVerificationError(Exception):
    """A webhook message failed verification (bad secret, signature, or timestamp)."""


def new_secret() -> str:
    """A fresh signing secret in ``whsec_`` form (32 random bytes)."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode()


def secret_bytes(secret: str) -> bytes:
    """The key bytes of a ``whsec_`` secret (the prefix is optional)."""
    encoded = secret.removeprefix(SECRET_PREFIX)
    try:
        key = base64.b64decode(encoded, validate=True)
    except ValueError as exc:
        raise WebhookVerificationError("The webhook secret is not valid base64.") from exc
    if not key:
        raise WebhookVerificationError("The webhook secret is empty.")
    return key


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` header value for one message."""
    content = msg_id.encode() + b"." + str(timestamp).encode() + b"." + body
    digest = hmac.new(secret_bytes(secret), content, hashlib.sha256).digest()
    return f"{SIGNATURE_VERSION},{base64.b64encode(digest).decode()}"


def encode_body(payload: Mapping[str, Any]) -> bytes:
    """The exact body bytes that are signed and sent (compact, key order kept)."""
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False, default=str).encode()


def signed_headers(
    secret: str, msg_id: str, body: bytes, *, timestamp: int | None = None
) -> dict[str, str]:
    """The three Standard Webhooks headers plus the content type for one delivery attempt."""
    ts = int(time.time()) if timestamp is None else timestamp
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(ts),
        "webhook-signature": sign(secret, msg_id, ts, body),
        "content-type": "application/json",
    }


def verify(
    secret: str,
    headers: Mapping[str, str],
    body: bytes,
    *,
    tolerance_s: int = DEFAULT_TOLERANCE_S,
    now: float | None = None,
) -> None:
    """Check a received message; raise ``WebhookVerificationError`` if it does not verify.

    ``headers`` lookups are case-insensitive. Any one of the space-separated ``v1``
    signatures may match (secret rotation); the timestamp must be within ``tolerance_s``.
    """
    lowered = {k.lower(): v for k, v in headers.items()}
    try:
        msg_id = lowered["webhook-id"]
        timestamp = int(lowered["webhook-timestamp"])
        signatures = lowered["webhook-signature"].split()
    except (KeyError, ValueError) as exc:
        raise WebhookVerificationError("Missing or malformed webhook headers.") from exc
    current = time.time() if now is None else now
    if abs(current - timestamp) > tolerance_s:
        raise WebhookVerificationError("The webhook timestamp is outside the tolerance.")
    expected = sign(secret, msg_id, timestamp, body).encode()
    for candidate in signatures:
        if candidate.startswith(SIGNATURE_VERSION + ",") and hmac.compare_digest(
            candidate.encode(), expected
        ):
            return
    raise WebhookVerificationError("No webhook signature matched.")
