"""API keys: ``ff_`` + 32 random bytes (url-safe base64), stored only as a keyed hash.

The database holds ``HMAC-SHA256(pepper, key)`` (pepper = ``FACEFLOW_API_KEY_PEPPER``), so
a leaked table does not reveal usable keys; lookups are by hash and the final comparison
is constant-time. Webhook signing secrets (``whsec_...``) come from ``webapi.webhooks``.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from webapi.webhooks import new_secret as new_webhook_secret

API_KEY_PREFIX = "ff_"
API_KEY_BYTES = 32

__all__ = [
    "API_KEY_PREFIX",
    "hash_api_key",
    "key_matches",
    "new_api_key",
    "new_webhook_secret",
    "parse_bearer",
]


def new_api_key() -> str:
    """A fresh API key (shown once, never stored)."""
    return API_KEY_PREFIX + secrets.token_urlsafe(API_KEY_BYTES)


def hash_api_key(key: str, pepper: str) -> str:
    """The stored form of ``key``: hex HMAC-SHA256 under ``pepper``."""
    return hmac.new(pepper.encode(), key.encode(), hashlib.sha256).hexdigest()


def key_matches(key: str, stored_hash: str, pepper: str) -> bool:
    """Whether ``key`` hashes to ``stored_hash`` (constant-time comparison)."""
    return hmac.compare_digest(hash_api_key(key, pepper), stored_hash)


def parse_bearer(authorization: str | None) -> str | None:
    """The API key of an ``Authorization: Bearer ff_...`` header, or None."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token.startswith(API_KEY_PREFIX):
        return None
    return token
