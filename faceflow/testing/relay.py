"""Real services for the relay's tests and benches: a Prefect server, a stand-in
``fuse-faces`` flow run in-process (a deterministic worker), a loopback HTTP receiver, and
job factories.

The Prefect server is ``faceflow.testing.prefect.PrefectServer``: ``prefect server start``
in a subprocess (own PREFECT_HOME, SQLite, 127.0.0.1, stopped by PID) so a test can stop
and restart it. Prefect is imported lazily: importing this module stays cheap.
"""

from __future__ import annotations

import contextvars
import json
import select
import socket
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy.engine import Engine
from sqlmodel import Session

from faceflow.testing.jobs import image_bytes, new_job, source_jpeg, target_jpeg
from faceflow.testing.prefect import PrefectServer
from flows.params import JobFailure, ResultRef, result_error_key, result_key, result_meta_key
from tasks.errors import FaceFlowError
from tasks.report import FaceQuality, FuserSettings, PoseAngles, QualityReport
from webapi import crud
from webapi.config import Settings
from webapi.inputs import InputRef, store_image
from webapi.models import Job
from webapi.relay.context import RelayTimings
from webapi.storage import ObjectStore

#: Relay timings for tests: short intervals, backoffs and grace periods.
FAST = RelayTimings(
    dispatch_interval_s=0.05,
    sync_interval_s=0.2,
    expire_interval_s=0.2,
    reap_interval_s=0.2,
    notify_interval_s=0.1,
    dispatch_backoff_base_s=0.1,
    dispatch_backoff_cap_s=0.5,
    running_grace_s=0.5,
    pending_timeout_s=2.0,
    cancel_grace_s=2.0,
    webhook_backoff_base_s=0.1,
    webhook_backoff_cap_s=0.3,
)


class CountingTransport(httpx.HTTPTransport):
    """A real transport that records the path of every request the relay's Prefect client
    sends (connection attempts included)."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[str] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.sent.append(request.url.path)
        return super().handle_request(request)


class ReadCounter(httpx.HTTPTransport):
    """A real transport that counts the relay's reads of flow runs and artifacts."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path.endswith("/filter") or (request.method == "GET" and "/flow_runs/" in path):
            self.reads += 1
        return super().handle_request(request)


# --------------------------------------------------------------------------- stand-in flow


@dataclass
class FlowScript:
    """What the stand-in ``fuse-faces`` flow does: per job id, a behaviour; and where the
    shared storage lives (the relay's LocalObjectStore directory)."""

    storage_dir: Path | None = None
    behaviours: dict[str, str] = field(default_factory=dict)  # job id → succeed | fail

    def storage(self) -> Path:
        assert self.storage_dir is not None, "set SCRIPT.storage_dir in the test"
        return self.storage_dir


SCRIPT = FlowScript()


_STRAIGHT = PoseAngles(yaw=0.0, pitch=0.0, roll=0.0)
QUALITY = QualityReport(
    identity_model="dlib-resnet-v1",
    source_score=0.99,
    source_pose=_STRAIGHT,
    faces=[
        FaceQuality(
            index=0,
            detector_score=0.98,
            found=True,
            result_score=0.97,
            source_similarity=0.62,
            target_similarity=0.48,
            target_pose=_STRAIGHT,
            pose_difference=_STRAIGHT,
            pose_mismatch=False,
        )
    ],
    source_similarity=0.62,
    target_similarity=0.48,
    settings=FuserSettings(fuser="classic", identity_weight=0.85, blend="multiband"),
)
"""The quality report the harness's results carry (the real flow's is tested elsewhere)."""


def write_result(storage_dir: Path, job_id: str, attempt: int) -> ResultRef:
    """What the real flow leaves in storage on success: the image and its sidecar."""
    data = image_bytes(24, 16)
    ref = ResultRef(
        key=result_key(job_id, attempt, "png"),
        content_type="image/png",
        width=24,
        height=16,
        faces_replaced=1,
        timings_ms={"fuse": 1.5},
        quality=QUALITY,
    )
    for key, payload in (
        (ref.key, data),
        (result_meta_key(job_id, attempt), ref.model_dump_json().encode()),
    ):
        path = storage_dir / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(payload)
    return ref


def fuse_faces_body(
    job_id: str,
    owner_id: str,
    source_key: str,
    target_key: str,
    options: dict[str, Any],
    deadline_at: datetime,
    attempt: int = 1,
    storage_block: str = "local-file-system/faceflow-storage",
    settings_block: str = "fusion-settings/default",
    signing_block: str = "secret/faceflow-c2pa-signing",
    binding: str | None = None,
) -> dict[str, Any]:
    """The stand-in flow's body: FuseFacesParams fields in, a ResultRef out; a failure is
    recorded in storage as the real flow records it (``JobFailure``), then raised."""
    from prefect.runtime import flow_run

    from tasks.errors import NoFaceFound

    behaviour = SCRIPT.behaviours.get(job_id, "succeed")
    if behaviour == "fail":
        error = NoFaceFound(detail="stand-in flow told to fail")
        write_failure(SCRIPT.storage(), job_id, attempt, error, flow_run.get_id())
        raise error
    return write_result(SCRIPT.storage(), job_id, attempt).model_dump()


def write_failure(
    storage_dir: Path,
    job_id: str,
    attempt: int,
    error: FaceFlowError,
    flow_run_id: str | None,
) -> JobFailure:
    """What the real flow leaves in storage on failure: the attempt's ``JobFailure``."""
    failure = JobFailure.of(error, flow_run_id=flow_run_id)
    path = storage_dir / result_error_key(job_id, attempt)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(failure.model_dump_json().encode())
    return failure


_FLOWS: dict[str, Any] = {}


def stand_in_flow(name: str = "fuse-faces") -> Any:
    """The Prefect flow ``name`` over ``fuse_faces_body`` (created once)."""
    if name not in _FLOWS:
        from prefect import flow

        _FLOWS[name] = flow(name=name, persist_result=False)(fuse_faces_body)
    return _FLOWS[name]


STRICT_POOL = "strict"
#: A work pool whose job template needs a variable that the relay never sends: Prefect
#: refuses every run of its deployments (422), as it would after an operator's template
#: change that the relay's job variables no longer meet.
STRICT_TEMPLATE = {
    "job_configuration": {"command": "{{ command }}", "gpu_index": "{{ gpu_index }}"},
    "variables": {
        "type": "object",
        "properties": {
            "command": {"type": "string", "default": "python -m prefect.engine"},
            "gpu_index": {"type": "integer", "description": "No default: every run sets it."},
        },
        "required": ["gpu_index"],
    },
}


def deploy_stand_ins() -> None:
    """Register deployments ``fuse-faces/fuse-faces`` and ``fuse-faces-strict/fuse-faces``
    (in ``STRICT_POOL``, created here)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    stand_in_flow().to_deployment(name="fuse-faces").apply()
    pool = WorkPoolCreate(name=STRICT_POOL, type="process", base_job_template=STRICT_TEMPLATE)
    with get_client(sync_client=True) as client:
        client.create_work_pool(pool, overwrite=True)
    strict = stand_in_flow("fuse-faces-strict")
    strict.to_deployment(name="fuse-faces", work_pool_name=STRICT_POOL).apply()


@contextmanager
def stand_in_server(
    home: Path,
    auth_string: str | None = None,
    *,
    scale_out: Mapping[str, Any] | None = None,
) -> Iterator[PrefectServer]:
    """A started ``PrefectServer`` (asking for ``auth_string`` if given) with the stand-in
    deployments; this process's Prefect client settings point at it inside the block.
    Embedded without services, or with ``scale_out`` the scale-out layout: its keyword
    arguments for ``PrefectServer`` (the PostgreSQL database in ``server_env``, ``redis_url``,
    ``api_workers``)."""
    from prefect.settings import (
        PREFECT_API_AUTH_STRING,
        PREFECT_API_URL,
        PREFECT_HOME,
        PREFECT_LOGGING_TO_API_ENABLED,
        temporary_settings,
    )

    quiet = {"PREFECT_LOGGING_LEVEL": "WARNING", "PREFECT_UI_ENABLED": "false"}
    if scale_out is None:
        server = PrefectServer(home, server_env=quiet, services=False, auth_string=auth_string)
    else:
        options = dict(scale_out)
        server_env = {**quiet, **options.pop("server_env", {})}
        server = PrefectServer(
            home, server_env=server_env, layout="scale-out", auth_string=auth_string, **options
        )
    server.start()
    try:
        with temporary_settings(
            updates={
                PREFECT_API_URL: server.api_url,
                PREFECT_API_AUTH_STRING: auth_string,
                PREFECT_HOME: home / "client",
                PREFECT_LOGGING_TO_API_ENABLED: False,
            }
        ):
            deploy_stand_ins()
            yield server
            drain_events()
    finally:
        server.stop()


def drain_events(timeout_s: float = 15.0) -> None:
    """Flush and stop this process's Prefect event and log workers, waiting at most
    ``timeout_s``, while the server they talk to still runs.

    Flows run in-process leave event workers bound to the server they ran against; left
    for ``prefect_test_harness``, which drains every worker at the end of the session
    without a timeout, one bound to a server already gone hung the suite's teardown."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    EventsWorker.drain_all(timeout=timeout_s)
    APILogWorker.drain_all(timeout=timeout_s)


def execute_run(flow_run_id: str, flow: Any = None) -> str:
    """Run an existing flow run in this process, as a worker would (with ``flow``, default
    the stand-in); returns its final state type. Must run where the Prefect settings
    context points at the test server."""
    from prefect.client.orchestration import get_client
    from prefect.flow_engine import run_flow

    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(uuid.UUID(flow_run_id))
    state = run_flow(flow or stand_in_flow(), flow_run=flow_run, return_type="state")
    return str(state.type.value)  # type: ignore[union-attr]


def in_thread(target: Callable[[], object], name: str) -> threading.Thread:
    """A daemon thread running ``target`` in a copy of this context (Prefect settings)."""
    context = contextvars.copy_context()
    thread = threading.Thread(target=lambda: context.run(target), name=name, daemon=True)
    thread.start()
    return thread


# --------------------------------------------------------------------------- HTTP receiver


@dataclass
class Received:
    """One request the receiver got (header names lower-cased)."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes


class Receiver:
    """A real ``http.server`` on 127.0.0.1 in a thread. POSTs are recorded and answered
    from ``statuses`` (the last one repeats); GETs serve ``files`` (path → status,
    headers, body; a header ``x-unsized`` leaves out Content-Length)."""

    def __init__(self) -> None:
        self.requests: list[Received] = []
        self.statuses: list[int] = [200]
        self.files: dict[str, tuple[int, dict[str, str], bytes]] = {}
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                return None

            def _record(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else b""
                with receiver._lock:
                    receiver.requests.append(
                        Received(
                            self.command,
                            self.path,
                            {k.lower(): v for k, v in self.headers.items()},
                            body,
                        )
                    )

            def do_POST(self) -> None:
                self._record()
                with receiver._lock:
                    index = sum(1 for r in receiver.requests if r.method == "POST") - 1
                    status = receiver.statuses[min(index, len(receiver.statuses) - 1)]
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

            def do_GET(self) -> None:
                self._record()
                status, headers, body = receiver.files.get(self.path, (404, {}, b""))
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                if "x-unsized" not in headers:  # else HTTP/1.0: the body ends at close
                    self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def posts(self) -> list[Received]:
        with self._lock:
            return [r for r in self.requests if r.method == "POST"]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


@contextmanager
def receiver() -> Iterator[Receiver]:
    """A running ``Receiver``, shut down on exit."""
    instance = Receiver()
    try:
        yield instance
    finally:
        instance.close()


class Tarpit:
    """A hostile image server on 127.0.0.1: it answers every GET slowly, one byte every
    ``interval_s`` — in the response head (``mode="head"``: headers that never end) or in
    the body of a 200 whose Content-Length (9000) would take hours (``mode="body"``) — until the client
    goes away. It records how many connections it has open now (``open``), at once at
    most (``peak``) and in all (``connections``), and the paths asked (``paths``)."""

    def __init__(self, *, mode: str = "body", interval_s: float = 1.0) -> None:
        self.mode, self.interval_s = mode, interval_s
        self.connections = 0
        self.open = 0
        self.peak = 0
        self.paths: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(0.2)
        self._threads: list[threading.Thread] = []
        self._accepting = threading.Thread(target=self._accept, daemon=True)
        self._accepting.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._sock.getsockname()[1]}"

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        with self._lock:
            self.connections += 1
            self.open += 1
            self.peak = max(self.peak, self.open)
        try:
            conn.settimeout(5)
            request = conn.recv(65536)  # one small GET
            with self._lock:
                self.paths.append(request.split(b" ")[1].decode() if b" " in request else "")
            head = b"HTTP/1.1 200 OK\r\ncontent-type: image/png\r\n"
            if self.mode == "body":
                head += b"content-length: 9000\r\n\r\n"
            else:
                head += b"x-slow: "
            conn.sendall(head)
            while not self._stop.is_set():
                readable, _, _ = select.select([conn], [], [], self.interval_s)
                if readable and not conn.recv(1024):
                    break  # the client gave up: what the tarpit waits for
                conn.sendall(b"a")
        except OSError:  # the client went away while a byte was on its way
            pass
        finally:
            with self._lock:
                self.open -= 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        self._accepting.join(5)
        for thread in self._threads:
            thread.join(5)


@contextmanager
def tarpit(*, mode: str = "body", interval_s: float = 1.0) -> Iterator[Tarpit]:
    """A running ``Tarpit``, closed on exit."""
    instance = Tarpit(mode=mode, interval_s=interval_s)
    try:
        yield instance
    finally:
        instance.close()


# --------------------------------------------------------------------------- jobs


def submit(
    engine: Engine,
    settings: Settings,
    store: ObjectStore,
    owner: crud.NewUser,
    *,
    source_url: str | None = None,
    **fields: Any,
) -> Job:
    """Submit a job the way the API does (inputs validated and stored, one transaction)."""
    create = {"options": {"identity_weight": 0.8}, **fields}
    if source_url is not None:
        source = InputRef(name="source", digest="0" * 64, url=source_url)
    else:
        source = store_image(
            source_jpeg(), name="source", limits=settings.image_limits, store=store
        )
    target = store_image(target_jpeg(), name="target", limits=settings.image_limits, store=store)
    return new_job(engine, settings, owner, source=source, target=target, **create)


def job(engine: Engine, job_id: uuid.UUID) -> Job:
    """The job row as stored now."""
    with Session(engine, expire_on_commit=False) as session:
        found = session.get(Job, job_id)
        assert found is not None
        return found


def body_json(received: Received) -> Any:
    return json.loads(received.body)
