"""Submit and status-GET throughput of the web API on loopback (issue 4's benchmark).

Starts ``uvicorn webapi.main:app`` on 127.0.0.1 (a subprocess, stopped by PID) against a
fresh SQLite file or PostgreSQL schema, creates a user, then for ``--seconds`` submits
two ~64 KB JPEGs as data: URIs from ``--concurrency`` async clients, and afterwards
GETs the submitted jobs for the same time. Prints throughput and p50/p99 latency as JSON.

    .venv/bin/python bench/api.py --database sqlite --seconds 30
    .venv/bin/python bench/api.py --database postgresql --seconds 30 --relay
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa

REPO = Path(__file__).resolve().parents[1]
PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def hammer(
    base_url: str, headers: dict[str, str], seconds: float, concurrency: int, make: Any
) -> tuple[list[float], dict[int, int], list[str]]:
    """Run ``make(client)`` requests from ``concurrency`` workers for ``seconds``."""
    latencies: list[float] = []
    codes: dict[int, int] = {}
    ids: list[str] = []
    stop_at = time.perf_counter() + seconds
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, limits=limits, timeout=30
    ) as client:

        async def worker() -> None:
            while time.perf_counter() < stop_at:
                started = time.perf_counter()
                response = await make(client)
                latencies.append(time.perf_counter() - started)
                codes[response.status_code] = codes.get(response.status_code, 0) + 1
                if response.status_code == 202:
                    ids.append(response.json()["id"])

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, codes, ids


def summary(latencies: list[float], codes: dict[int, int], seconds: float) -> dict[str, Any]:
    return {
        "requests": len(latencies),
        "per_s": round(len(latencies) / seconds, 1),
        "p50_ms": round(1000 * percentile(latencies, 0.5), 1),
        "p99_ms": round(1000 * percentile(latencies, 0.99), 1),
        "mean_ms": round(1000 * statistics.fmean(latencies), 1) if latencies else None,
        "codes": codes,
    }


def prepare_database(kind: str, workdir: Path) -> tuple[str, str | None]:
    """A migrated, empty job store: (url, PostgreSQL schema to drop or None)."""
    from webapi.migrations import upgrade

    if kind == "sqlite":
        url = f"sqlite:///{workdir / 'bench.db'}"
        upgrade(url)
        return url, None
    schema = f"bench_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(PG_URL)
    with admin.begin() as connection:
        connection.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    admin.dispose()
    url = f"{PG_URL}?options=-csearch_path%3D{schema}"
    upgrade(url)
    return url, schema


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database", choices=["sqlite", "postgresql"], default="sqlite")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--relay", action="store_true", help="run the relay in the API process")
    parser.add_argument("--image-kb", type=int, default=64)
    args = parser.parse_args()

    from sqlmodel import Session

    from faceflow.samples import astronaut_rgb, grace_hopper_rgb
    from webapi import crud
    from webapi.config import Settings
    from webapi.db import create_engine

    workdir = Path(tempfile.mkdtemp(prefix="faceflow-bench-"))
    url, schema = prepare_database(args.database, workdir)
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
         "--port", str(port), "--log-level", "warning", "--no-access-log"],
        cwd=REPO, env=env,
    )  # fmt: skip
    base_url = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {user.api_key}"}
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{base_url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the API did not start")
            time.sleep(0.1)

        async def post(client: httpx.AsyncClient) -> httpx.Response:
            return await client.post(
                "/v1/jobs", content=body, headers={"Content-Type": "application/json"}
            )

        submit_lat, submit_codes, ids = asyncio.run(
            hammer(base_url, headers, args.seconds, args.concurrency, post)
        )
        counter = iter(range(10**12))

        async def get(client: httpx.AsyncClient) -> httpx.Response:
            return await client.get(f"/v1/jobs/{ids[next(counter) % len(ids)]}")

        get_lat, get_codes, _ = (
            asyncio.run(hammer(base_url, headers, args.seconds, args.concurrency, get))
            if ids
            else ([], {}, [])
        )
        result = {
            "database": args.database,
            "relay": args.relay,
            "seconds": args.seconds,
            "concurrency": args.concurrency,
            "image_bytes": [len(source), len(target)],
            "submit": summary(submit_lat, submit_codes, args.seconds),
            "get": summary(get_lat, get_codes, args.seconds),
        }
        print(json.dumps(result, indent=2))
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
        if schema is not None:
            admin = sa.create_engine(PG_URL)
            with admin.begin() as connection:
                connection.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
            admin.dispose()


if __name__ == "__main__":
    main()
