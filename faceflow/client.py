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
from typing import Any

import httpx

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
    files: list[tuple[str, tuple[str, bytes, str]]] | None = None
    data: Mapping[str, str] | None = None


def _is_ref(image: ImageInput) -> bool:
    return isinstance(image, str) and image.startswith(("data:", "https://", "http://"))


def _load(image: ImageInput) -> tuple[bytes, str]:
    """The bytes and MIME type of a path or of bytes."""
    if isinstance(image, bytes):
        return image, _sniff_mime(image) or "image/jpeg"
    path = Path(image)
    data = path.read_bytes()
    return data, _sniff_mime(data) or mimetypes.guess_type(path.name)[0] or "image/jpeg"


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
    return None


def _submit_request(
    source: ImageInput,
    target: ImageInput,
    *,
    options: Mapping[str, Any] | None,
    callback_url: str | None,
    callback_events: list[str] | None,
    deadline_seconds: int | None,
    queue_timeout_seconds: int | None,
    priority: str | None,
    idempotency_key: str | None,
    wait: int | None,
    extra_sources: Sequence[ImageInput] = (),
    references: Sequence[ImageInput] = (),
) -> _Request:
    optional = {
        "options": dict(options) if options else None,
        "callback_url": callback_url,
        "callback_events": callback_events,
        "deadline_seconds": deadline_seconds,
        "queue_timeout_seconds": queue_timeout_seconds,
        "priority": priority,
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
        files = [(name, (name, *_load(image))) for name, image in parts]
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


class FaceFlowClient:
    """Synchronous client."""

    def __init__(self, base_url: str, api_key: str, *, timeout: float = 70.0) -> None:
        self._http = httpx.Client(
            base_url=base_url, timeout=timeout, headers={"Authorization": f"Bearer {api_key}"}
        )

    def __enter__(self) -> FaceFlowClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _send(self, req: _Request) -> httpx.Response:
        response = self._http.request(
            req.method, req.path, json=req.json, headers=req.headers, files=req.files, data=req.data
        )
        _raise_for(response)
        return response

    def submit(
        self,
        source: ImageInput,
        target: ImageInput,
        *,
        options: Mapping[str, Any] | None = None,
        callback_url: str | None = None,
        callback_events: list[str] | None = None,
        deadline_seconds: int | None = None,
        queue_timeout_seconds: int | None = None,
        priority: str | None = None,
        idempotency_key: str | None = None,
        wait: int | None = None,
        extra_sources: Sequence[ImageInput] = (),
        references: Sequence[ImageInput] = (),
    ) -> Job:
        """Submit a job; returns the job object (202, or 200 for an idempotent repeat).

        ``extra_sources`` (sources after ``source``) and ``references`` go with a per-face
        mapping in ``options["mapping"]``, e.g. ``[{"source": 1, "target": 2}]``."""
        req = _submit_request(
            source,
            target,
            options=options,
            callback_url=callback_url,
            callback_events=callback_events,
            deadline_seconds=deadline_seconds,
            queue_timeout_seconds=queue_timeout_seconds,
            priority=priority,
            idempotency_key=idempotency_key,
            wait=wait,
            extra_sources=extra_sources,
            references=references,
        )
        return self._send(req).json()  # type: ignore[no-any-return]

    def status(self, job_id: str) -> Job:
        """The job object."""
        return self._send(_Request("GET", f"/v1/jobs/{job_id}")).json()  # type: ignore[no-any-return]

    def cancel(self, job_id: str) -> Job:
        """Cancel a queued or running job."""
        return self._send(_Request("POST", f"/v1/jobs/{job_id}/cancel")).json()  # type: ignore[no-any-return]

    def result(self, job_id: str) -> bytes:
        """The result image's bytes (after success)."""
        return self._send(_Request("GET", f"/v1/jobs/{job_id}/result")).content

    def wait(
        self,
        job_id: str,
        *,
        timeout: float = 300.0,
        interval: float = 0.5,
        on_update: Callable[[Job], None] | None = None,
    ) -> Job:
        """Poll until the job is terminal or ``timeout`` passes; returns the last job object."""
        deadline = time.monotonic() + timeout
        while True:
            job = self.status(job_id)
            if on_update:
                on_update(job)
            if job["status"] in TERMINAL_STATUSES or time.monotonic() >= deadline:
                return job
            time.sleep(interval)


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
        response = await self._http.request(
            req.method, req.path, json=req.json, headers=req.headers, files=req.files, data=req.data
        )
        _raise_for(response)
        return response

    async def submit(
        self,
        source: ImageInput,
        target: ImageInput,
        *,
        options: Mapping[str, Any] | None = None,
        callback_url: str | None = None,
        callback_events: list[str] | None = None,
        deadline_seconds: int | None = None,
        queue_timeout_seconds: int | None = None,
        priority: str | None = None,
        idempotency_key: str | None = None,
        wait: int | None = None,
        extra_sources: Sequence[ImageInput] = (),
        references: Sequence[ImageInput] = (),
    ) -> Job:
        """Submit a job; returns the job object."""
        req = _submit_request(
            source,
            target,
            options=options,
            callback_url=callback_url,
            callback_events=callback_events,
            deadline_seconds=deadline_seconds,
            queue_timeout_seconds=queue_timeout_seconds,
            priority=priority,
            idempotency_key=idempotency_key,
            wait=wait,
            extra_sources=extra_sources,
            references=references,
        )
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

    async def wait(
        self,
        job_id: str,
        *,
        timeout: float = 300.0,
        interval: float = 0.5,
        on_update: Callable[[Job], None] | None = None,
    ) -> Job:
        """Poll until the job is terminal or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while True:
            job = await self.status(job_id)
            if on_update:
                on_update(job)
            if job["status"] in TERMINAL_STATUSES or time.monotonic() >= deadline:
                return job
            await asyncio.sleep(interval)


def wait_with_progress(client: FaceFlowClient, job_id: str, *, timeout: float = 300.0) -> Job:
    """``client.wait`` with a rich progress display naming status and stage."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn()) as bar:
        task = bar.add_task(f"job {job_id}: queued", total=None)

        def update(job: Job) -> None:
            stage = f" ({job['stage']})" if job.get("stage") else ""
            bar.update(task, description=f"job {job_id}: {job['status']}{stage}")

        return client.wait(job_id, timeout=timeout, on_update=update)
