"""Run the relay: background threads in the webapi process, standalone, or one pass.

- ``start_relay(settings)`` / ``stop_relay()``: one daemon thread per step (fetch,
  dispatch, sync, expire, reap, notify), each with its own short DB sessions, and the
  fetch lane's threads (``webapi.relay.fetch_lane``); used by the app's lifespan.
  ``wake_relay()`` makes fetch and dispatch run now (call it after a submit commits).
- ``run_relay_forever(settings)``: the same loops until SIGINT/SIGTERM (``faceflow relay``).
- ``reconcile_once(settings)``: one pass of every step, in order (``faceflow relay
  reconcile`` and the Prefect ``reconcile`` flow).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from sqlalchemy.engine import Engine

from flows.params import BATCH_DEPLOYMENT_NAME, BATCH_FLOW_NAME
from webapi.config import Settings, get_settings
from webapi.db import get_engine
from webapi.migrations import check_migrated
from webapi.prefect_api import PrefectAPI, PrefectError
from webapi.relay import dispatch, expire, fetch_lane, notify, reap, sync
from webapi.relay.context import Relay, RelayTimings
from webapi.relay.run_events import REREAD_AFTER_S, SETTLED_STATES, RunEvents
from webapi.storage import ObjectStore, open_store

log = logging.getLogger(__name__)

Step = Callable[[Relay], int]
#: Steps that read the runs over REST: while Prefect's events arrive, only as often as the
#: safety net asks and where an event asks.
READ_STEPS = ("sync", "reap")
#: Steps in reconcile order: fetch input URLs, start what is due, learn what happened,
#: then clean up.
STEPS: dict[str, Step] = {
    "fetch": fetch_lane.run_once,
    "dispatch": dispatch.run_once,
    "sync": sync.run_once,
    "expire": expire.run_once,
    "reap": reap.run_once,
    "notify": notify.run_once,
}


def build_relay(
    settings: Settings | None = None,
    *,
    engine: Engine | None = None,
    prefect: PrefectAPI | None = None,
    store: ObjectStore | None = None,
    timings: RelayTimings | None = None,
) -> Relay:
    """A ``Relay`` from settings; any dependency may be given instead (tests)."""
    settings = settings or get_settings()
    return Relay(
        engine=engine or get_engine(settings.database_url),
        prefect=prefect or PrefectAPI.from_settings(settings),
        store=store or open_store(settings.storage_url, s3_endpoint_url=settings.s3_endpoint_url),
        settings=settings,
        timings=timings or RelayTimings(),
    )


@dataclass
class _Loop:
    name: str
    step: Step
    interval_s: float
    wake: threading.Event
    thread: threading.Thread | None = None


class RelayRunner:
    """The relay's loops as daemon threads over one ``Relay``."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        relay.wake = self.wake
        relay.nap = self.nap
        self._stop = threading.Event()
        self.fetches = fetch_lane.FetchLane(relay.settings.fetch_concurrency)
        t = relay.timings
        intervals = {
            "fetch": t.fetch_interval_s,
            "dispatch": t.dispatch_interval_s,
            "sync": t.sync_interval_s,
            "expire": t.expire_interval_s,
            "reap": t.reap_interval_s,
            "notify": t.notify_interval_s,
        }
        steps = {**STEPS, "fetch": self.fetches.run_once, "sync": self._sync, "reap": self._reap}
        self._next_read = dict.fromkeys(READ_STEPS, 0.0)
        self._loops = {
            name: _Loop(name, step, intervals[name], threading.Event())
            for name, step in steps.items()
        }
        self.events = self._run_events(relay)

    def _run_events(self, relay: Relay) -> RunEvents | None:
        """The flow-run event stream that wakes sync (``settings.relay_run_events``)."""
        if not relay.settings.relay_run_events:
            return None
        auth = relay.settings.prefect_api_auth_string

        def changed(run_id: str, state: str, occurred: datetime) -> None:
            if state == "RUNNING":
                relay.news.started(run_id, occurred)
            elif state in SETTLED_STATES:
                relay.news.ended(run_id)
            else:  # CRASHED, CANCELLING: the run's state over REST decides
                relay.news.read((0.0, *REREAD_AFTER_S), steps=READ_STEPS)
            self.wake(*READ_STEPS) if state == "CRASHED" else self.wake("sync")

        def connected() -> None:
            relay.news.read(steps=READ_STEPS)
            self.wake(*READ_STEPS)

        return RunEvents(
            relay.settings.prefect_api_url,
            auth_string=auth.get_secret_value() if auth else None,
            on_change=changed,
            on_connect=connected,
        )

    def _streaming(self) -> bool:
        return self.events is not None and self.events.connected

    def _interval(self, loop: _Loop) -> float:
        """The loop's poll interval: sync's is the safety net while events arrive and no
        running video's progress is to be read."""
        if loop.name == "sync" and self._streaming() and not self.relay.reading_progress:
            return max(loop.interval_s, self.relay.timings.sync_safety_net_s)
        return loop.interval_s

    def _wait_s(self, loop: _Loop) -> float:
        """How long the loop sleeps unless woken: its poll interval, or less for sync and
        reap when an event asked for a pass sooner."""
        asked = self.relay.news.wait_s(loop.name) if loop.name in READ_STEPS else None
        interval = self._interval(loop)
        return interval if asked is None else min(interval, asked)

    def _read_due(self, name: str) -> bool:
        """Whether ``name``'s pass reads the runs over REST as a poll: always while no
        events arrive, else once per safety-net interval (reap's passes in between still
        run: cancellations, and what the job store alone shows overdue)."""
        now = time.monotonic()
        if self._streaming() and now < self._next_read[name]:
            return False
        interval = self._interval(self._loops[name])
        if name == "reap" and self._streaming():
            interval = max(interval, self.relay.timings.sync_safety_net_s)
        self._next_read[name] = now + interval
        return True

    def _sync(self, relay: Relay) -> int:
        """A sync pass that reads the runs when its poll is due; between polls only where
        an event asked for it."""
        return sync.run_once(relay, read_runs=self._read_due("sync"))

    def _reap(self, relay: Relay) -> int:
        """A reap pass that reads the runs when its poll is due, or an event asked for it
        (CRASHED, CANCELLING, a reconnect)."""
        read = self._read_due("reap")
        return reap.run_once(relay, read_runs=relay.news.take_read("reap") or read)

    @property
    def running(self) -> bool:
        """Whether the loops are started and not stopped."""
        return not self._stop.is_set() and any(
            loop.thread is not None and loop.thread.is_alive() for loop in self._loops.values()
        )

    def start(self) -> None:
        """Start every loop thread."""
        for loop in self._loops.values():
            loop.thread = threading.Thread(
                target=self._run, args=(loop,), name=f"faceflow-relay-{loop.name}", daemon=True
            )
            loop.thread.start()
        if self.events is not None:
            self.events.start()
        threading.Thread(
            target=look_up_deployments,
            args=(self.relay,),
            name="faceflow-relay-deployments",
            daemon=True,
        ).start()
        log.info("relay started", extra={"owner": self.relay.owner})

    def wake(self, *names: str) -> None:
        """Run the named loops (default: fetch, dispatch and notify) without waiting."""
        for name in names or ("fetch", "dispatch", "notify"):
            self._loops[name].wake.set()

    def nap(self, name: str, seconds: float) -> bool:
        """Wait, inside a pass of loop ``name``, up to ``seconds`` for that loop to be woken;
        True when it was (the wake is taken: the caller acts on it or calls ``wake``)."""
        event = self._loops[name].wake
        if self._stop.is_set() or not event.wait(seconds):
            return False
        event.clear()
        return True

    def stop(self, timeout_s: float = 15.0) -> None:
        """Stop the loops (each finishes its current pass), cut the input fetches in flight
        (their rows are handed back) and close the HTTP clients."""
        self._stop.set()
        if self.events is not None:
            self.events.stop()
        for loop in self._loops.values():
            loop.wake.set()
        for loop in self._loops.values():
            if loop.thread is not None:
                loop.thread.join(timeout_s)
        self.fetches.close(cut=True)
        self.relay.close()
        log.info("relay stopped", extra={"owner": self.relay.owner})

    def _run(self, loop: _Loop) -> None:
        while not self._stop.is_set():
            handled = 0
            try:
                handled = loop.step(self.relay)
            except Exception:  # a loop must survive a bad pass; the next one retries
                log.exception("relay step failed", extra={"step": loop.name})
                self.relay.metrics.inc("faceflow_relay_loop_errors_total", loop.name)
            if handled >= self.relay.timings.batch:
                continue  # more is due: go again at once
            loop.wake.wait(self._wait_s(loop))
            loop.wake.clear()


def look_up_deployments(relay: Relay) -> None:
    """Look up the ids of the deployments that dispatch creates runs of (``fuse-faces``;
    ``fuse-batch`` with batching) now, off the dispatch path: else the first run of each
    after a start waits for its lookup (≈ 20 ms on a quiet server, more in a burst).
    Best effort: dispatch looks up whatever is not known yet (Prefect down, a deployment
    not made yet)."""
    names: list[tuple[str | None, str | None]] = [(None, None)]
    if relay.settings.batching:
        names.append((BATCH_FLOW_NAME, BATCH_DEPLOYMENT_NAME))
    for flow_name, deployment_name in names:
        try:
            relay.prefect.deployment_id(flow_name, deployment_name)
        except (PrefectError, RuntimeError) as exc:  # RuntimeError: the relay stopped meanwhile
            log.info(
                "deployment not looked up at start",
                extra={"deployment": deployment_name or "default", "error": str(exc)},
            )


_runner: RelayRunner | None = None
_runner_lock = threading.Lock()


class AppState(Protocol):
    """What ``start_relay`` reads from a FastAPI ``app.state``."""

    settings: Settings
    engine: Engine
    store: ObjectStore


def start_relay(
    source: Settings | AppState | None = None, *, relay: Relay | None = None
) -> RelayRunner:
    """Start the process-wide relay (idempotent).

    ``source`` is the settings, or the app's ``state`` (its settings, engine and store are
    shared; ``state.relay`` is set to the runner); ``relay`` overrides both (tests).
    """
    global _runner
    with _runner_lock:
        if _runner is None or not _runner.running:
            if relay is None:
                relay = _relay_from(source)
            _runner = RelayRunner(relay)
            _runner.start()
        if source is not None and not isinstance(source, Settings) and hasattr(source, "relay"):
            source.relay = _runner
        return _runner


def _relay_from(source: Settings | AppState | None) -> Relay:
    if source is None or isinstance(source, Settings):
        return build_relay(source)
    return build_relay(source.settings, engine=source.engine, store=source.store)


def stop_relay(_state: object = None, timeout_s: float = 15.0) -> None:
    """Stop the process-wide relay, if running (``_state``: the app state, unused)."""
    global _runner
    with _runner_lock:
        runner, _runner = _runner, None
    if runner is not None:
        runner.stop(timeout_s)


def wake_relay() -> None:
    """Nudge the process-wide relay's fetch, dispatch and notify loops (no-op when not
    running)."""
    runner = _runner
    if runner is not None:
        runner.wake()


def run_relay_forever(settings: Settings | None = None) -> None:
    """Run the relay loops in this process until SIGINT or SIGTERM (``faceflow relay``)."""
    relay = build_relay(settings)
    check_migrated(relay.engine)
    runner = RelayRunner(relay)
    done = threading.Event()

    def _on_signal(signum: int, _frame: object) -> None:
        log.info("relay stopping", extra={"signal": signum})
        done.set()

    previous = {sig: signal.signal(sig, _on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    runner.start()
    try:
        done.wait()
    finally:
        runner.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def reconcile_once(
    settings: Settings | None = None, *, relay: Relay | None = None
) -> dict[str, int]:
    """One pass of every step, in order; returns how many items each step handled."""
    own = relay is None
    relay = relay or build_relay(settings)
    try:
        return {name: step(relay) for name, step in STEPS.items()}
    finally:
        if own:
            relay.close()
