"""Python client of the FaceFlow REST API (httpx; sync and async).

```python
from faceflow.client import FaceFlowClient
with FaceFlowClient("http://127.0.0.1:8000", api_key="ff_...") as ff:
    job = ff.submit("me.jpg", "photo.jpg", options={"identity_weight": 0.8})
    job = ff.wait(job["id"], timeout=120)
    Path("out.png").write_bytes(ff.result(job["id"]))
```
Both clients share the request builders below; only the transport differs.
"""

from __future__ import annotations

import asyncio
import base64
import json
import mimetypes
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypedDict, Unpack

import httpx

from tasks.closing import Closing

TERMINAL_STATUSES = frozenset({"succeeded", "failed", "expired", "cancelled"})

Job = dict[str, Any]
ImageInput = str | bytes | Path
"""A local path, raw bytes, a ``data:`` URI or an ``https://`` URL."""


class FaceFlowAPIError(Exception):
    """An error answer of the API: HTTP status, error code, message and Retry-After."""

    def __init__(
        self, status: int, code: str, message: str, retry_after: float | None = None
    ) -> None:
        self.status, self.code, self.message, self.retry_after = status, code, message, retry_after
        super().__init__(f"{status} {code}: {message}")


@dataclass(frozen=True)
class _Request:
    method: str
    path: str
    json: Mapping[str, Any] | None = None
    headers: Mapping[str, str] | None = None
    files: list[tuple[str, tuple[str, bytes | IO[bytes], str]]] | None = None
    data: Mapping[str, str] | None = None

    def content(self) -> dict[str, Any]:
        """httpx's keyword arguments for the request's body and headers."""
        return {"json": self.json, "headers": self.headers, "files": self.files, "data": self.data}


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

    def __init__(self, options: WaitOptions) -> None:
        self.deadline = time.monotonic() + options.get("timeout", 300.0)
        self.interval = options.get("interval", 0.5)
        self.on_update = options.get("on_update")

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
    headers = {}
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
        return _Request("POST", "/v1/jobs", None, headers, files=files, data=form)
    body: dict[str, Any] = {"target": as_image_ref(target), **params}
    if extra_sources:  # a per-face mapping (options["mapping"]) says which face gets which
        body["sources"] = [as_image_ref(image) for image in sources]
    else:
        body["source"] = as_image_ref(source)
    if references:
        body["references"] = [as_image_ref(image) for image in references]
    return _Request("POST", "/v1/jobs", body, headers)


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


class FaceFlowClient(Closing):
    """Synchronous client."""

    def __init__(self, base_url: str, api_key: str, *, timeout: float = 70.0) -> None:
        self._http = httpx.Client(
            base_url=base_url, timeout=timeout, headers={"Authorization": f"Bearer {api_key}"}
        )

    def close(self) -> None:
        self._http.close()

    def _send(self, req: _Request) -> httpx.Response:
        try:
            response = self._http.request(req.method, req.path, **req.content())
        finally:
            _close_files(req)
        _raise_for(response)
        return response

    def submit(
        self, source: ImageInput, target: ImageInput, **kwargs: Unpack[SubmitOptions]
    ) -> Job:
        """Submit a job; returns the job object (202, or 200 for an idempotent repeat).

        ``extra_sources`` (sources after ``source``) and ``references`` go with a per-face
        mapping in ``options["mapping"]``, e.g. ``[{"source": 1, "target": 2}]``."""
        req = _submit_request(source, target, kwargs)
        return self._send(req).json()  # type: ignore[no-any-return]

    def status(self, job_id: str) -> Job:
        """The job object."""
        return self._send(_Request("GET", f"/v1/jobs/{job_id}")).json()  # type: ignore[no-any-return]

    def cancel(self, job_id: str) -> Job:
        """Cancel a queued or running job."""
        return self._send(_Request("POST", f"/v1/jobs/{job_id}/cancel")).json()  # type: ignore[no-any-return]

    def verify(self, data: bytes) -> dict[str, Any]:
        """What ``POST /v1/verify`` finds in a file's bytes (its marks; the job id when the
        caller owns the job)."""
        headers = {"Content-Type": "application/octet-stream"}
        response = self._http.post("/v1/verify", content=data, headers=headers)
        _raise_for(response)
        return response.json()  # type: ignore[no-any-return]

    def result(self, job_id: str) -> bytes:
        """The result image's bytes (after success)."""
        return self._send(_Request("GET", f"/v1/jobs/{job_id}/result")).content

    def download(self, job_id: str, path: Path) -> int:
        """Stream the result (an image or a video) into ``path``; its size in bytes."""
        with self._http.stream("GET", f"/v1/jobs/{job_id}/result") as response:
            if not response.is_success:
                response.read()
                _raise_for(response)
            size = 0
            with path.open("wb") as out:
                for piece in response.iter_bytes(1 << 20):
                    size += out.write(piece)
        return size

    def wait(self, job_id: str, **options: Unpack[WaitOptions]) -> Job:
        """Poll until the job is terminal or ``timeout`` passes; returns the last job object."""
        waiting = _Waiting(options)
        while not waiting.over(job := self.status(job_id)):
            time.sleep(waiting.interval)
        return job


class AsyncFaceFlowClient:
    """Asynchronous client with the same methods as ``FaceFlowClient``."""

    def __init__(self, base_url: str, api_key: str, *, timeout: float = 70.0) -> None:
        self._http = httpx.AsyncClient(
            base_url=base_url, timeout=timeout, headers={"Authorization": f"Bearer {api_key}"}
        )

    async def __aenter__(self) -> AsyncFaceFlowClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _send(self, req: _Request) -> httpx.Response:
        try:
            response = await self._http.request(req.method, req.path, **req.content())
        finally:
            _close_files(req)
        _raise_for(response)
        return response

    async def submit(
        self, source: ImageInput, target: ImageInput, **kwargs: Unpack[SubmitOptions]
    ) -> Job:
        """Submit a job; returns the job object."""
        req = _submit_request(source, target, kwargs)
        return (await self._send(req)).json()  # type: ignore[no-any-return]

    async def status(self, job_id: str) -> Job:
        """The job object."""
        return (await self._send(_Request("GET", f"/v1/jobs/{job_id}"))).json()  # type: ignore[no-any-return]

    async def cancel(self, job_id: str) -> Job:
        """Cancel a queued or running job."""
        return (await self._send(_Request("POST", f"/v1/jobs/{job_id}/cancel"))).json()  # type: ignore[no-any-return]

    async def result(self, job_id: str) -> bytes:
        """The result image's bytes (after success)."""
        return (await self._send(_Request("GET", f"/v1/jobs/{job_id}/result"))).content

    async def wait(self, job_id: str, **options: Unpack[WaitOptions]) -> Job:
        """Poll until the job is terminal or ``timeout`` passes; returns the last job object."""
        waiting = _Waiting(options)
        while not waiting.over(job := await self.status(job_id)):
            await asyncio.sleep(waiting.interval)
        return job


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
