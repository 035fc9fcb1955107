"""``/healthz`` latency from another client while hostile JSON bodies are sent and refused.

Starts ``uvicorn webapi.main:app`` on 127.0.0.1 (a subprocess, stopped by PID) against a
fresh SQLite job store, creates a user, then for each hostile body POSTs it to ``/v1/jobs``
while a second client GETs ``/healthz`` every 20 ms; prints, per body, the answer's status
and time, the ``/healthz`` latency (median and max, ms) and the API's RSS (peak and after).

    PYTHONPATH=$PWD .venv/bin/python bench/hostile_body.py
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from faceflow.testing.bodies import deep, many_keys  # noqa: E402
from faceflow.testing.databases import job_store  # noqa: E402
from faceflow.testing.net import free_port, wait_http  # noqa: E402
from faceflow.testing.procstat import memory_kb  # noqa: E402


def probe(base_url: str, stop: threading.Event, out: list[float]) -> None:
    """GET /healthz every 20 ms until ``stop``; latencies in seconds into ``out``."""
    with httpx.Client(base_url=base_url, timeout=60) as client:
        while not stop.is_set():
            started = time.perf_counter()
            client.get("/healthz").raise_for_status()
            out.append(time.perf_counter() - started)
            time.sleep(0.02)


def attack(base_url: str, headers: dict[str, str], body: bytes, pid: int) -> dict[str, object]:
    """Send ``body`` while probing /healthz; the figures."""
    latencies: list[float] = []
    stop = threading.Event()
    prober = threading.Thread(target=probe, args=(base_url, stop, latencies))
    prober.start()
    time.sleep(0.3)
    started = time.perf_counter()
    try:
        response = httpx.post(
            f"{base_url}/v1/jobs",
            content=body,
            headers={**headers, "Content-Type": "application/json"},
            timeout=120,
        )
        outcome = f"{response.status_code} {response.json().get('error', {}).get('code')}"
    except httpx.HTTPError as exc:  # the server may close the connection mid-upload
        outcome = type(exc).__name__
    answered = time.perf_counter() - started
    time.sleep(0.3)
    stop.set()
    prober.join()
    return {
        "answer": outcome,
        "answer_s": round(answered, 2),
        "healthz_median_ms": round(1000 * statistics.median(latencies), 1),
        "healthz_max_ms": round(1000 * max(latencies), 1),
        "healthz_probes": len(latencies),
        **memory_kb(pid),
    }


def main() -> None:
    from sqlmodel import Session

    from webapi import crud
    from webapi.config import Settings
    from webapi.db import create_engine

    workdir = Path(tempfile.mkdtemp(prefix="faceflow-hostile-"))
    with job_store("sqlite", workdir) as url:
        settings = Settings.model_validate({"database_url": url})
        engine = create_engine(url)
        with Session(engine, expire_on_commit=False) as session:
            user = crud.create_user(
                session, name="bench", quota=100, pepper=settings.api_key_pepper.get_secret_value()
            )
        engine.dispose()
        env = {
            **os.environ,
            "FACEFLOW_HOME": str(workdir),
            "FACEFLOW_DATABASE_URL": url,
            "FACEFLOW_RUN_RELAY": "false",
        }
        port = free_port()
        server = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "webapi.main:app", "--host", "127.0.0.1",
             "--port", str(port), "--log-level", "warning", "--no-access-log"],
            cwd=REPO, env=env, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        base_url = f"http://127.0.0.1:{port}"
        bodies: dict[str, Callable[[], bytes]] = {
            "keys_25MB_2M": lambda: many_keys(25_000_000),
            "keys_7MB": lambda: many_keys(7_000_000),
            "nested_25MB": lambda: deep(25_000_000),
            "nested_7MB": lambda: deep(7_000_000),
        }
        try:
            wait_http(f"{base_url}/healthz", 30, step_s=0.1, alive=lambda: server.poll() is None)
            results: dict[str, object] = {"idle": memory_kb(server.pid)}
            headers = {"Authorization": f"Bearer {user.api_key}"}
            for name, make in bodies.items():
                results[name] = attack(base_url, headers, make(), server.pid)
            print(json.dumps(results, indent=1))
        finally:
            server.terminate()
            server.wait(timeout=30)


if __name__ == "__main__":
    main()
