"""The public edge: the systemd unit serves the API on loopback only, with the serving
options every launcher uses, behind ``deploy/nginx/faceflow.conf``, whose limits and
timeouts match the API's settings; nginx itself (when installed) in front of the webapi
started as the stack starts it, on loopback ports."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from faceflow.testing.jobs import make_user, stack_webapi
from faceflow.testing.net import free_port
from webapi.config import Settings
from webapi.db import create_engine
from webapi.migrations import upgrade
from webapi.serving import UVICORN_OPTIONS

REPO = Path(__file__).resolve().parents[1]
NGINX_CONF = REPO / "deploy" / "nginx" / "faceflow.conf"
UNITS = REPO / "deploy" / "systemd"
MIB = 1024 * 1024


def _location(conf: str, head: str) -> str:
    start = conf.index(f"location {head} {{")
    return conf[start : conf.index("}", start)]


def _seconds(block: str, directive: str) -> float:
    match = re.search(rf"^\s*{directive} (\d+)s;", block, re.MULTILINE)
    assert match, directive
    return float(match.group(1))


def test_the_webapi_unit_listens_on_loopback_with_the_serving_options() -> None:
    unit = (UNITS / "faceflow-webapi.service").read_text()
    [exec_start] = [line for line in unit.splitlines() if line.startswith("ExecStart=")]
    argv = exec_start.split()
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    joined = " ".join(argv)
    assert " ".join(UVICORN_OPTIONS) in joined
    assert "--forwarded-allow-ips 127.0.0.1" in joined
    for path in UNITS.iterdir():
        assert "0.0.0.0" not in path.read_text(), path.name


def test_the_proxy_limits_and_timeouts_match_the_api() -> None:
    conf = NGINX_CONF.read_text()
    settings = Settings.model_validate({})
    submit = _location(conf, "= /v1/jobs")
    size = re.search(r"client_max_body_size (\d+)m;", submit)
    assert size
    # the proxy lets through every body the API accepts, and not much more
    assert settings.max_request_bytes <= int(size.group(1)) * MIB < settings.max_request_bytes + MIB
    assert settings.max_json_bytes < settings.max_request_bytes
    # Prefer: wait holds a submit up to max_wait_seconds: the proxy waits longer
    assert _seconds(submit, "proxy_read_timeout") > settings.max_wait_seconds
    assert _seconds(conf, "proxy_read_timeout") < _seconds(submit, "proxy_read_timeout")
    assert _seconds(conf, "proxy_connect_timeout") == 3
    assert _seconds(conf, "client_header_timeout") == settings.header_read_seconds
    assert _seconds(conf, "client_body_timeout") < settings.body_read_seconds
    assert "server 127.0.0.1:8000" in conf and "location / {\n        return 404;" in conf


def _nginx_conf(tmp: Path, http_port: int, edge_port: int, api_port: int) -> Path:
    """The deployed file with loopback ports for its two servers (TLS left out: the test
    speaks plain HTTP to it) and the API's port, in a minimal nginx.conf."""
    conf = NGINX_CONF.read_text()
    conf = conf.replace("server 127.0.0.1:8000", f"server 127.0.0.1:{api_port}")
    conf = conf.replace("listen 80;", f"listen 127.0.0.1:{http_port};")
    conf = conf.replace("listen 443 ssl http2;", f"listen 127.0.0.1:{edge_port};")
    conf = "\n".join(
        line for line in conf.splitlines() if not line.strip().startswith(("listen [::]", "ssl_"))
    )
    (tmp / "faceflow.conf").write_text(conf)
    user = "user root root;\n" if os.geteuid() == 0 else ""
    main = tmp / "nginx.conf"
    main.write_text(
        f"{user}daemon off;\nworker_processes 1;\npid {tmp}/nginx.pid;\n"
        f"error_log {tmp}/error.log info;\nevents {{ worker_connections 64; }}\n"
        f"http {{\n access_log off;\n client_body_temp_path {tmp}/body;\n"
        f" proxy_temp_path {tmp}/proxy;\n fastcgi_temp_path {tmp}/fastcgi;\n"
        f" uwsgi_temp_path {tmp}/uwsgi;\n scgi_temp_path {tmp}/scgi;\n"
        f" include {tmp}/faceflow.conf;\n}}\n"
    )
    return main


@pytest.fixture
def edge(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """nginx with the deployed config in front of the stack's webapi: (edge URL, API key)."""
    nginx = shutil.which("nginx") or (
        "/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None
    )
    if nginx is None:
        pytest.skip("nginx is not installed")
    database_url = f"sqlite:///{tmp_path / 'webapi.db'}"
    upgrade(database_url)
    engine = create_engine(database_url)
    user = make_user(engine, Settings.model_validate({"database_url": database_url}))
    engine.dispose()
    service, api_url = stack_webapi(tmp_path, database_url, FACEFLOW_RUN_RELAY="false")
    edge_port = free_port()
    main = _nginx_conf(tmp_path, free_port(), edge_port, httpx.URL(api_url).port or 80)
    checked = subprocess.run([nginx, "-t", "-c", str(main)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    service.start()
    proxy = subprocess.Popen([nginx, "-c", str(main)], stderr=subprocess.DEVNULL)
    try:
        service.wait_ready(lambda: httpx.get(f"{api_url}/healthz").status_code == 200, 60)
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", edge_port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "nginx did not start"
                time.sleep(0.05)
        yield f"http://127.0.0.1:{edge_port}", user.api_key
    finally:
        proxy.terminate()
        proxy.wait(timeout=10)
        service.stop(grace=10)


def test_nginx_in_front_of_the_api(edge: tuple[str, str]) -> None:
    url, api_key = edge
    headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
    with httpx.Client(base_url=url, timeout=30) as client:
        healthz = client.get("/healthz")
        assert healthz.status_code == 200 and healthz.headers["x-request-id"]
        assert client.get("/metrics").status_code == 404  # private: not through the edge
        assert client.get("/v1/jobs", headers=headers).status_code == 200
        # over the API's JSON limit, under the proxy's: the API's own 413
        json_body = b'{"source": "' + b"a" * (9 * MIB) + b'"}'
        too_big = client.post("/v1/jobs", content=json_body, headers=headers)
        assert too_big.status_code == 413, too_big.text
        assert "8388608" in too_big.json()["error"]["message"]
    # over the proxy's limit: refused from the headers, in the API's error shape
    with socket.create_connection(("127.0.0.1", httpx.URL(url).port or 80), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 60000000\r\n\r\n"
        )
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b'"code": "payload_too_large"' in answer
