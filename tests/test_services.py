"""Supervised services: the local stack's restarts (real processes), start records, the
readiness gate the systemd units use, and the unit files themselves (systemd-analyze)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from typer.testing import CliRunner

from faceflow.cli import app as cli
from faceflow.supervisor import Service, ServiceFailed, Supervisor
from webapi import services

REPO = Path(__file__).resolve().parents[1]
UNITS = REPO / "deploy" / "systemd"


def _sleeper(tmp_path: Path, name: str) -> Service:
    return Service(
        name, [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / f"{name}.log"
    )


def test_an_exited_part_is_restarted_and_counted(tmp_path: Path) -> None:
    records = tmp_path / "services"
    supervisor = Supervisor(records=records, restart_backoff_s=0.2)
    worker = supervisor.start(_sleeper(tmp_path, "worker-0"))
    api = supervisor.start(_sleeper(tmp_path, "webapi"))
    try:
        first_pid = worker.pid
        assert supervisor.restart_exited() == []
        worker.kill(signal.SIGKILL)
        assert supervisor.restart_exited() == []  # waits out its backoff first
        time.sleep(0.25)
        [restarted] = supervisor.restart_exited()
        assert (restarted.name, restarted.reason, restarted.restarts) == (
            "worker-0",
            "killed by SIGKILL",
            1,
        )
        assert worker.alive() and worker.pid != first_pid and api.alive()
        by_name = {record.service: record for record in services.read_records(records)}
        assert by_name["worker-0"].restarts == 1 and by_name["webapi"].restarts == 0
        assert by_name["worker-0"].last_exit == "killed by SIGKILL"
    finally:
        supervisor.stop_all(grace=2)
    assert not worker.alive() and not api.alive()


def test_a_part_that_keeps_exiting_is_given_up_on(tmp_path: Path) -> None:
    supervisor = Supervisor(records=tmp_path / "services", max_restarts=2, restart_backoff_s=0.0)
    crashing = supervisor.start(
        Service("crashing", [sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "c.log")
    )
    try:
        restarts = 0
        with pytest.raises(ServiceFailed, match="exited with code 3"):
            for _ in range(50):
                restarts += len(supervisor.restart_exited())
                time.sleep(0.1)
        assert restarts == 2
    finally:
        supervisor.stop_all(grace=1)
    assert not crashing.alive()


def test_start_records_count_restarts(tmp_path: Path) -> None:
    directory = tmp_path / "services"
    assert services.read_records(directory) == []
    services.record_start(directory, "faceflow-webapi")
    record = services.record_start(directory, "faceflow-webapi")
    assert (record.starts, record.restarts) == (2, 1)
    with pytest.raises(ValueError):
        services.record_start(directory, "../escape")
    services.reset(directory)
    assert services.read_records(directory) == []


def _http_server(status: list[int]) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            return None

        def do_GET(self) -> None:
            self.send_response(status[0])
            self.end_headers()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_wait_ready_waits_for_a_200(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    status = [503]
    server = _http_server(status)
    url = f"http://127.0.0.1:{server.server_address[1]}/ready"
    runner = CliRunner()
    try:
        failed = runner.invoke(cli, ["services", "wait-ready", url, "--timeout", "0.5"])
        assert failed.exit_code == 1 and "HTTP 503" in failed.output
        threading.Timer(0.5, lambda: status.__setitem__(0, 200)).start()
        ready = runner.invoke(
            cli, ["services", "wait-ready", url, "--timeout", "10", "--interval", "0.1"]
        )
        assert ready.exit_code == 0, ready.output
    finally:
        server.shutdown()
    monkeypatch.setenv("FACEFLOW_HOME", str(tmp_path))
    monkeypatch.setenv("FACEFLOW_SERVICES_DIR", str(tmp_path / "records"))
    from webapi.config import get_settings

    get_settings.cache_clear()
    try:
        started = runner.invoke(cli, ["services", "record-start", "faceflow-relay"])
        assert started.exit_code == 0 and "start 1" in started.output, started.output
        runner.invoke(
            cli,
            [
                "services",
                "record-exit",
                "faceflow-relay",
                "--result",
                "exit-code",
                "--code",
                "exited",
                "--status",
                "1",
            ],
        )
        listed = runner.invoke(cli, ["services", "list"])
        assert "faceflow-relay\tstarts=1\trestarts=0" in listed.output
        assert "last_exit=exit-code exited 1" in listed.output
    finally:
        get_settings.cache_clear()


def _units() -> list[Path]:
    return sorted([*UNITS.glob("*.service"), *UNITS.glob("*.target")])


SERVES_NO_HTTP = {"faceflow-prefect-services.service"}
"""Prefect's background services answer no request: nothing to wait for but the start."""


def test_every_unit_has_readiness_restart_policy_and_start_records() -> None:
    names = {unit.name for unit in _units()}
    assert {
        "faceflow-webapi.service",
        "faceflow-relay.service",
        "faceflow-prefect-server.service",
        "faceflow-gpu-worker@.service",
    } <= names
    for unit in _units():
        if unit.suffix != ".service":
            continue
        text = unit.read_text()
        if "Type=oneshot" in text:  # migrations: done once, nothing to restart
            assert "RemainAfterExit=yes" in text, unit.name
            continue
        assert "Restart=always" in text and "RestartSec=" in text, unit.name
        assert "faceflow services record-start %N" in text, unit.name
        assert "faceflow services record-exit %N" in text, unit.name
        if unit.name not in SERVES_NO_HTTP:
            assert "services wait-ready" in text, unit.name
    worker = (UNITS / "faceflow-gpu-worker@.service").read_text()
    assert "Environment=CUDA_VISIBLE_DEVICES=%i" in worker and "/ready" in worker
    assert "http://127.0.0.1:8000/readyz" in (UNITS / "faceflow-webapi.service").read_text()


PREFECT_AUTH_ENV = "EnvironmentFile=/etc/faceflow/prefect-auth.env"
PREFECT_CLIENTS = {
    "faceflow-prefect-server.service",
    "faceflow-prefect-services.service",
    "faceflow-relay.service",
    "faceflow-control-worker.service",
    "faceflow-gpu-worker@.service",
}
"""The units that serve or call the Prefect API's authenticated routes (issue 22)."""


def test_the_units_that_use_prefect_read_its_credential_from_a_file_of_its_own() -> None:
    for unit in _units():
        text = unit.read_text()
        reads = PREFECT_AUTH_ENV in text.splitlines()
        assert reads == (unit.name in PREFECT_CLIENTS), unit.name  # the API holds none
        assert "AUTH_STRING" not in text, unit.name  # never inline (systemctl show)
    assert "AUTH_STRING" not in (UNITS / "faceflow.env.example").read_text()
    example = (UNITS / "prefect-auth.env.example").read_text().splitlines()
    values = dict(line.split("=", 1) for line in example if line and not line.startswith("#"))
    assert set(values) == {"PREFECT_SERVER_API_AUTH_STRING", "PREFECT_API_AUTH_STRING"}
    assert set(values.values()) == {"faceflow:change-me"}


def test_the_commands_the_units_run_exist() -> None:
    """Every ``faceflow …`` command line of the units parses (``--help`` of its command)."""
    commands: set[tuple[str, ...]] = set()
    for unit in _units():
        for match in re.finditer(r"/\.venv/bin/faceflow ((?:[a-z-]+ ?)+)", unit.read_text()):
            words = tuple(w for w in match.group(1).split() if not w.startswith("-"))
            commands.add(words[:2] if words[0] in ("services", "db", "worker") else words[:1])
    assert ("services", "wait-ready") in commands and ("worker", "start") in commands
    runner = CliRunner()
    for command in sorted(commands):
        result = runner.invoke(cli, [*command, "--help"])
        assert result.exit_code == 0, (command, result.output)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not here")
def test_systemd_analyze_verifies_the_units(tmp_path: Path) -> None:
    """The units as installed at /opt/faceflow, pointed at this checkout and its venv."""
    venv = Path(sys.executable).parent.parent
    for unit in _units():
        text = unit.read_text().replace("/opt/faceflow/.venv", str(venv))
        (tmp_path / unit.name).write_text(text.replace("/opt/faceflow", str(REPO)))
    instance = tmp_path / "faceflow-gpu-worker@0.service"
    instance.write_text((tmp_path / "faceflow-gpu-worker@.service").read_text())
    units = [str(p) for p in sorted(tmp_path.iterdir()) if "@." not in p.name]
    result = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", *units],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "SYSTEMD_LOG_LEVEL": "warning"},
        check=False,
    )
    problems = [
        line
        for line in (result.stdout + result.stderr).splitlines()
        if line.strip() and "faceflow" in line
    ]
    assert result.returncode == 0 and not problems, result.stdout + result.stderr
