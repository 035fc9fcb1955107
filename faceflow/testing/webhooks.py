"""Standard Webhooks signature checks for tests and benchmarks, written from the
specification and sharing no code with ``webapi.webhooks``."""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from collections.abc import Mapping


def independent_verify(
    secret: str, headers: Mapping[str, str], body: bytes, *, tolerance_s: int | None = 300
) -> bool:
    """Whether ``webhook-signature`` holds a valid ``v1`` signature: HMAC-SHA256 over
    ``id.timestamp.body`` with the base64-decoded ``whsec_`` key, and (unless
    ``tolerance_s`` is None) a timestamp within ``tolerance_s`` of now. False when a header
    is missing or the secret or timestamp is malformed."""
    lower = {name.lower(): value for name, value in headers.items()}
    try:
        msg_id, stamp = lower["webhook-id"], lower["webhook-timestamp"]
        key = base64.b64decode(secret.removeprefix("whsec_"))
        if tolerance_s is not None and abs(time.time() - int(stamp)) > tolerance_s:
            return False
    except (KeyError, ValueError):
        return False
    signed = b".".join([msg_id.encode(), stamp.encode(), body])
    expected = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
    offered = [part.split(",", 1) for part in lower.get("webhook-signature", "").split()]
    return any(
        version == "v1" and hmac.compare_digest(value, expected)
        for version, value in (pair for pair in offered if len(pair) == 2)
    )
