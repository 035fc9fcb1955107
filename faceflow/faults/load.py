"""The mixed load: users, request bodies, and a client that behaves like a careful app.

A submission carries an ``Idempotency-Key``; on a transport error (refused, reset, timeout)
the client sends the same request again with the same key until ``retry_for_s`` has passed,
so a job committed just before the webapi died is found again, not duplicated. 4xx/5xx
answers are final (the scenario counts them as rejections with their reason).

Kinds of submission: ``good`` (a face into a portrait), ``callback`` (the same, with a
webhook), ``noface`` (fails ``no_face_found``, never retried), ``bad`` (not an image:
rejected at submit), ``cancel`` (good, cancelled shortly after), ``dup`` (the previous
accepted request sent again with its key: the same job must come back).
"""

from __future__ import annotations

import base64
import io
import itertools
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import httpx

from faceflow.faults.report import Submission

KINDS_CYCLE = ("callback", "noface", "bad", "dup", "cancel", "good", "callback", "good", "good")
"""Nine kinds: a length prime to the user counts (2, 8), so every user sends every kind."""
TRANSPORT_ERRORS = (httpx.TransportError,)


@dataclass(frozen=True)
class User:
    """An API user of the load."""

    name: str
    id: str
    api_key: str
    webhook_secret: str


def _jpeg(image: Any, size: tuple[int, int]) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image).resize(size).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def _data_uri(data: bytes) -> str:
    return "data:image/jpeg;base64," + base64.b64encode(data).decode()


@cache
def images() -> dict[str, str]:
    """Small inputs as data URIs (kept small so a 2-core machine runs many jobs)."""
    from faceflow import samples

    return {
        "source": _data_uri(_jpeg(samples.astronaut_rgb(), (160, 160))),
        "target": _data_uri(_jpeg(samples.grace_hopper_rgb(), (200, 234))),
        "noface": _data_uri(_jpeg(samples.no_face_rgb(), (200, 133))),
        "bad": _data_uri(b"\xff\xd8\xff\xe0 this is not a JPEG " + uuid.uuid4().bytes * 8),
    }


def body_for(
    kind: str,
    *,
    callback_url: str | None,
    deadline_s: int,
    queue_timeout_s: int,
) -> dict[str, Any]:
    """The JSON body of one submission of ``kind``."""
    img = images()
    target = {"noface": img["noface"], "bad": img["bad"]}.get(kind, img["target"])
    body: dict[str, Any] = {
        "source": img["source"],
        "target": target,
        "deadline_seconds": deadline_s,
        "queue_timeout_seconds": queue_timeout_s,
    }
    if kind == "callback" and callback_url:
        body["callback_url"] = callback_url
    return body


@dataclass
class Client:
    """HTTP access to the API for every user of the load."""

    api_url: str
    users: Sequence[User]
    timeout_s: float = 30.0
    _http: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=16)
        self._http = httpx.Client(base_url=self.api_url, timeout=self.timeout_s, limits=limits)

    def close(self) -> None:
        self._http.close()

    def _auth(self, user: User) -> dict[str, str]:
        return {"Authorization": f"Bearer {user.api_key}"}

    def submit(
        self, sub: Submission, user: User, body: dict[str, Any], *, retry_for_s: float
    ) -> Submission:
        """POST the job (retrying transport errors with the same key); fills ``sub``."""
        give_up = time.monotonic() + retry_for_s
        headers = {**self._auth(user), "Idempotency-Key": sub.idempotency_key}
        while True:
            sub.tries += 1
            try:
                response = self._http.post("/v1/jobs", json=body, headers=headers)
            except TRANSPORT_ERRORS as exc:
                if time.monotonic() >= give_up:
                    sub.reason = f"unreachable ({type(exc).__name__})"
                    return sub
                time.sleep(0.5)
                continue
            sub.status_code = response.status_code
            if response.status_code in (200, 202):
                sub.job_id = str(response.json()["id"])
            else:
                sub.reason = f"{response.status_code} {_error_code(response)}"
                sub.retry_after = response.headers.get("retry-after")
            return sub

    def get_job(self, user: User, job_id: str) -> dict[str, Any] | None:
        """The job document; None for 404; raises ``httpx.HTTPError`` when unreachable."""
        response = self._http.get(f"/v1/jobs/{job_id}", headers=self._auth(user))
        if response.status_code == 404:
            return None
        response.raise_for_status()
        return dict(response.json())

    def job_ids(self, user: User) -> set[str]:
        """Every job id the API lists for ``user`` (all pages)."""
        found: set[str] = set()
        cursor: str | None = None
        while True:
            params: dict[str, Any] = {"limit": 100, **({"cursor": cursor} if cursor else {})}
            response = self._http.get("/v1/jobs", params=params, headers=self._auth(user))
            response.raise_for_status()
            page = response.json()
            found |= {str(job["id"]) for job in page["data"]}
            cursor = page.get("next_cursor")
            if not cursor:
                return found

    def cancel(self, user: User, job_id: str, *, retry_for_s: float = 30.0) -> int | None:
        """POST cancel (retrying transport errors); the status code, None if unreachable."""
        give_up = time.monotonic() + retry_for_s
        while True:
            try:
                return self._http.post(
                    f"/v1/jobs/{job_id}/cancel", headers=self._auth(user)
                ).status_code
            except TRANSPORT_ERRORS:
                if time.monotonic() >= give_up:
                    return None
                time.sleep(0.5)


def _error_code(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return "unknown"


@dataclass
class LoadSpec:
    """How one scenario's mixed load is shaped."""

    jobs: int
    interval_s: float
    deadline_s: int
    queue_timeout_s: int
    kinds: Sequence[str] = KINDS_CYCLE
    cancel_after_s: float = 1.0
    retry_for_s: float = 90.0


class Load:
    """Submits ``spec.jobs`` requests round-robin over the users from a background thread."""

    def __init__(
        self,
        client: Client,
        spec: LoadSpec,
        *,
        callback_url: str | None,
        label: str,
        on_submitted: Callable[[Submission], None] | None = None,
    ) -> None:
        self.client, self.spec, self.callback_url, self.label = client, spec, callback_url, label
        self.submissions: list[Submission] = []
        self.users_by_name = {u.name: u for u in client.users}
        self._on_submitted = on_submitted
        self._lock = threading.Lock()
        self._cancels = ThreadPoolExecutor(max_workers=4, thread_name_prefix="fault-cancel")
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"load-{label}")
        self.done = threading.Event()

    def start(self) -> Load:
        self._thread.start()
        return self

    def wait(self, timeout_s: float | None = None) -> list[Submission]:
        """Wait for every submission (and cancel request) to be answered."""
        self._thread.join(timeout_s)
        self._cancels.shutdown(wait=True)
        return list(self.submissions)

    def _run(self) -> None:
        users = itertools.cycle(self.client.users)
        kinds = itertools.cycle(self.spec.kinds)
        last: tuple[Submission, dict[str, Any]] | None = None
        try:
            for index in range(self.spec.jobs):
                user, kind = next(users), next(kinds)
                if kind == "dup" and last is not None:
                    original, body = last  # replayed by the user who sent it
                    user = self.users_by_name[original.user]
                    sub = Submission(
                        kind="dup",
                        user=user.name,
                        idempotency_key=original.idempotency_key,
                        replay_of=original.idempotency_key,
                        callback=original.callback,
                    )
                else:
                    kind = "good" if kind == "dup" else kind
                    body = body_for(
                        kind,
                        callback_url=self.callback_url,
                        deadline_s=self.spec.deadline_s,
                        queue_timeout_s=self.spec.queue_timeout_s,
                    )
                    sub = Submission(
                        kind=kind,
                        user=user.name,
                        idempotency_key=f"{self.label}-{index}-{uuid.uuid4().hex[:8]}",
                        callback="callback_url" in body,
                    )
                self.client.submit(sub, user, body, retry_for_s=self.spec.retry_for_s)
                with self._lock:
                    self.submissions.append(sub)
                if sub.accepted and sub.replay_of is None:
                    last = (sub, body)
                if sub.accepted and kind == "cancel":
                    self._cancels.submit(self._cancel_later, user, sub)
                if self._on_submitted is not None:
                    self._on_submitted(sub)
                time.sleep(self.spec.interval_s)
        finally:
            self.done.set()

    def _cancel_later(self, user: User, sub: Submission) -> None:
        time.sleep(self.spec.cancel_after_s)
        assert sub.job_id is not None
        sub.cancel_status = self.client.cancel(user, sub.job_id, retry_for_s=self.spec.retry_for_s)


def fire_together(
    client: Client,
    requests: Sequence[tuple[Submission, User, dict[str, Any]]],
    *,
    retry_for_s: float = 30.0,
) -> list[Submission]:
    """Send every request at the same moment (a barrier across threads)."""
    barrier = threading.Barrier(len(requests))

    def send(item: tuple[Submission, User, dict[str, Any]]) -> Submission:
        sub, user, body = item
        barrier.wait()
        return client.submit(sub, user, body, retry_for_s=retry_for_s)

    with ThreadPoolExecutor(max_workers=len(requests), thread_name_prefix="fault-burst") as pool:
        return list(pool.map(send, requests))
