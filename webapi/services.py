"""Start records of supervised services: how often each started, and why it last stopped.

A supervisor writes them — systemd through ``faceflow services record-start %N``
(``ExecStartPre``) and ``record-exit`` (``ExecStopPost``, with ``$SERVICE_RESULT``,
``$EXIT_CODE``, ``$EXIT_STATUS``), ``faceflow up`` directly — one JSON file per service under
``settings.services_dir``. The API's ``/metrics`` exports them:
``faceflow_service_starts_total`` and ``faceflow_service_restarts_total`` (starts after the
first) per service, so an alert can fire on a service that keeps restarting.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from webapi.models import utcnow

_NAME = re.compile(r"^[A-Za-z0-9@._-]{1,100}$")


@dataclass
class ServiceRecord:
    """What is known of one service's starts."""

    service: str
    starts: int = 0
    last_start: str | None = None
    last_exit: str | None = None
    last_exit_at: str | None = None

    @property
    def restarts(self) -> int:
        """Starts after the first."""
        return max(0, self.starts - 1)


def _path(directory: Path, service: str) -> Path:
    if not _NAME.match(service):
        raise ValueError(f"not a service name: {service!r}")
    return directory / f"{service}.json"


@contextmanager
def _locked(directory: Path, service: str) -> Iterator[ServiceRecord]:
    """The record of ``service``, locked against other writers; saved on exit."""
    directory.mkdir(parents=True, exist_ok=True)
    path = _path(directory, service)
    with (directory / ".lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        record = _read(path) or ServiceRecord(service)
        yield record
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(record)))
        os.replace(tmp, path)


def _read(path: Path) -> ServiceRecord | None:
    try:
        data = json.loads(path.read_text())
        return ServiceRecord(
            **{k: v for k, v in data.items() if k in ServiceRecord.__annotations__}
        )
    except (OSError, ValueError, TypeError):
        return None


def record_start(directory: Path, service: str) -> ServiceRecord:
    """Count one start of ``service``."""
    with _locked(directory, service) as record:
        record.starts += 1
        record.last_start = utcnow().isoformat()
    return record


def record_exit(directory: Path, service: str, reason: str) -> ServiceRecord:
    """Note why ``service`` stopped (``exited 1``, ``killed by SIGKILL``, ``stopped``)."""
    with _locked(directory, service) as record:
        record.last_exit = reason[:200]
        record.last_exit_at = utcnow().isoformat()
    return record


def read_records(directory: Path | None) -> list[ServiceRecord]:
    """Every service's record under ``directory``, by name (none when it does not exist)."""
    if directory is None or not directory.is_dir():
        return []
    records = (_read(path) for path in sorted(directory.glob("*.json")))
    return [record for record in records if record is not None]


def reset(directory: Path) -> None:
    """Forget every record (a supervisor starting a fresh stack)."""
    for path in directory.glob("*.json"):
        path.unlink(missing_ok=True)
