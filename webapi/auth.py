"""API keys: ``ff_`` + 32 random bytes (url-safe base64), stored only as a keyed hash.

The database holds ``HMAC-SHA256(pepper, key)`` (pepper = ``FACEFLOW_API_KEY_PEPPER``), so
a leaked table does not reveal usable keys; lookups are by hash and the final comparison
is constant-time. Webhook signing secrets (``whsec_...``) come from ``webapi.webhooks``.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

from webapi.webhooks import new_secret as new_webhook_secret

T = TypeVar("T")

API_KEY_PREFIX = "ff_"
API_KEY_BYTES = 32

__all__ = [
    "API_KEY_PREFIX",
    "KeyCache",
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


class KeyCache(Generic[T]):
    """Authenticated principals by API-key hash for ``ttl_s`` seconds (LRU-bounded).

    Saves the key lookup on every request of a busy client. Only successful lookups are
    kept, so a new key works at once; a revoked key, a disabled user or a changed quota
    takes effect within ``ttl_s`` (0 disables the cache). A key whose end is known (a
    rotation's grace period) is never kept past it. Keys are held only as hashes.
    """

    def __init__(
        self, ttl_s: float, max_entries: int = 4096, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.clock = clock
        self._entries: OrderedDict[str, tuple[float, T]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key_hash: str) -> T | None:
        """The cached principal of ``key_hash``, or None (absent or expired)."""
        if self.ttl_s <= 0:
            return None
        with self._lock:
            entry = self._entries.get(key_hash)
            if entry is None:
                return None
            if self.clock() >= entry[0]:
                del self._entries[key_hash]
                return None
            self._entries.move_to_end(key_hash)
            return entry[1]

    def put(self, key_hash: str, value: T, *, valid_for_s: float | None = None) -> None:
        """Remember ``value`` as the principal of ``key_hash`` from now, for ``ttl_s`` or
        for ``valid_for_s`` (how long the key itself stays valid) if that is shorter."""
        lifetime = self.ttl_s if valid_for_s is None else min(self.ttl_s, valid_for_s)
        if lifetime <= 0:
            return
        with self._lock:
            self._entries[key_hash] = (self.clock() + lifetime, value)
            self._entries.move_to_end(key_hash)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        """Forget every entry (after revoking keys or disabling users in-process)."""
        with self._lock:
            self._entries.clear()
