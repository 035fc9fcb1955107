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
import threading
from collections.abc import Iterator
from typing import Any
from uuid import UUID


class SharedSuspensionObserver:
    """A ``FlowRunSuspendingObserver`` in a daemon thread, shared by the child's runs."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._observer: Any = None
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._requests: dict[UUID, Any] = {}

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
        from prefect._flow_run_suspension import mark_flow_run_suspension_requested
        from prefect._internal.observers import FlowRunSuspendingObserver

        def on_suspended(flow_run_id: UUID, state: Any) -> None:
            if not mark_flow_run_suspension_requested(flow_run_id, state):
                request = self._requests.get(flow_run_id)
                if request is not None:
                    request.mark_requested(state)

        async with FlowRunSuspendingObserver(on_suspended=on_suspended) as observer:
            self._loop, self._observer = asyncio.get_running_loop(), observer
            self._ready.set()
            await asyncio.Event().wait()  # until the process exits

    @contextlib.contextmanager
    def observe(self, flow_run_id: UUID, suspension_request: Any, **_: Any) -> Iterator[None]:
        """Drop-in for ``prefect.flow_engine.observe_flow_run_suspension``."""
        assert self._loop is not None
        self._requests[flow_run_id] = suspension_request
        self._loop.call_soon_threadsafe(self._observer.add_in_flight_flow_run_id, flow_run_id)
        try:
            yield
        finally:
            self._requests.pop(flow_run_id, None)
            self._loop.call_soon_threadsafe(
                self._observer.remove_in_flight_flow_run_id, flow_run_id
            )


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
