"""The Prefect part of ``/readyz``: whether the API can use the Prefect API, answered from
a short cache so that frequent probes cost the Prefect server nothing more.

An API that runs the relay (``run_relay``) calls Prefect's authenticated routes with its
credential (``prefect_api_auth_string``), so its check asks such a route (the server's
version, as Prefect's own client does), and so does an API given a credential: a missing
or wrong one (401 or 403) reads ``credential refused``, told apart from ``unreachable``.
An API without the relay and without a credential never calls Prefect
(``deploy/systemd``): its check asks the health route, which needs none.

Each answer is kept ``ok_ttl_s`` (a failure ``failed_ttl_s``, so recovery shows soon);
concurrent probes share the one check in flight.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from starlette.concurrency import run_in_threadpool

from webapi.config import Settings
from webapi.prefect_api import PrefectAPI, PrefectAuthRefused, PrefectError, PrefectRejected

OK = "ok"
PREFECT_TIMEOUT_S = 2.0
OK_TTL_S = 5.0
FAILED_TTL_S = 1.0


@dataclass
class PrefectReadiness:
    """This API's cached view of the Prefect API (``check``); ``close`` ends its client."""

    client: PrefectAPI
    credential: bool
    ok_ttl_s: float = OK_TTL_S
    failed_ttl_s: float = FAILED_TTL_S
    _answer: str = field(default="", init=False, repr=False)
    _until: float = field(default=0.0, init=False, repr=False)
    _lock: asyncio.Lock | None = field(default=None, init=False, repr=False)

    @classmethod
    def from_settings(cls, settings: Settings) -> PrefectReadiness:
        """The check of an API run with ``settings``."""
        client = PrefectAPI.from_settings(settings, timeout=PREFECT_TIMEOUT_S)
        credential = settings.run_relay or settings.prefect_api_auth_string is not None
        return cls(client, credential=credential)

    async def check(self) -> str:
        """``"ok"``, or why the Prefect API cannot be used now: ``unreachable: …`` or
        ``credential refused: …`` (from the cache while it is fresh)."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if time.monotonic() >= self._until:
                self._answer = await run_in_threadpool(self._probe)
                ttl = self.ok_ttl_s if self._answer == OK else self.failed_ttl_s
                self._until = time.monotonic() + ttl
            return self._answer

    def _probe(self) -> str:
        try:
            self.client.check(credential=self.credential)
        except PrefectAuthRefused as exc:
            return f"credential refused: {exc}"
        except PrefectRejected as exc:
            return f"error: HTTP {exc.status_code}"
        except PrefectError as exc:
            return f"unreachable: {exc}"
        return OK

    def close(self) -> None:
        """Close the client's connections."""
        self.client.close()
