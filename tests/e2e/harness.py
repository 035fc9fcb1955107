"""Helpers of the end-to-end suites: ``faceflow up`` as a subprocess, found and stopped by
the processes that carry its home, and jobs watched over real HTTP."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import httpx
import pytest

from faceflow.prefect_server import AUTH_FILE
from faceflow.testing.wait import poll, poll_value
from webapi.prefect_api import auth_headers

BIN = Path(sys.executable).parent
TERMINAL = {"succeeded", "failed", "expired", "cancelled"}


def pids_with_home(home: Path) -> list[int]:
    """Every live process whose environment names this stack's home."""
    marker = f"FACEFLOW_HOME={home}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                status = (entry / "status").read_text()
                if "State:\tZ" not in status:
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


def stop_unready(proc: subprocess.Popen[bytes], home: Path) -> None:
    """Stop a stack that never became ready: SIGTERM to ``faceflow up`` (it stops its
    children), then SIGKILL to whatever of this home is left (each child has its own
    session, so killing ``faceflow up`` alone would orphan them)."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the whole stack, not just faceflow up
    for pid in pids_with_home(home):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def start_stack(
    home: Path, args: Sequence[str], env: Mapping[str, str], ready_s: float = 480
) -> subprocess.Popen[bytes]:
    """``faceflow up --home HOME ARGS...`` logging to ``HOME/../up.log``, returned once its
    API answers ``/readyz`` and it printed ``ready:`` (the test fails, with the log's tail,
    if it exits or is not ready in ``ready_s``: each prefect CLI step took 30-40 s at load
    10+)."""
    log_path = home.parent / "up.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [str(BIN / "faceflow"), "up", "--home", str(home), *args],
            env=dict(env), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    port = args[list(args).index("--api-port") + 1]

    def ready() -> bool:
        assert proc.poll() is None, log_path.read_text()
        return (
            httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200
            and b"ready:" in log_path.read_bytes()
        )

    if poll(ready, ready_s, step_s=1, ignore=(httpx.HTTPError,)):
        return proc
    stop_unready(proc, home)
    pytest.fail("stack not ready: " + log_path.read_text()[-3000:])


def stop_stack(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to ``faceflow up`` (it stops its children by PID); SIGKILL to its group if it
    does not end in 60 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def create_user(env: Mapping[str, str], name: str) -> dict[str, str]:
    """``faceflow users create NAME``: its printed fields (``api key``, ``webhook secret``)."""
    created = subprocess.run(
        [str(BIN / "faceflow"), "users", "create", name],
        env=dict(env), capture_output=True, text=True, check=True,
    )  # fmt: skip
    fields = dict(line.split(":", 1) for line in created.stdout.splitlines() if ":" in line)
    return {key: value.strip() for key, value in fields.items()}


def prefect_auth(home: Path) -> str:
    """The Prefect API credential ``faceflow up`` made under its home."""
    return (home / AUTH_FILE).read_text().strip()


def prefect_client(home: Path, api_url: str) -> httpx.Client:
    """A client of the stack's Prefect API with its credential (401 without it)."""
    headers = auth_headers(auth_string=prefect_auth(home))
    return httpx.Client(base_url=api_url, headers=headers, timeout=30)


class StackClient:
    """The ``client()`` of a stack: a client of its API at ``api`` as the user of
    ``api_key`` (both fields of the dataclass it is mixed into)."""

    api: str
    api_key: str
    client_timeout_s: ClassVar[float] = 30

    def client(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.api,
            headers={"Authorization": f"Bearer {self.api_key}"},
            timeout=self.client_timeout_s,
        )


def watch(client: httpx.Client, job_id: str, timeout: float = 180) -> tuple[dict, list[str]]:
    """Poll a job until it ends: the job and the statuses seen on the way."""
    seen: list[str] = []

    def ended() -> dict | None:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if not seen or seen[-1] != job["status"]:
            seen.append(job["status"])
        return job if job["status"] in TERMINAL else None

    job = poll_value(ended, timeout, step_s=0.2)
    if job is None:
        raise AssertionError(f"job {job_id} not terminal after {timeout} s: {seen}")
    return job, seen


def pid_of(home: Path, word: bytes) -> int:
    """The stack process whose command line has ``word``."""
    for pid in pids_with_home(home):
        try:
            if word in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"):
                return pid
        except OSError:
            continue
    raise AssertionError(f"no stack process with {word!r} in its command line")


@dataclass(frozen=True)
class LocalStack:
    """A ``faceflow up`` stack on loopback ports: its home, environment, API and Prefect
    API URLs, process, and a Prefect API client with its credential."""

    home: Path
    env: dict[str, str]
    api: str
    prefect_api: str
    process: subprocess.Popen[bytes]
    prefect: httpx.Client


@contextlib.contextmanager
def local_stack(home: Path, **extra_env: str) -> Iterator[LocalStack]:
    """Start ``faceflow up`` under ``home`` (settings saved in its blocks apply to the next
    run: no block cache) with ``extra_env``; stop it, and close its client, on exit."""
    from faceflow.testing.net import free_port

    api_port, prefect_port = free_port(), free_port()
    env = {
        **os.environ,
        "FACEFLOW_HOME": str(home),
        "FACEFLOW_BLOCK_CACHE_TTL_S": "0",
        "PYTHONUNBUFFERED": "1",
        **extra_env,
    }
    env.pop("PREFECT_API_URL", None)
    proc = start_stack(
        home, ["--api-port", str(api_port), "--prefect-port", str(prefect_port)], env
    )
    prefect_api = f"http://127.0.0.1:{prefect_port}/api"
    prefect = prefect_client(home, prefect_api)
    try:
        yield LocalStack(home, env, f"http://127.0.0.1:{api_port}", prefect_api, proc, prefect)
    finally:
        prefect.close()
        stop_stack(proc)
