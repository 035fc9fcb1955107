"""Flow-run state changes pushed from Prefect's event stream, so the relay's sync runs when
a run starts or ends instead of at its next poll.

``RunEvents`` holds one websocket to Prefect's ``/api/events/out`` (the same protocol as
Prefect's own ``PrefectEventSubscriber``: HTTP basic auth on the upgrade with the server's
credential, an ``auth`` message, then a ``filter`` for ``prefect.flow-run.*`` events, no
backfill) in a daemon thread, and calls ``on_change`` for each run that moved to a state
the relay acts on. It never decides an outcome. Sync (``webapi.relay.sync``) applies what
an event says without reading the run over REST where the event is enough: a RUNNING
event marks its job running at the event's time; a COMPLETED, FAILED or CANCELLED event
settles the run's jobs from what their flow stored. Everything else is left to a REST read
of the runs, which is also what makes a missed event harmless:

- the REST poll stays as a safety net at ``RelayTimings.sync_safety_net_s`` while the
  stream is connected, and at the fast ``sync_interval_s`` while it is not (refused,
  dropped, Prefect restarting: ``connected`` turns False at once);
- a reconnect is followed by a pass that reads the runs (``on_connect``): whatever ended
  while the stream was down is read then, so no backfill from Prefect's events table is
  needed;
- Prefect emits a state's event before its transaction commits, so a read right after
  the event may still see the old state: where a REST read decides (CRASHED, CANCELLING, a
  final run that stored no outcome, a job whose start was missed), the runs are read again
  ``REREAD_AFTER_S`` after the event; a RUNNING event whose run no job holds yet (dispatch
  records a run on its job just after creating it) is looked for again then too, in the
  job store only. An event that was fully applied needs no re-read: its write is fenced on
  the job's run and does not depend on what Prefect has committed;
- a subscriber whose server-side queue (256 events) overflows loses events silently: any
  later event, or the safety net, reads them.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from websockets.exceptions import WebSocketException
from websockets.sync.client import ClientConnection, connect

log = logging.getLogger(__name__)

#: Flow-run state types after which the relay has something to write.
WATCHED_STATES = frozenset({"RUNNING", "COMPLETED", "FAILED", "CANCELLED", "CRASHED", "CANCELLING"})
#: Final state types whose event lets sync settle the run's jobs from what the flow stored,
#: without reading the run first (``sync.settle_ended``).
SETTLED_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED"})
#: Seconds after an event when sync takes it up again where the event alone did not decide
#: (the state's transaction may not have been committed when the event left).
REREAD_AFTER_S: tuple[float, ...] = (0.15, 1.0)
RECONNECT_MIN_S = 0.5
RECONNECT_MAX_S = 10.0


def events_url(api_url: str) -> str:
    """The websocket URL of Prefect's outgoing event stream for REST root ``api_url``."""
    root = api_url.rstrip("/")
    scheme, rest = root.split("://", 1)
    return f"{'wss' if scheme == 'https' else 'ws'}://{rest}/events/out"


def flow_run_filter(now: datetime | None = None) -> dict[str, Any]:
    """The stream filter: flow-run events from now on. ``occurred.until`` is far ahead, as
    Prefect applies the whole filter (its time window included) to live events."""
    now = now or datetime.now(UTC)
    return {
        "event": {"prefix": ["prefect.flow-run."]},
        "occurred": {
            "since": (now - timedelta(minutes=1)).isoformat(),
            "until": (now + timedelta(days=3650)).isoformat(),
        },
    }


def watched_run(message: dict[str, Any]) -> tuple[str, str, datetime] | None:
    """``(flow run id, state type, when it occurred)`` of a stream message about a watched
    state, else None (an event without a readable time: now)."""
    if message.get("type") != "event":
        return None
    event = message.get("event") or {}
    resource = event.get("resource") or {}
    state = resource.get("prefect.state-type")
    run_id = str(resource.get("prefect.resource.id", "")).removeprefix("prefect.flow-run.")
    if state not in WATCHED_STATES or not run_id:
        return None
    return run_id, state, _occurred(event.get("occurred"))


def _occurred(value: object) -> datetime:
    try:
        at = datetime.fromisoformat(str(value))
    except ValueError:
        return datetime.now(UTC)
    return at if at.tzinfo is not None else at.replace(tzinfo=UTC)


class RunEvents:
    """The relay's subscription to flow-run state events (see the module docstring)."""

    def __init__(
        self,
        api_url: str,
        *,
        auth_string: str | None,
        on_change: Callable[[str, str, datetime], None],
        on_connect: Callable[[], None],
    ) -> None:
        self.url = events_url(api_url)
        self._auth_string = auth_string
        self._on_change = on_change
        self._on_connect = on_connect
        self._connected = threading.Event()
        self._stop = threading.Event()
        self._socket: ClientConnection | None = None
        self._thread: threading.Thread | None = None
        self.events_seen = 0
        self.connects = 0

    @property
    def connected(self) -> bool:
        """Whether the stream is open and filtered (events arrive)."""
        return self._connected.is_set()

    def start(self) -> None:
        """Open the stream in a daemon thread (reconnecting until ``stop``)."""
        self._thread = threading.Thread(target=self._run, name="faceflow-relay-events", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Close the stream."""
        self._stop.set()
        socket = self._socket
        if socket is not None:
            socket.close()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        backoff = RECONNECT_MIN_S
        failures = 0
        while not self._stop.is_set():
            try:
                socket = self._open()
                with socket:
                    self._socket = socket
                    self._connected.set()
                    self.connects += 1
                    backoff, failures = RECONNECT_MIN_S, 0
                    log.info("relay: flow-run events connected", extra={"url": self.url})
                    self._on_connect()
                    for raw in socket:
                        self._handle(raw)
            except (OSError, WebSocketException, ValueError, TimeoutError) as exc:
                failures += 1
                level = logging.WARNING if failures == 1 and self.connects else logging.DEBUG
                log.log(level, "relay: flow-run events unavailable: %s", exc)
            finally:
                was_connected = self._connected.is_set()
                self._connected.clear()
                self._socket = None
            if was_connected and not self._stop.is_set():
                self._on_connect()  # read at once what the lost stream would have said
            self._stop.wait(backoff)
            backoff = min(backoff * 2, RECONNECT_MAX_S)

    def _open(self) -> ClientConnection:
        headers = {}
        if self._auth_string:
            token = base64.b64encode(self._auth_string.encode()).decode("ascii")
            headers["Authorization"] = f"Basic {token}"
        socket = connect(
            self.url,
            additional_headers=headers,
            subprotocols=["prefect"],  # type: ignore[list-item]
            proxy=None,
            open_timeout=5,
            close_timeout=1,
        )
        try:
            socket.send(json.dumps({"type": "auth", "token": self._auth_string}))
            answer = json.loads(socket.recv(timeout=5))
            if answer.get("type") != "auth_success":
                raise ValueError(f"event stream refused the credential: {answer}")
            socket.send(
                json.dumps({"type": "filter", "filter": flow_run_filter(), "backfill": False})
            )
        except BaseException:
            socket.close()
            raise
        return socket

    def _handle(self, raw: str | bytes) -> None:
        try:
            message = json.loads(raw)
        except ValueError:
            return
        found = watched_run(message)
        if found is None:
            return
        self.events_seen += 1
        self._on_change(*found)


def wait_connected(events: RunEvents, timeout_s: float) -> bool:
    """Wait until ``events`` is connected (tests, benches); whether it is."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if events.connected:
            return True
        time.sleep(0.02)
    return events.connected
