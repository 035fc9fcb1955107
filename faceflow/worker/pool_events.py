"""The work pool's flow-run events as a ``faceflow-gpu`` worker follows them.

A ``Scheduled`` event is a run to claim at once, a ``Running`` one says whose claim started
a run, a stop event (``Cancelling``, ``Cancelled``, ``Crashed``) that a run claimed ahead
may no longer be wanted. ``PoolEvents.follow`` keeps the subscription (Prefect's events
websocket) and reconnects it itself, ``EVENTS_RECONNECT_S`` after it dropped, so that the
worker knows every gap: while the stream is down (``live`` false) the worker polls and reads
runs again that it would otherwise take on the events' word (``may_have_stopped``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from faceflow.worker.start_claims import remember

if TYPE_CHECKING:
    from uuid import UUID

    from prefect.events.schemas.events import Event

    Logger = logging.Logger | logging.LoggerAdapter[Any]

SCHEDULED_EVENT = "prefect.flow-run.Scheduled"
CANCELLING_EVENT = "prefect.flow-run.Cancelling"
RUNNING_EVENT = "prefect.flow-run.Running"
STOP_EVENTS = frozenset(
    {CANCELLING_EVENT, "prefect.flow-run.Cancelled", "prefect.flow-run.Crashed"}
)
"""The events after which a claimed run may no longer be wanted (``may_have_stopped``)."""
EVENTS_RECONNECT_S = 1.0
"""After the subscription dropped, the worker polls and connects it again this much later
(s)."""
EVENTS_SETTLE_S = 1.0
"""Prefect's subscriber returns once it has sent its filter; the server starts the stream
after it reads the filter. The worker polls at once and again this much later (s), for a
run scheduled between its first poll and the stream's start (``on_connect``)."""
_RUN = "prefect.flow-run."


def run_id_of(resource_id: str) -> str:
    """The flow run id of an event's resource id ``prefect.flow-run.<id>``."""
    return resource_id.removeprefix(_RUN)


class PoolEvents:
    """The pool's event subscription: whether it is up, since when, how often it
    (re)connected, and the runs it heard a stop event of."""

    def __init__(self, logger: Logger) -> None:
        self._logger = logger
        self.since: float | None = None  # since when (monotonic) it is up; None while down
        self.connects = 0
        self._stop_news: dict[str, None] = {}  # runs with a stop event, oldest first

    @property
    def live(self) -> bool:
        """Whether the subscription is up."""
        return self.since is not None

    def may_have_stopped(self, run_id: str, claimed: float) -> bool:
        """Whether a run claimed at ``claimed`` (monotonic) may have been cancelled or ended
        while it waited for a child, so that it must be read again before a child gets it:
        a stop event (Cancelling, Cancelled, Crashed) of the run arrived, or the
        subscription was not up all the while. Otherwise the read (one API round trip
        between two runs of a child, ≈ 50 ms under a burst) is skipped. A stop that happened
        so shortly before the hand-over that its event is still on its way is still caught:
        Prefect refuses ``Running`` to a ``Cancelling`` run (the child reports it and the
        worker makes it Cancelled), and the supervision reads the run's state as its event
        arrives."""
        since = self.since
        return since is None or since > claimed or run_id in self._stop_news

    def forget(self, run_id: str) -> None:
        """The run is over for this worker: its stop news goes."""
        self._stop_news.pop(run_id, None)

    async def follow(
        self,
        pool_id: UUID,
        *,
        on_connect: Callable[[], None],
        on_scheduled: Callable[[Event], None],
        on_running: Callable[[str, str | None], None],
        on_cancelling: Callable[[str], None],
        on_drop: Callable[[], None],
    ) -> None:
        """Follow the flow-run events of work pool ``pool_id`` until cancelled, calling back
        on each: ``on_connect`` once the subscription is up (what happened before it took
        effect may never arrive: read it again), ``on_drop`` when it ended (dropped or
        closed), then connect again after ``EVENTS_RECONNECT_S``. Stop events are noted
        before the callback for the event is made."""
        from prefect.events.clients import get_events_subscriber
        from prefect.events.filters import EventAnyResourceFilter, EventFilter, EventNameFilter

        event_filter = EventFilter(
            event=EventNameFilter(name=[SCHEDULED_EVENT, RUNNING_EVENT, *sorted(STOP_EVENTS)]),
            any_resource=EventAnyResourceFilter(id=[f"prefect.work-pool.{pool_id}"]),
        )
        while True:
            try:
                # No reconnection inside Prefect's subscriber: it would reconnect silently
                # (backfilling only persisted events), and what the worker skips while its
                # stream is up (``may_have_stopped``, the polls) needs to know every gap.
                subscriber = get_events_subscriber(filter=event_filter, reconnection_attempts=0)
                async with subscriber:
                    self.connects += 1
                    on_connect()
                    self.since = time.monotonic()
                    async for event in subscriber:
                        run_id = run_id_of(event.resource.id)
                        if event.event in STOP_EVENTS:
                            remember(self._stop_news, run_id)
                        if event.event == CANCELLING_EVENT:
                            on_cancelling(run_id)
                        elif event.event == RUNNING_EVENT:
                            on_running(run_id, event.resource.get("prefect.state-message"))
                        elif event.event == SCHEDULED_EVENT:
                            on_scheduled(event)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._logger.debug("event pickup unavailable (%s); polling only", exc)
            self.since = None
            on_drop()
            await asyncio.sleep(EVENTS_RECONNECT_S)
