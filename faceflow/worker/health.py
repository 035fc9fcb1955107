"""Readiness and liveness of the ``faceflow-gpu`` worker: HTTP on 127.0.0.1 and a JSON file.

``GET /health`` — 200 while the worker is set up and polling (liveness);
``GET /ready`` — 200 when at least one child has its models loaded and passed warm-up;
``GET /status`` — the full status JSON (per child: state, ready, pid, runs, model loads,
RSS, GPU memory from ``tasks.gpu.gpu_stats``).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

StatusFn = Callable[[], dict[str, Any]]


class HealthServer:
    """A small threaded HTTP server answering from ``status_fn``."""

    def __init__(self, status_fn: StatusFn, port: int = 0, host: str = "127.0.0.1") -> None:
        self._status_fn = status_fn
        self._server = ThreadingHTTPServer((host, port), self._handler())
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        status_fn = self._status_fn

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                return None

            def do_GET(self) -> None:
                try:
                    status = status_fn()
                except Exception as exc:  # never let the probe crash the worker
                    self._send(500, {"error": f"{type(exc).__name__}: {exc}"})
                    return
                if self.path == "/health":
                    self._send(200 if status["alive"] else 503, {"alive": status["alive"]})
                elif self.path == "/ready":
                    body = {"ready": status["ready"], "idle": status["idle"]}
                    self._send(200 if status["ready"] else 503, body)
                elif self.path == "/status":
                    self._send(200, status)
                else:
                    self._send(404, {"error": "not found"})

            def _send(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body, default=str).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        return Handler

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="faceflow-gpu-health", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)


def write_status_file(path: Path, status: dict[str, Any]) -> None:
    """Write ``status`` as JSON atomically (temp file + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(status, default=str, indent=1))
    os.replace(tmp, path)
