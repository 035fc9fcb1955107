"""One flow-run suspension observer per warm child instead of one per run.

For every deployment run, Prefect's engine starts a thread with its own event loop and a
``FlowRunSuspendingObserver`` (a websocket subscription), waits until it is connected and
joins it at the end: ≈ 0.15 s before the flow's first line and up to 0.2 s after its last
on this machine. A warm child runs many flow runs, so it keeps one observer running in a
background thread and registers each run with it; suspension still works the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any
from uuid import UUID

log = logging.getLogger("prefect.faceflow_gpu")


class SharedSuspensionObserver:
    """A ``FlowRunSuspendingObserver`` in a daemon thread, shared by the child's runs.

    Prefect's observer gives up for good once its polling fallback fails several times in a
    row (an API outage of about 30 s: "Service exceeded error threshold"); it then reports
    through ``on_failure``. This wrapper then starts a fresh observer (retrying while the
    API is unreachable) and registers the runs in flight with it again, so suspension keeps
    working for the rest of the child's life."""

    def __init__(self, restart_delay_s: float = 1.0) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._observer: Any = None
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._requests: dict[UUID, Any] = {}
        self.restart_delay_s = restart_delay_s
        self.starts = 0
        """Observers started so far (more than one: it was restarted after a failure)."""

    def start(self, timeout: float = 30.0) -> bool:
        """Start the observer thread; whether it came up within ``timeout`` s."""
        import contextvars

        context = contextvars.copy_context()
        self._thread = threading.Thread(
            target=lambda: context.run(self._thread_main),
            name="faceflow-suspension-observer",
            daemon=True,
        )
        self._thread.start()
        return self._ready.wait(timeout) and self._observer is not None

    def _thread_main(self) -> None:
        with contextlib.suppress(Exception):
            asyncio.run(self._serve())
        self._ready.set()

    async def _serve(self) -> None:
        """Keep one observer running: start it, and start a new one whenever it gives up."""
        self._loop = asyncio.get_running_loop()
        while True:
            failed = asyncio.Event()
            try:
                await self._observe_until_failed(failed)
            except Exception as exc:  # the API is unreachable while the observer starts
                log.debug("suspension observer could not start: %s", exc)
            self._observer = None
            await asyncio.sleep(self.restart_delay_s)

    async def _observe_until_failed(self, failed: asyncio.Event) -> None:
        from prefect._flow_run_suspension import mark_flow_run_suspension_requested
        from prefect._internal.observers import FlowRunSuspendingObserver

        loop = asyncio.get_running_loop()

        def on_suspended(flow_run_id: UUID, state: Any) -> None:
            if not mark_flow_run_suspension_requested(flow_run_id, state):
                request = self._requests.get(flow_run_id)
                if request is not None:
                    request.mark_requested(state)

        def on_failure(flow_run_ids: set[UUID]) -> None:
            loop.call_soon_threadsafe(failed.set)

        async with FlowRunSuspendingObserver(
            on_suspended=on_suspended, on_failure=on_failure
        ) as observer:
            self._observer = observer
            self.starts += 1
            for flow_run_id in list(self._requests):  # runs in flight when the last one failed
                observer.add_in_flight_flow_run_id(flow_run_id)
            if self.starts > 1:
                log.warning("suspension observer restarted (Prefect's had given up)")
            self._ready.set()
            await failed.wait()

    def _add(self, flow_run_id: UUID) -> None:
        if self._observer is not None and flow_run_id in self._requests:
            self._observer.add_in_flight_flow_run_id(flow_run_id)

    def _remove(self, flow_run_id: UUID) -> None:
        if self._observer is not None:
            self._observer.remove_in_flight_flow_run_id(flow_run_id)

    def in_flight(self) -> set[UUID]:
        """Runs the current Prefect observer watches (empty while it is being restarted)."""
        observer = self._observer
        return set(observer._in_flight_flow_run_ids) if observer is not None else set()

    @contextlib.contextmanager
    def observe(self, flow_run_id: UUID, suspension_request: Any, **_: Any) -> Iterator[None]:
        """Drop-in for ``prefect.flow_engine.observe_flow_run_suspension``."""
        assert self._loop is not None
        self._requests[flow_run_id] = suspension_request
        self._loop.call_soon_threadsafe(self._add, flow_run_id)
        try:
            yield
        finally:
            self._requests.pop(flow_run_id, None)
            self._loop.call_soon_threadsafe(self._remove, flow_run_id)


def install_shared_observer() -> bool:
    """Route the engine's per-run suspension observer to one shared observer.

    Returns False (and changes nothing) when this Prefect has no such hook or the shared
    observer cannot start; runs then use Prefect's own per-run observer.
    """
    import prefect.flow_engine as engine

    if not callable(getattr(engine, "observe_flow_run_suspension", None)):
        return False
    shared = SharedSuspensionObserver()
    if not shared.start():
        return False
    engine.observe_flow_run_suspension = shared.observe  # type: ignore[assignment]
    return True
