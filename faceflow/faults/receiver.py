"""A loopback webhook receiver that can be switched down (connection refused), to 500, or up.

Every POST is recorded with what it was answered; only 2xx answers count as deliveries.
Signatures are checked with ``faceflow.testing.webhooks.independent_verify`` (the Standard
Webhooks rules, written independently of ``webapi.webhooks``), at any age.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Literal

from faceflow.faults.report import Delivery
from faceflow.testing.webhooks import independent_verify

Mode = Literal["up", "error", "down"]


@dataclass(frozen=True)
class Hit:
    """One request the receiver answered."""

    at: float
    answered: int
    headers: dict[str, str]
    body: bytes

    @property
    def job_id(self) -> str:
        try:
            return str(json.loads(self.body)["data"]["id"])
        except (ValueError, KeyError, TypeError):
            return ""

    @property
    def event(self) -> str:
        try:
            return str(json.loads(self.body)["type"])
        except (ValueError, KeyError, TypeError):
            return ""


class Receiver:
    """The receiver; ``mode`` decides the next answers. Use ``close()`` when done."""

    def __init__(self) -> None:
        self.hits: list[Hit] = []
        self._lock = threading.Lock()
        self._mode: Mode = "up"
        self._server: ThreadingHTTPServer | None = None
        self.port = 0
        self._bind()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    @property
    def mode(self) -> Mode:
        return self._mode

    def set_mode(self, mode: Mode) -> None:
        """``down`` closes the listening socket (connection refused); others reopen it."""
        if mode == "down":
            self._unbind()
        elif self._server is None:
            self._bind()
        self._mode = mode

    def count(self, answered: Callable[[int], bool]) -> int:
        """How many requests got an answer matching ``answered``."""
        with self._lock:
            return sum(1 for hit in self.hits if answered(hit.answered))

    def deliveries(self, secrets: dict[str, str], owners: dict[str, str]) -> list[Delivery]:
        """2xx-answered requests as ``Delivery`` values; ``owners`` maps job id → user name,
        ``secrets`` user name → webhook secret."""
        with self._lock:
            hits = [hit for hit in self.hits if 200 <= hit.answered < 300]
        found = []
        for hit in hits:
            job_id = hit.job_id
            secret = secrets.get(owners.get(job_id, ""), "")
            found.append(
                Delivery(
                    webhook_id=hit.headers.get("webhook-id", ""),
                    event=hit.event,
                    job_id=job_id,
                    signature_ok=bool(secret)
                    and independent_verify(secret, hit.headers, hit.body, tolerance_s=None),
                )
            )
        return found

    def close(self) -> None:
        self._unbind()

    def _record(self, hit: Hit) -> None:
        with self._lock:
            self.hits.append(hit)

    def _bind(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                code = 500 if receiver.mode == "error" else 204
                headers = {k.lower(): v for k, v in self.headers.items()}
                receiver._record(Hit(time.time(), code, headers, body))
                self.send_response(code)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        server.daemon_threads = True
        self.port = int(server.server_address[1])
        threading.Thread(target=server.serve_forever, daemon=True, name="fault-receiver").start()
        self._server = server

    def _unbind(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
