"""Python client of the FaceFlow REST API (httpx; sync and async).

```python
from faceflow.client import FaceFlowClient
with FaceFlowClient("http://127.0.0.1:8000", api_key="ff_...") as ff:
    job = ff.submit("me.jpg", "photo.jpg", options={"identity_weight": 0.8})
    job = ff.wait(job["id"], timeout=120)
    Path("out.png").write_bytes(ff.result(job["id"]))
```
Both clients share the request builders and the retry rule below; only the transport
differs. A 503 or 429 that says "retry shortly" (``Retry-After``) and a connection that
failed are retried where that is safe (``RetryPolicy``); ``retries=0`` turns that off.
"""

from __future__ import annotations

import asyncio
import base64
import json
import mimetypes
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Generic, TypedDict, TypeVar, Unpack

import httpx

from tasks.closing import Closing

TERMINAL_STATUSES = frozenset({"succeeded", "failed", "expired", "cancelled"})

Job = dict[str, Any]
ImageInput = str | bytes | Path
"""A local path, raw bytes, a ``data:`` URI or an ``https://`` URL."""


class FaceFlowAPIError(Exception):
    """An error answer of the API: HTTP status, error code, message and Retry-After.
    ``retried``: the request was sent again before this answer (an earlier try may have
    been served, its answer lost)."""

    def __init__(
        self, status: int, code: str, message: str, retry_after: float | None = None
    ) -> None:
        self.status, self.code, self.message, self.retry_after = status, code, message, retry_after
        self.retried = False
        super().__init__(f"{status} {code}: {message}")


#: Answers that say "not now, retry shortly" (with ``Retry-After`` where the API knows when).
RETRIED_STATUSES = frozenset({429, 503})
#: Refusals of a submit made before anything of it was stored: ``crud._admit`` raises them
#: (``_check_inputs``, ``capacity.check_capacity``) before ``_admit_one`` adds the job's
#: row, so a submit without an ``Idempotency-Key`` can be sent again without a duplicate.
SUBMIT_REFUSALS = frozenset({"overloaded", "quota_exceeded", "inputs_purged"})
#: The first wait of a retry the API gave no ``Retry-After`` for; doubled at each retry.
BACKOFF_S = 0.5
#: Retry-After is waited at least, plus up to this share more, so that clients refused
#: together do not all come back in the same instant.
JITTER = 0.1
TRANSIENT = (FaceFlowAPIError, httpx.NetworkError, httpx.RemoteProtocolError)
"""What a retry may cure: an error answer, or a connection that could not be opened
(``ConnectError``), was reset (``ReadError``, ``WriteError``) or closed before the answer
(``RemoteProtocolError``). Not a timeout: a slow answer sent again only adds load."""
Transient = FaceFlowAPIError | httpx.NetworkError | httpx.RemoteProtocolError


@dataclass(frozen=True)
class RetryPolicy:
    """When a client sends a request again (the same rule for both clients).

    ``retries``: at most this many more tries per request (0: never). ``max_retry_wait``:
    the seconds one request may spend waiting between its tries, all together; each wait
    is ``Retry-After`` (else ``BACKOFF_S``, doubled at each retry) plus a little jitter,
    cut to what is left. When either runs out the last error is raised, as without
    retries."""

    retries: int = 3
    max_retry_wait: float = 30.0

    def start(self, *, idempotent: bool) -> _Retrying:
        """The retry state of one request."""
        return _Retrying(self, idempotent)


def retry_is_safe(exc: Transient, *, idempotent: bool) -> bool:
    """Whether sending the request again after ``exc`` may help and cannot do harm.

    An idempotent request (a read, a cancel, a submit with an ``Idempotency-Key``) is
    retried after a 429 or 503 and a dropped connection. A submit without a key only
    after a refusal that stored nothing (``SUBMIT_REFUSALS``) or a connection that never
    opened: after ``store_unavailable`` or a connection dropped mid-answer its job may
    have been committed (``GroupCommit._commit`` commits before it reads callbacks)."""
    if isinstance(exc, FaceFlowAPIError):
        return exc.status in RETRIED_STATUSES and (idempotent or exc.code in SUBMIT_REFUSALS)
    return idempotent or isinstance(exc, httpx.ConnectError)  # nothing was sent


class _Retrying:
    """One request's tries left and wait budget."""

    def __init__(self, policy: RetryPolicy, idempotent: bool) -> None:
        self.idempotent = idempotent
        self.tries = 0
        self.retries, self.budget = policy.retries, policy.max_retry_wait

    def delay(self, exc: Transient) -> float | None:
        """Seconds to wait before the next try after ``exc``; None: give up (raise it)."""
        if isinstance(exc, FaceFlowAPIError):
            exc.retried = self.tries > 0
        if self.tries >= self.retries or self.budget <= 0:
            return None
        if not retry_is_safe(exc, idempotent=self.idempotent):
            return None
        hint = getattr(exc, "retry_after", None) or BACKOFF_S * 2**self.tries
        delay = min(hint * (1 + random.uniform(0, JITTER)), self.budget)
        self.tries, self.budget = self.tries + 1, self.budget - delay
        return delay


@dataclass(frozen=True)
class _Request:
    method: str
    path: str
    json: Mapping[str, Any] | None = None
    headers: Mapping[str, str] | None = None
    files: list[tuple[str, tuple[str, bytes | IO[bytes], str]]] | None = None
    data: Mapping[str, str] | None = None
    body: bytes | None = None
    idempotent: bool = False
    """Safe to send twice: a read, a cancel, a submit with an ``Idempotency-Key``."""

    def content(self) -> dict[str, Any]:
        """httpx's keyword arguments for the request's body and headers; a file part is
        read from its start (again, on a retry)."""
        for _name, (_filename, content, _mime) in self.files or []:
            if not isinstance(content, bytes):
                content.seek(0)
        return {
            "json": self.json,
            "headers": self.headers,
            "files": self.files,
            "data": self.data,
            "content": self.body,
        }


def _get(path: str) -> _Request:
    return _Request("GET", path, idempotent=True)


def _is_ref(image: ImageInput) -> bool:
    return isinstance(image, str) and image.startswith(("data:", "https://", "http://"))


def _load(image: ImageInput) -> tuple[bytes, str]:
    """The bytes and MIME type of a path or of bytes."""
    if isinstance(image, bytes):
        return image, _sniff_mime(image) or "image/jpeg"
    path = Path(image)
    data = path.read_bytes()
    return data, _sniff_mime(data) or mimetypes.guess_type(path.name)[0] or "image/jpeg"


def _part(image: ImageInput) -> tuple[bytes | IO[bytes], str]:
    """A multipart file's content and MIME type: a video file stays an open file, which
    httpx streams (the caller closes it), anything else is read."""
    if not isinstance(image, bytes):
        path = Path(image)
        with path.open("rb") as head:
            mime = _sniff_mime(head.read(12))
        if mime is not None and mime.startswith("video/"):
            return path.open("rb"), mime  # closed by _close_files after the request
    return _load(image)


def as_image_ref(image: ImageInput) -> str:
    """A ``data:`` URI (for paths and bytes) or the URL as given."""
    if _is_ref(image):
        return str(image)
    data, mime = _load(image)
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _sniff_mime(data: bytes) -> str | None:
    if data[:3] == b"\xff\xd8\xff":
        return "image/jpeg"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "image/png"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    if data[4:8] == b"ftyp":
        return "video/quicktime" if data[8:10] == b"qt" else "video/mp4"
    if data[:4] == b"\x1a\x45\xdf\xa3":
        return "video/x-matroska"
    return None


class SubmitOptions(TypedDict, total=False):
    """The keyword options of ``submit`` (each may be left out)."""

    options: Mapping[str, Any] | None
    callback_url: str | None
    callback_events: list[str] | None
    deadline_seconds: int | None
    queue_timeout_seconds: int | None
    priority: str | None
    idempotency_key: str | None
    wait: int | None
    extra_sources: Sequence[ImageInput]
    references: Sequence[ImageInput]


class WaitOptions(TypedDict, total=False):
    """The keyword options of ``wait``: ``timeout`` (s, default 300), ``interval`` (s
    between polls, default 0.5), ``on_update`` (called with each job object polled)."""

    timeout: float
    interval: float
    on_update: Callable[[Job], None] | None


class _Waiting:
    """One ``wait``'s polling rule, the same for both clients."""

    def __init__(self, options: WaitOptions, policy: RetryPolicy) -> None:
        self.deadline = time.monotonic() + options.get("timeout", 300.0)
        self.interval = options.get("interval", 0.5)
        self.on_update = options.get("on_update")
        self.retries = policy.retries

    def rides_out(self, exc: Transient) -> bool:
        """Whether a poll that failed with ``exc`` (after its own retries) is polled again:
        when retries are on, a retry may help and ``timeout`` has not passed."""
        return (
            self.retries > 0
            and retry_is_safe(exc, idempotent=True)
            and time.monotonic() < self.deadline
        )

    def over(self, job: Job) -> bool:
        """Whether polling ends with ``job``: it is terminal or the time is up."""
        if self.on_update:
            self.on_update(job)
        return job["status"] in TERMINAL_STATUSES or time.monotonic() >= self.deadline


_PARAMS = (
    "callback_url",
    "callback_events",
    "deadline_seconds",
    "queue_timeout_seconds",
    "priority",
)
"""The submit options that travel as body fields (besides ``options``)."""


def _submit_request(source: ImageInput, target: ImageInput, kw: SubmitOptions) -> _Request:
    options, idempotency_key, wait = kw.get("options"), kw.get("idempotency_key"), kw.get("wait")
    extra_sources, references = kw.get("extra_sources", ()), kw.get("references", ())
    optional = {
        "options": dict(options) if options else None,
        **{k: kw.get(k) for k in _PARAMS},
    }
    params = {k: v for k, v in optional.items() if v is not None}
    headers, keyed = {}, bool(idempotency_key)
    if idempotency_key:
        headers["Idempotency-Key"] = idempotency_key
    if wait:
        headers["Prefer"] = f"wait={int(wait)}"
    sources = (source, *extra_sources)
    if not any(_is_ref(image) for image in (*sources, target, *references)):
        # Files go as multipart: no base64, and the API's JSON body limit is much smaller.
        parts = [("source", image) for image in sources] + [("target", target)]
        parts += [("reference", image) for image in references]
        files = [(name, (name, *_part(image))) for name, image in parts]
        form = {"params": json.dumps(params)}
        return _Request("POST", "/v1/jobs", None, headers, files, form, idempotent=keyed)
    body: dict[str, Any] = {"target": as_image_ref(target), **params}
    if extra_sources:  # a per-face mapping (options["mapping"]) says which face gets which
        body["sources"] = [as_image_ref(image) for image in sources]
    else:
        body["source"] = as_image_ref(source)
    if references:
        body["references"] = [as_image_ref(image) for image in references]
    return _Request("POST", "/v1/jobs", body, headers, idempotent=keyed)


def _cancel_request(job_id: str) -> _Request:
    """A cancel: idempotent (a job cancelled, or cancel_requested, stays so; a repeat of a
    cancel that went through answers 409 ``job_not_cancellable`` at worst, which the
    clients' ``cancel`` turns back into the cancelled job: ``_lost_cancel``)."""
    return _Request("POST", f"/v1/jobs/{job_id}/cancel", idempotent=True)


def _verify_request(data: bytes) -> _Request:
    """A verify: a POST only to carry the file; it reads and stores nothing (idempotent)."""
    headers = {"Content-Type": "application/octet-stream"}
    return _Request("POST", "/v1/verify", headers=headers, body=data, idempotent=True)


def _lost_cancel(exc: FaceFlowAPIError) -> bool:
    """Whether a cancel's 409 ``job_not_cancellable`` may answer its own earlier try: one
    that was served but whose answer was lost (the job is cancelled by it then)."""
    return exc.code == "job_not_cancellable" and exc.retried


def _cancelled(job: Job, exc: FaceFlowAPIError) -> Job:
    """``job`` when a cancel's lost answer left it cancelled; else ``exc`` stands."""
    if job.get("status") != "cancelled":
        raise exc
    return job


def _close_files(req: _Request) -> None:
    for _name, (_filename, content, _mime) in req.files or []:
        if not isinstance(content, bytes):
            content.close()


def _raise_for(response: httpx.Response) -> None:
    if response.is_success:
        return
    try:
        err = response.json().get("error", {})
        code, message = str(err.get("code", "http_error")), str(err.get("message", ""))
    except ValueError:
        code, message = "http_error", response.text[:200]
    retry = response.headers.get("Retry-After")
    raise FaceFlowAPIError(response.status_code, code, message, float(retry) if retry else None)


Transport = TypeVar("Transport", httpx.Client, httpx.AsyncClient)
Sent = TypeVar("Sent")


class _Connected(Generic[Transport]):
    """What both clients hold: an httpx client that sends the API key, and the retry rule
    (their options: ``FaceFlowClient``)."""

    _transport: type[Transport]

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        timeout: float = 70.0,
        retries: int = 3,
        max_retry_wait: float = 30.0,
    ) -> None:
        self._http: Transport = self._transport(
            base_url=base_url, timeout=timeout, headers={"Authorization": f"Bearer {api_key}"}
        )
        self._retry = RetryPolicy(retries, max_retry_wait)


class FaceFlowClient(_Connected[httpx.Client], Closing):
    """Synchronous client.

    ``retries`` and ``max_retry_wait`` (s, all waits of one request together) say how a
    request that the API answers 503 or 429, or whose connection fails, is sent again
    where that is safe (``RetryPolicy``, ``retry_is_safe``); ``retries=0``: never.
    ``timeout``: of each try, in seconds."""

    _transport = httpx.Client

    def close(self) -> None:
        self._http.close()

    def _with_retries(self, attempt: Callable[[], Sent], *, idempotent: bool) -> Sent:
        """``attempt()``, made again after a transient error while ``RetryPolicy`` allows."""
        retrying = self._retry.start(idempotent=idempotent)
        while True:
            try:
                return attempt()
            except TRANSIENT as exc:
                if (delay := retrying.delay(exc)) is None:
                    raise
            time.sleep(delay)

    def _send(self, req: _Request) -> httpx.Response:
        def attempt() -> httpx.Response:
            response = self._http.request(req.method, req.path, **req.content())
            _raise_for(response)
            return response

        try:
            return self._with_retries(attempt, idempotent=req.idempotent)
        finally:
            _close_files(req)

    def submit(
        self, source: ImageInput, target: ImageInput, **kwargs: Unpack[SubmitOptions]
    ) -> Job:
        """Submit a job; returns the job object (202, or 200 for an idempotent repeat).

        ``extra_sources`` (sources after ``source``) and ``references`` go with a per-face
        mapping in ``options["mapping"]``, e.g. ``[{"source": 1, "target": 2}]``. Without
        an ``idempotency_key`` only a refusal that stored nothing is retried."""
        req = _submit_request(source, target, kwargs)
        return self._send(req).json()  # type: ignore[no-any-return]

    def status(self, job_id: str) -> Job:
        """The job object."""
        return self._send(_get(f"/v1/jobs/{job_id}")).json()  # type: ignore[no-any-return]

    def cancel(self, job_id: str) -> Job:
        """Cancel a queued or running job (retried: a cancel sent twice changes nothing more;
        a try whose answer was lost and that cancelled the job gives the job, not the 409
        its repeat gets)."""
        try:
            return self._send(_cancel_request(job_id)).json()  # type: ignore[no-any-return]
        except FaceFlowAPIError as exc:
            if not _lost_cancel(exc):
                raise
            return _cancelled(self.status(job_id), exc)

    def verify(self, data: bytes) -> dict[str, Any]:
        """What ``POST /v1/verify`` finds in a file's bytes (its marks; the job id when the
        caller owns the job)."""
        return self._send(_verify_request(data)).json()  # type: ignore[no-any-return]

    def result(self, job_id: str) -> bytes:
        """The result image's bytes (after success)."""
        return self._send(_get(f"/v1/jobs/{job_id}/result")).content

    def download(self, job_id: str, path: Path) -> int:
        """Stream the result (an image or a video) into ``path``; its size in bytes. A
        retry writes the file again from its start."""

        def attempt() -> int:
            with self._http.stream("GET", f"/v1/jobs/{job_id}/result") as response:
                if not response.is_success:
                    response.read()
                    _raise_for(response)
                with path.open("wb") as out:
                    return sum(out.write(piece) for piece in response.iter_bytes(1 << 20))

        return self._with_retries(attempt, idempotent=True)

    def wait(self, job_id: str, **options: Unpack[WaitOptions]) -> Job:
        """Poll until the job is terminal or ``timeout`` passes; returns the last job object.
        A poll that fails after its retries is polled again while time is left."""
        waiting = _Waiting(options, self._retry)
        while True:
            try:
                if waiting.over(job := self.status(job_id)):
                    return job
            except TRANSIENT as exc:
                if not waiting.rides_out(exc):
                    raise
            time.sleep(waiting.interval)


class AsyncFaceFlowClient(_Connected[httpx.AsyncClient]):
    """Asynchronous client with the same methods, options and retries as ``FaceFlowClient``."""

    _transport = httpx.AsyncClient

    async def __aenter__(self) -> AsyncFaceFlowClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _send(self, req: _Request) -> httpx.Response:
        retrying = self._retry.start(idempotent=req.idempotent)
        try:
            while True:
                try:
                    response = await self._http.request(req.method, req.path, **req.content())
                    _raise_for(response)
                    return response
                except TRANSIENT as exc:
                    if (delay := retrying.delay(exc)) is None:
                        raise
                await asyncio.sleep(delay)
        finally:
            _close_files(req)

    async def submit(
        self, source: ImageInput, target: ImageInput, **kwargs: Unpack[SubmitOptions]
    ) -> Job:
        """Submit a job; returns the job object."""
        req = _submit_request(source, target, kwargs)
        return (await self._send(req)).json()  # type: ignore[no-any-return]

    async def status(self, job_id: str) -> Job:
        """The job object."""
        return (await self._send(_get(f"/v1/jobs/{job_id}"))).json()  # type: ignore[no-any-return]

    async def cancel(self, job_id: str) -> Job:
        """Cancel a queued or running job (as ``FaceFlowClient.cancel``)."""
        try:
            return (await self._send(_cancel_request(job_id))).json()  # type: ignore[no-any-return]
        except FaceFlowAPIError as exc:
            if not _lost_cancel(exc):
                raise
            return _cancelled(await self.status(job_id), exc)

    async def result(self, job_id: str) -> bytes:
        """The result image's bytes (after success)."""
        return (await self._send(_get(f"/v1/jobs/{job_id}/result"))).content

    async def wait(self, job_id: str, **options: Unpack[WaitOptions]) -> Job:
        """Poll until the job is terminal or ``timeout`` passes; returns the last job object."""
        waiting = _Waiting(options, self._retry)
        while True:
            try:
                if waiting.over(job := await self.status(job_id)):
                    return job
            except TRANSIENT as exc:
                if not waiting.rides_out(exc):
                    raise
            await asyncio.sleep(waiting.interval)


#: What a video's progress line calls the pass of each stage that has one.
_PASSES = {
    "analyse": ("analysing", "frames_analysed"),
    "render_chunk": ("rendering", "frames_done"),
}


def progress_line(job: Job) -> tuple[str, int | None, int]:
    """What a progress display shows of ``job``: a description (status, stage, and for a
    video the pass running, its frames, frames per second and ETA), and the frames total
    and done in that pass (None, 0 for a photo, or a video before it is probed)."""
    progress = job.get("progress") or {}
    stage = progress.get("stage") or job.get("stage")
    total = progress.get("frames_total") or None
    text = f"job {job['id']}: {job['status']}"
    if not total:
        return text + (f" ({stage})" if stage else ""), None, 0
    verb, field = _PASSES.get(stage or "", (None, "frames_done"))
    done = int(progress.get(field) or 0)
    if verb is None:  # probe, join, report, store
        text += f" ({stage}) {done}/{total} frames" if stage else f" {done}/{total} frames"
    else:
        text += f", {verb} {done}/{total} frames"
    if field == "frames_done":
        text += f", {progress.get('chunks_done', 0)}/{progress.get('chunks_total', 0)} chunks"
    if progress.get("fps"):
        text += f", {progress['fps']:.1f} fps"
    if progress.get("eta_seconds") is not None:
        text += f", ETA {progress['eta_seconds']:.0f} s"
    return text, total, done


def wait_with_progress(client: FaceFlowClient, job_id: str, *, timeout: float = 300.0) -> Job:
    """``client.wait`` with a rich progress display: status and stage, and for a video a
    bar of the pass running (analysing, then rendering its frames) with frames per second
    and an ETA to the last frame rendered."""
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
    with Progress(*columns) as bar:
        task = bar.add_task(f"job {job_id}: queued", total=None)

        def update(job: Job) -> None:
            text, total, done = progress_line(job)
            bar.update(task, description=text, total=total, completed=done)

        return client.wait(job_id, timeout=timeout, on_update=update)
