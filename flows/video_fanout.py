"""How a ``fuse-video`` coordinator runs its parts: ``fuse-video-part`` flow runs created
from the ``video-analyse`` and ``video-render`` deployments (bulk, one request per
deployment), then waited on by polling Prefect (the coordinator holds no GPU slot).

Each run's idempotency key is made from the job, the attempt, the part and the part's try:
a coordinator run again for the same attempt (its process lost, re-run by Prefect) gets
the same runs back instead of rendering twice. A part that crashes (its worker killed)
is created again under its next try, up to ``PART_TRIES``; its chunk, if stored meanwhile,
is not rendered again (content keys). A part that fails ends the attempt with the part's
typed error; one cancelled ends it as cancelled; the deadline passing cancels every part.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, cast
from uuid import UUID

from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.client.schemas.responses import SetStateStatus
from prefect.states import Cancelling, State

from flows.deadline import Deadline
from flows.params import VIDEO_PART_FLOW_NAME, video_parts_tag
from tasks.errors import DeadlineExceeded, FaceFlowError, TransientError

logger = logging.getLogger("faceflow.flows.video_fanout")

POLL_S = 0.25
"""Seconds between two reads of the parts' states."""
PART_TRIES = 3
"""Runs a part may take when its runs crash (a killed worker)."""
CREATE_TRIES = 8
"""Tries of a bulk creation that SQLite's ``database is locked`` (or a 5xx) refused."""
FINAL = {StateType.COMPLETED, StateType.FAILED, StateType.CRASHED, StateType.CANCELLED}
CANCEL_TRIES = 4  # proposals of one part's cancel, each after the run moved on
_CODE = re.compile(r"^\[([a-z_]+)\] ?(.*)$", re.S)


class PartsCancelled(Exception):
    """A part run was cancelled (the job is being cancelled)."""


def part_error(message: str | None) -> FaceFlowError:
    """The typed error a failed part's state message ``"[code] message"`` names."""
    found = _CODE.match(message or "")
    if found is None:
        return TransientError(detail=f"a video part failed: {message!r}")
    code, text = found.groups()
    for cls in _error_classes(FaceFlowError):
        if cls.code == code:
            return cls(text or None)
    return FaceFlowError(detail=text)


def _error_classes(base: type[FaceFlowError]) -> Iterable[type[FaceFlowError]]:
    for cls in base.__subclasses__():
        yield from _error_classes(cls)
        yield cls


@dataclass
class Parts:
    """The part runs of one video job attempt."""

    job_id: str
    attempt: int
    parameters: dict[str, Any]  # the job's parameters, as every part takes them
    deadline: Deadline
    runs: dict[str, UUID] = field(default_factory=dict)  # part → its current run
    tries: dict[str, int] = field(default_factory=dict)
    deployments: dict[str, UUID] = field(default_factory=dict)
    messages: dict[str, str] = field(default_factory=dict)  # part → final state message

    def run(
        self,
        parts: list[str],
        deployment: str,
        done: Callable[[str, str], None] = lambda part, message: None,
        tick: Callable[[set[str]], None] = lambda waiting: None,
    ) -> None:
        """Create ``parts`` from ``deployment`` and wait until all completed, calling
        ``done(part, message)`` as each does and ``tick(waiting)`` between two polls.
        Raises the typed error of a part that failed, ``PartsCancelled`` when one was
        cancelled, ``DeadlineExceeded``."""
        if not parts:
            return
        with get_client(sync_client=True) as client:
            self._create(client, parts, deployment)
            waiting = set(parts)
            while waiting:
                if self.deadline.passed():
                    self._cancel(client, waiting)
                    raise DeadlineExceeded(detail=f"{len(waiting)} video part(s) unfinished")
                for part, run in self._read(client, waiting).items():
                    state = run.state_type
                    if state not in FINAL:
                        continue
                    message = (run.state.message if run.state else None) or ""
                    if state is StateType.COMPLETED:
                        waiting.discard(part)
                        self.messages[part] = message
                        done(part, message)
                    elif state is StateType.CRASHED and self.tries[part] < PART_TRIES:
                        self._create(client, [part], deployment)
                    elif state is StateType.CANCELLED:
                        self._cancel(client, waiting)
                        raise PartsCancelled(f"video part {part} was cancelled")
                    else:
                        self._cancel(client, waiting)
                        raise part_error(message)
                if waiting:
                    tick(waiting)
                    time.sleep(POLL_S)

    def cancel(self) -> None:
        """Cancel every part run not final (the attempt is ending); a failure is logged
        (the relay's cancel finds them by their tag too)."""
        try:
            with get_client(sync_client=True) as client:
                self._cancel(client, set(self.runs))
        except Exception as exc:
            logger.warning("Could not cancel the video parts of %s: %r", self.job_id, exc)

    def _create(self, client: SyncPrefectClient, parts: list[str], deployment: str) -> None:
        """One bulk request for ``parts``' next tries (retried while SQLite is locked)."""
        if deployment not in self.deployments:
            found = client.read_deployment_by_name(f"{VIDEO_PART_FLOW_NAME}/{deployment}")
            self.deployments[deployment] = found.id
        tags = ["faceflow", "video-part", video_parts_tag(self.job_id, self.attempt)]
        pending = list(parts)
        for attempt in range(CREATE_TRIES):
            bodies = [
                {
                    "name": f"{self.job_id}-{part}",
                    "parameters": {**self.parameters, "part": part},
                    "tags": tags,
                    "idempotency_key": self._key(part),
                }
                for part in pending
            ]
            response = client.request(
                "POST",
                cast(Any, "/deployments/{id}/create_flow_run/bulk"),
                path_params={"id": self.deployments[deployment]},
                json=bodies,
            )
            results = response.json()["results"] if response.status_code < 300 else []
            refused = []
            for part, result in zip(pending, results or [{}] * len(pending), strict=True):
                if result.get("status") == "CREATED":
                    self.runs[part] = UUID(result["flow_run_id"])
                    self.tries[part] = self.tries.get(part, 0) + 1
                else:
                    refused.append((part, str(result.get("error") or response.text)))
            if not refused:
                return
            error = refused[0][1]
            if not _retryable(response.status_code, error) or attempt == CREATE_TRIES - 1:
                raise TransientError(detail=f"video parts not created: {error[:200]}")
            pending = [part for part, _ in refused]
            time.sleep(0.2 * (attempt + 1))

    def _key(self, part: str) -> str:
        return f"{self.job_id}:{self.attempt}:{part}:{self.tries.get(part, 0) + 1}"

    def _read(self, client: SyncPrefectClient, parts: set[str]) -> dict[str, FlowRun]:
        ids = {self.runs[p]: p for p in parts}
        found = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=list(ids))), limit=len(ids)
        )
        return {ids[run.id]: run for run in found}

    def _cancel(self, client: SyncPrefectClient, parts: set[str]) -> None:
        """Cancel the parts' runs as the relay does (``webapi.prefect_api.cancel_flow_run``):
        ``Cancelling`` proposed, never forced, so Prefect decides by each run's state when
        it arrives: not claimed → Cancelled at once; claimed or running → Cancelling, which
        it lets end only as Cancelled (the worker holding it cannot start it any more and
        ends it); ended meanwhile → its end is kept."""
        message = "The video job attempt ended"
        for part in parts:
            run = client.read_flow_run(self.runs[part]) if part in self.runs else None
            for _ in range(CANCEL_TRIES):
                if run is None or run.state_type in FINAL or run.state_type is StateType.CANCELLING:
                    break
                proposed: State[Any] = Cancelling(message=message)
                if client.set_flow_run_state(run.id, proposed).status is SetStateStatus.ACCEPT:
                    break
                run = client.read_flow_run(run.id)  # Cancelled instead, or it moved on


def _retryable(status: int, error: str) -> bool:
    return status >= 500 or "database is locked" in error or "locked" in error.lower()
