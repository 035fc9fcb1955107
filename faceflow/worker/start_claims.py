"""The runs a ``faceflow-gpu`` worker claims on start: by its child's ``Running``, not
by a ``Pending`` state first.

Such a run stays ``Scheduled`` until the child's claim reaches Prefect, so any worker may
claim it meanwhile; every claim of a run at one run count carries the same transition id
(``transitions.claim_transition``) and only one is accepted while it is the run's state.
``StartClaims`` keeps a worker's side of that: the runs it took and has not handed to a
child, the claim each handed-over run's child makes, and the runs another worker's child
started, on which this worker then writes nothing. ``claiming_state`` reads from a run's
states whose claim holds it.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from faceflow.worker.protocol import RunClaim
from faceflow.worker.transitions import claim_transition

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun, State

NOTES_KEPT = 1024
"""How many run ids a note (``remember``) keeps, the oldest forgotten first: runs of
other workers never reach this one, so their notes are never struck out."""


def remember(notes: dict[str, None], run_id: str) -> None:
    """Note ``run_id`` in ``notes`` (oldest first), forgetting the oldest past
    ``NOTES_KEPT``."""
    notes[run_id] = None
    while len(notes) > NOTES_KEPT:
        del notes[next(iter(notes))]


class StartClaims:
    """A worker's runs claimed on start, from the claim to the run's end, and how many
    were ``made`` and ``lost`` (another worker's child started the run first)."""

    def __init__(self) -> None:
        self._taken: dict[str, int] = {}  # not handed over yet: the run count at the claim
        self._handed: dict[str, RunClaim] = {}  # handed over: the child's claim
        self._elsewhere: dict[str, None] = {}  # handed-over runs another worker started
        self._deciding = 0  # submissions that hold an idle child until they claim
        self.made = 0
        self.lost = 0

    @contextlib.contextmanager
    def deciding(self) -> Iterator[None]:
        """Hold an idle child for a run whose submission decided to claim it on start and
        awaits something (its deployment check) before ``take``: two runs submitted at once
        with one child idle are then not both claimed so."""
        self._deciding += 1
        try:
            yield
        finally:
            self._deciding -= 1

    def take(self, run_id: str, run_count: int) -> None:
        """Claim ``run_id`` on start (nothing reaches Prefect until its child's claim)."""
        self._taken[run_id] = run_count
        self.made += 1

    def waiting(self) -> int:
        """How many runs taken, or being taken (``deciding``), are not handed to a child
        yet."""
        return len(self._taken) + self._deciding

    def hand_over(self, flow_run: FlowRun, worker: str, child_pid: int) -> RunClaim | None:
        """The claim the child of pid ``child_pid`` makes for a run this worker took (the
        same transition id in every worker, a message that is this one's alone); ``None``
        for a run it claimed with ``Pending``."""
        run_count = self._taken.pop(str(flow_run.id), None)
        if run_count is None:
            return None
        message = (
            f"Started by faceflow-gpu worker {worker}, child pid {child_pid} "
            f"(claim {uuid.uuid4().hex[:8]})."
        )
        claim = RunClaim(transition_id=claim_transition(flow_run.id, run_count), message=message)
        self._handed[str(flow_run.id)] = claim
        return claim

    def holds(self, run_id: str) -> bool:
        """Whether ``run_id`` is claimed on start (before or after the hand-over) and has
        not ended."""
        return run_id in self._taken or run_id in self._handed

    def claim_of(self, run_id: str) -> RunClaim | None:
        """The claim of a handed-over run; ``None`` before the hand-over or for a run
        claimed with ``Pending``."""
        return self._handed.get(run_id)

    def give_back(self, run_id: str) -> bool:
        """Drop a run taken but never handed over (it is still ``Scheduled``, for any
        worker): whether it was one."""
        return self._taken.pop(run_id, None) is not None

    def still_claimable(self, current: FlowRun) -> bool:
        """Whether a run, read again before its hand-over, may still be claimed: one claimed
        on start only while ``Scheduled`` (another worker may have started it meanwhile)."""
        if str(current.id) not in self._taken:
            return True
        state = current.state
        return state is not None and state.is_scheduled()

    def started_here(self, run_id: str) -> bool:
        """False when another worker started a run this one's child was handed too."""
        return run_id not in self._elsewhere

    def started_elsewhere(self, run_id: str) -> None:
        """Another worker's child started ``run_id``: this worker writes nothing on it."""
        remember(self._elsewhere, run_id)

    def lost_to_another(self, run_id: str) -> None:
        """Prefect refused this worker's child the run: another's claim holds it."""
        self.started_elsewhere(run_id)
        self.lost += 1

    def seen_running(self, run_id: str, message: str | None) -> None:
        """The run's ``Running`` state, with its ``message``, which says whose child
        started a handed-over run."""
        mine = self._handed.get(run_id)
        if mine is not None and message is not None and message != mine.message:
            self.started_elsewhere(run_id)

    def forget(self, run_id: str) -> None:
        """The run is over for this worker."""
        self._taken.pop(run_id, None)
        self._handed.pop(run_id, None)


def claiming_state(states: list[State[Any]], claim: RunClaim) -> State[Any] | None:
    """The state among a run's ``states`` (any order) by which a claim of the run count that
    ``claim`` was made for holds the run, the earliest: this worker's ``Running`` (``claim``'s
    message), or another worker's ``Running`` or ``Pending`` (``claim``'s transition id,
    which every worker's claim of that run count carries, and another message); None while
    no such claim was accepted. A late claim of this worker's after another's start (put
    back) comes after it."""
    for state in sorted(states, key=lambda state: state.timestamp):
        if state.is_running() and state.message == claim.message:
            return state
        if (
            str(state.state_details.transition_id) == claim.transition_id
            and state.message != claim.message
            and (state.is_running() or state.is_pending())
        ):
            return state
    return None
