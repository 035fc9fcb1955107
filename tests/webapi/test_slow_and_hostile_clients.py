"""Clients that try to stall or freeze the API, against the webapi started exactly as the
stack starts it (``faceflow.stack.webapi_argv``: uvicorn in its own process, on loopback).

- a hostile JSON body (too many keys, too deep, too large, declared or streamed) is refused
  with 413 / 422 while ``/healthz`` from another client stays fast;
- a client that sends part of its headers and stalls is disconnected after the header
  deadline; one that sends its headers and stalls its body gets 408 after the body deadline;
- a client that hangs up mid-body is logged at info in one line, with no traceback.
"""

from __future__ import annotations

import json
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from faceflow.testing.bodies import deep, many_keys
from faceflow.testing.jobs import make_user, stack_webapi
from faceflow.testing.wait import poll
from webapi.config import Settings
from webapi.db import create_engine
from webapi.migrations import upgrade

HEADER_S = 1.0
BODY_S = 2.0


@dataclass
class Served:
    url: str
    port: int
    api_key: str
    log: Path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    home = tmp_path_factory.mktemp("slow-clients")
    database_url = f"sqlite:///{home / 'webapi.db'}"
    upgrade(database_url)
    engine = create_engine(database_url)
    user = make_user(engine, Settings.model_validate({"database_url": database_url}))
    engine.dispose()
    service, url = stack_webapi(
        home,
        database_url,
        FACEFLOW_RUN_RELAY="false",
        FACEFLOW_HEADER_READ_SECONDS=str(HEADER_S),
        FACEFLOW_BODY_READ_SECONDS=str(BODY_S),
    )
    service.start()
    try:
        service.wait_ready(lambda: httpx.get(f"{url}/healthz", timeout=2).status_code == 200, 60)
        yield Served(url, httpx.URL(url).port or 80, user.api_key, service.log)
    finally:
        service.stop(grace=10)


def _chunks(body: bytes, size: int = 1 << 20) -> Iterator[bytes]:
    for start in range(0, len(body), size):
        yield body[start : start + size]


def _healthz_while(served: Served, attack: threading.Thread) -> list[float]:
    latencies: list[float] = []
    with httpx.Client(base_url=served.url, timeout=60) as client:
        attack.start()
        while attack.is_alive():
            started = time.perf_counter()
            assert client.get("/healthz").status_code == 200
            latencies.append(time.perf_counter() - started)
            time.sleep(0.02)
    return latencies


@pytest.mark.parametrize(
    ("name", "body", "streamed", "status", "code"),
    [
        ("keys within the size limit", many_keys(7_500_000), False, 422, "json_too_complex"),
        ("nested within the size limit", deep(7_500_000), False, 422, "json_too_complex"),
        ("2 million keys, 25 MB", many_keys(25_000_000), False, 413, "payload_too_large"),
        (
            "25 MB streamed, no Content-Length",
            many_keys(25_000_000),
            True,
            413,
            "payload_too_large",
        ),
    ],
)
def test_hostile_json_is_refused_while_healthz_stays_fast(
    served: Served, name: str, body: bytes, streamed: bool, status: int, code: str
) -> None:
    answers: list[httpx.Response] = []

    def attack() -> None:
        answers.append(
            httpx.post(
                f"{served.url}/v1/jobs",
                content=_chunks(body) if streamed else body,
                headers={
                    "Authorization": f"Bearer {served.api_key}",
                    "Content-Type": "application/json",
                },
                timeout=60,
            )
        )

    latencies = _healthz_while(served, threading.Thread(target=attack))
    assert answers, name
    assert answers[0].status_code == status, answers[0].text
    assert answers[0].json()["error"]["code"] == code
    # Before the bounds, the 7.5 MB of keys held the event loop for ≈ 3 s (25 MB: 25 s).
    assert max(latencies) < 1.0, (name, statistics.median(latencies), max(latencies))


def _connect(served: Served) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", served.port), timeout=10)
    sock.settimeout(10)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_stalled_headers_are_cut_off_at_the_header_deadline(served: Served) -> None:
    with _connect(served) as sock:
        started = time.monotonic()
        sock.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and nothing more
        assert _read_all(sock) == b""  # closed by the server
        waited = time.monotonic() - started
    assert HEADER_S * 0.8 < waited < HEADER_S + 2.0, waited


def test_stalled_body_gets_408_at_the_body_deadline(served: Served) -> None:
    head = (
        "POST /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Authorization: Bearer {served.api_key}\r\n"
        "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    )
    with _connect(served) as sock:
        started = time.monotonic()
        sock.sendall(head.encode() + b'{"source": "data:')  # then the client stalls
        answer = _read_all(sock)  # the server answers and closes the connection
        waited = time.monotonic() - started
    status_line, _, rest = answer.partition(b"\r\n")
    assert b" 408 " in status_line, answer[:300]
    assert json.loads(rest.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_timeout"
    assert BODY_S * 0.8 < waited < BODY_S + 2.0, waited
    assert httpx.get(f"{served.url}/healthz").status_code == 200


def test_client_disconnect_is_one_info_line(served: Served) -> None:
    mark = served.log.stat().st_size
    head = (
        "POST /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Authorization: Bearer {served.api_key}\r\n"
        "Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
    )
    with _connect(served) as sock:
        sock.sendall(head.encode() + b'{"source": "data:image/png;base64,AAAA')
        time.sleep(0.3)
    poll(lambda: "client disconnected" in served.log.read_bytes()[mark:].decode(), 10, step_s=0.1)
    time.sleep(0.3)
    text = served.log.read_bytes()[mark:].decode()
    entries = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    gone = [e for e in entries if e["msg"].startswith("client disconnected")]
    assert gone and gone[0]["level"] == "info" and "error" not in gone[0], text
    assert "Traceback" not in text and not any(e["level"] == "error" for e in entries), text


def test_a_normal_request_still_works(served: Served) -> None:
    response = httpx.get(
        f"{served.url}/v1/jobs", headers={"Authorization": f"Bearer {served.api_key}"}
    )
    assert response.status_code == 200, response.text
