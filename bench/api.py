"""Submit and status-GET throughput of the web API on loopback (issue 4's benchmark).

Starts ``uvicorn webapi.main:app`` on 127.0.0.1 (a subprocess with ``--workers N``, stopped
by PID) against a fresh SQLite file or PostgreSQL schema, creates a user, then for
``--seconds`` submits two ~64 KB JPEGs as data: URIs from ``--concurrency`` keep-alive
connections, and afterwards GETs the submitted jobs for the same time. Prints throughput,
p50/p99 latency, throughput per fifth of the run (the job table grows: nothing drains it)
and the server's CPU seconds per request as JSON.

The default client is a minimal HTTP/1.1 keep-alive client on asyncio streams (the load
generator shares the machine's cores with the server: httpx costs about as much CPU per
request as the API itself); ``--client httpx`` uses httpx.AsyncClient instead.

    .venv/bin/python bench/api.py --database sqlite --seconds 30 --relay
    .venv/bin/python bench/api.py --database postgresql --seconds 30 --relay --workers 2
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from faceflow.testing.databases import job_store  # noqa: E402
from faceflow.testing.net import free_port, wait_http  # noqa: E402
from faceflow.testing.procstat import process_tree_cpu_s  # noqa: E402


def jpeg_near(target_bytes: int, seed_image: Any) -> bytes:
    """A JPEG of a sample photo, resized so it is close to ``target_bytes``."""
    from PIL import Image

    image = Image.fromarray(seed_image)
    side = image.width
    data = b""
    for _ in range(12):
        buffer = io.BytesIO()
        image.resize((side, side)).save(buffer, format="JPEG", quality=90)
        data = buffer.getvalue()
        if abs(len(data) - target_bytes) < target_bytes * 0.1:
            break
        side = max(32, int(side * (target_bytes / len(data)) ** 0.5))
    return data


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


Request = Any  # awaitable factory: (client) -> (status code, body bytes)


class RawClient:
    """One HTTP/1.1 keep-alive connection: sends prepared requests, reads status and body."""

    def __init__(self, host: str, port: int, headers: dict[str, str]) -> None:
        self.host, self.port = host, port
        self.headers = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def request(
        self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
    ) -> tuple[int, bytes]:
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        assert self._reader is not None
        extra = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
        head = f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\n{self.headers}{extra}"
        if body:
            head += f"Content-Length: {len(body)}\r\n"
        self._writer.write(head.encode() + b"\r\n" + body)
        status = int((await self._reader.readline()).split()[1])
        length = 0
        while (line := await self._reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        return status, await self._reader.readexactly(length)

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


class HttpxClient:
    """The same interface over one shared httpx.AsyncClient."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def request(
        self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
    ) -> tuple[int, bytes]:
        response = await self.client.request(method, path, content=body or None, headers=headers)
        return response.status_code, response.content

    async def close(self) -> None:
        return None


async def hammer(
    base_url: str,
    headers: dict[str, str],
    seconds: float,
    concurrency: int,
    make: Request,
    client_kind: str = "raw",
) -> tuple[list[tuple[float, float]], dict[int, int], list[str]]:
    """Run ``make(client)`` requests from ``concurrency`` connections for ``seconds``.

    Returns (start offset, latency) per request, counts by status code, and the ids of
    jobs answered 202.
    """
    samples: list[tuple[float, float]] = []
    codes: dict[int, int] = {}
    ids: list[str] = []
    begin = time.perf_counter()
    stop_at = begin + seconds
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, limits=limits, timeout=30
    ) as shared:
        host, port = base_url.removeprefix("http://").split(":")

        async def worker() -> None:
            client = (
                RawClient(host, int(port), headers) if client_kind == "raw" else HttpxClient(shared)
            )
            try:
                while time.perf_counter() < stop_at:
                    started = time.perf_counter()
                    status, body = await make(client)
                    samples.append((started - begin, time.perf_counter() - started))
                    codes[status] = codes.get(status, 0) + 1
                    if status == 202:
                        ids.append(json.loads(body)["id"])
            finally:
                await client.close()

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return samples, codes, ids


def summary(
    samples: list[tuple[float, float]], codes: dict[int, int], seconds: float
) -> dict[str, Any]:
    latencies = [latency for _, latency in samples]
    fifths = [0] * 5
    for offset, _ in samples:
        fifths[min(4, int(5 * offset / seconds))] += 1
    return {
        "requests": len(latencies),
        "per_s": round(len(latencies) / seconds, 1),
        "p50_ms": round(1000 * percentile(latencies, 0.5), 1),
        "p99_ms": round(1000 * percentile(latencies, 0.99), 1),
        "mean_ms": round(1000 * statistics.fmean(latencies), 1) if latencies else None,
        "per_s_by_fifth": [round(n / (seconds / 5), 1) for n in fifths],
        "codes": codes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database", choices=["sqlite", "postgresql"], default="sqlite")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--relay", action="store_true", help="run the relay in the API process")
    parser.add_argument("--image-kb", type=int, default=64)
    parser.add_argument("--workers", type=int, default=1, help="uvicorn worker processes")
    parser.add_argument("--client", choices=["raw", "httpx"], default="raw")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="faceflow-bench-"))
    with job_store(args.database, workdir) as url:
        run(args, url, workdir)


def run(args: argparse.Namespace, url: str, workdir: Path) -> None:
    """Start the API on the job store at ``url``, hammer it, print the figures."""
    from sqlmodel import Session

    from faceflow.samples import astronaut_rgb, grace_hopper_rgb
    from webapi import crud
    from webapi.config import Settings
    from webapi.db import create_engine

    env = {
        **os.environ,
        "FACEFLOW_HOME": str(workdir),
        "FACEFLOW_DATABASE_URL": url,
        "FACEFLOW_STORAGE_URL": (workdir / "storage").as_uri(),
        "FACEFLOW_RUN_RELAY": "true" if args.relay else "false",
        "FACEFLOW_WORKER_SLOTS": "1000000",
        "FACEFLOW_ALLOW_PRIVATE_URLS": "true",
    }
    settings = Settings.model_validate({"database_url": url})
    engine = create_engine(url)
    with Session(engine, expire_on_commit=False) as session:
        user = crud.create_user(
            session, name="bench", quota=10**9, pepper=settings.api_key_pepper.get_secret_value()
        )
    engine.dispose()

    source = jpeg_near(args.image_kb * 1024, grace_hopper_rgb())
    target = jpeg_near(args.image_kb * 1024, astronaut_rgb())
    body = json.dumps(
        {
            "source": "data:image/jpeg;base64," + base64.b64encode(source).decode(),
            "target": "data:image/jpeg;base64," + base64.b64encode(target).decode(),
        }
    ).encode()

    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "webapi.main:app", "--host", "127.0.0.1",
         "--port", str(port), "--log-level", "warning", "--no-access-log",
         "--workers", str(args.workers)],
        cwd=REPO, env=env,
    )  # fmt: skip
    base_url = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {user.api_key}"}
    try:
        wait_http(f"{base_url}/healthz", 30, step_s=0.1, alive=lambda: server.poll() is None)
        submit_headers = {"Content-Type": "application/json"}

        async def post(client: RawClient | HttpxClient) -> tuple[int, bytes]:
            return await client.request("POST", "/v1/jobs", body, submit_headers)

        cpu_before = process_tree_cpu_s(server.pid)
        submit_samples, submit_codes, ids = asyncio.run(
            hammer(base_url, headers, args.seconds, args.concurrency, post, args.client)
        )
        cpu_submit = process_tree_cpu_s(server.pid) - cpu_before
        counter = iter(range(10**12))

        async def get(client: RawClient | HttpxClient) -> tuple[int, bytes]:
            return await client.request("GET", f"/v1/jobs/{ids[next(counter) % len(ids)]}")

        cpu_before = process_tree_cpu_s(server.pid)
        get_samples, get_codes, _ = (
            asyncio.run(hammer(base_url, headers, args.seconds, args.concurrency, get, args.client))
            if ids
            else ([], {}, [])
        )
        cpu_get = process_tree_cpu_s(server.pid) - cpu_before
        result = {
            "database": args.database,
            "relay": args.relay,
            "workers": args.workers,
            "client": args.client,
            "seconds": args.seconds,
            "concurrency": args.concurrency,
            "image_bytes": [len(source), len(target)],
            "submit": {
                **summary(submit_samples, submit_codes, args.seconds),
                "server_cpu_ms_per_request": round(
                    1000 * cpu_submit / max(1, len(submit_samples)), 2
                ),
            },
            "get": {
                **summary(get_samples, get_codes, args.seconds),
                "server_cpu_ms_per_request": round(1000 * cpu_get / max(1, len(get_samples)), 2),
            },
        }
        print(json.dumps(result, indent=2))
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    main()
