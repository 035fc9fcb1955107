"""The two requests Prefect's engine sends at a run's start, taken off the run's path.

For a flow run it is handed, Prefect 3.9.1's sync ``FlowRunEngine`` (prefect/flow_engine.py)
sends two requests between the child's hand-over and the flow's first line:

- ``initialize_run`` (lines 1200-1217): ``client.update_flow_run(id, flow_version=
  flow.version, empirical_policy=…)``, a PATCH before ``Running`` (8-20 ms quiet,
  50-120 ms loaded on this machine);
- ``setup_run_context`` (line 1097): ``client.read_flow_run(id)`` right after ``Running`` is
  accepted (17-66 ms).

``RunStart`` wraps the child's client for one run:

- the PATCH is not sent when the run already carries that flow version and policy;
  otherwise it is held back until the server has answered the engine's ``Running``
  proposal (so the two do not share the server while the run starts), then goes out in a
  background thread beside the flow's body, and is joined before any other state
  proposal, read or end of the run, so the server holds the run's flow version and retry
  policy before it orchestrates a ``Failed`` (retries), a pause or the final state, as
  with Prefect's order (``Running`` reads neither). A claim that ends in an abort (the
  run is another worker's) drops it. A run that is resuming (its policy's ``resuming``
  flag, which the ``Running`` transition clears) gets Prefect's synchronous PATCH.
- the re-read of a deployment run is answered from the run the worker handed over with
  what the server's ``Running`` transition sets (Prefect's ``GlobalFlowPolicy``: state,
  ``run_count`` + 1, ``start_time``, no next scheduled time) and the PATCH's values.
  What the re-read could add is a change made by someone else since: a cancellation is
  enforced by the worker (it kills the child), never read here; a suspension is caught by
  the run's suspension observer, registered before ``Running`` is proposed (as for a
  request that lands just after Prefect's own re-read); the worker's labels and pid are
  written once the run is ``Running``, so Prefect's re-read may or may not see them too.
  Later reads (a retry's) go to the server.

With a ``RunClaim`` (``WorkerSettings.claim_on_start``) the engine's first ``Running``
proposal is the worker's claim of the run: it carries the claim's transition id and
message, and a rejection answered with another claimant's ``Running`` (same transition id,
other message: Prefect's ``PreventDuplicateTransitions``) becomes an abort, so the engine
stops before the flow's first line (``claim_outcome``). An accepted claim is checked
against the run's states (one read): Prefect also accepts ``Running`` after a final state
without a persisted result, and after a ``Running`` of another transition id (a claim that
reached it late, once another worker's child had started or even finished the run, or once
the run was cancelled); the child then aborts, putting back a final state it displaced
(``first_start``), so no run is started twice at one run count.

``engine_shape_known`` checks the engine's source for both calls; where it differs (another
Prefect release), ``RunStart`` changes nothing and the engine sends both requests itself.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from functools import cache
from typing import Any
from uuid import UUID

from faceflow.worker.protocol import RunClaim
from faceflow.worker.transitions import propose_shared

PATCH_CALL = "flow_version=self.flow.version"
"""What ``FlowRunEngine.initialize_run`` passes to ``update_flow_run`` (Prefect 3.9.1)."""

LATE_CLAIM = "Late claim"
"""How the reason a child gives for not starting a run that its claim reached too late
begins (``first_start``)."""

REREAD_CALL = "self.flow_run = client.read_flow_run(self.flow_run.id)"
"""The re-read in ``FlowRunEngine.setup_run_context`` (Prefect 3.9.1)."""


@cache
def engine_shape_known() -> bool:
    """Whether Prefect's sync flow engine sends the PATCH and the re-read as 3.9.1 does."""
    try:
        from prefect.flow_engine import FlowRunEngine

        initialize = inspect.getsource(FlowRunEngine.initialize_run)
        setup = inspect.getsource(FlowRunEngine.setup_run_context)
    except (ImportError, AttributeError, OSError, TypeError):
        return False
    return (
        "self.client.update_flow_run(" in initialize
        and PATCH_CALL in initialize
        and (REREAD_CALL in setup)
    )


@cache
def background() -> ThreadPoolExecutor:
    """The child's one thread for PATCHes sent beside a run."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="faceflow-run-start")


class RunStart:
    """The engine's start requests for one run on ``client`` (see the module docstring)."""

    def __init__(self, client: Any, flow_run: Any, claim: RunClaim | None = None) -> None:
        self.client = client
        self.claim = claim
        """Still to be made by the first ``Running`` proposal (then None)."""
        self.flow_run = flow_run
        """The object handed to ``run_flow``: the engine fills in its policy and state."""
        self.claimed_version: str | None = flow_run.flow_version
        self.claimed_policy = flow_run.empirical_policy.model_copy(deep=True)
        self.claimed_run_count: int = flow_run.run_count
        self.patched_version: str | None = None
        self.patch: Future[Any] | None = None
        self.deferred: dict[str, Any] | None = None
        """The engine's PATCH, held back until the server has answered ``Running``."""
        self.read_served = False
        self.sent: dict[str, int] = {"patch_skipped": 0, "patch_background": 0, "read_local": 0}
        self._update = client.update_flow_run
        self._read = client.read_flow_run
        self._set_state = client.set_flow_run_state

    @contextlib.contextmanager
    def installed(self) -> Iterator[RunStart]:
        """Route the client's three methods through this run's hooks while the run lasts."""
        if not engine_shape_known():
            yield self
            return
        self.client.update_flow_run = self.update_flow_run
        self.client.read_flow_run = self.read_flow_run
        self.client.set_flow_run_state = self.set_flow_run_state
        try:
            yield self
        finally:
            for name in ("update_flow_run", "read_flow_run", "set_flow_run_state"):
                with contextlib.suppress(AttributeError):
                    delattr(self.client, name)
            self.join()

    def join(self) -> None:
        """Wait for the PATCH, sending it first if it is still held back (its error, if
        any, is raised here once)."""
        self.send_deferred()
        patch, self.patch = self.patch, None
        if patch is not None:
            patch.result()

    def update_flow_run(self, flow_run_id: UUID, *args: Any, **kwargs: Any) -> Any:
        """The engine's PATCH of this run: skipped, or held back for ``Running`` to be
        answered; anything else as is."""
        if (
            args
            or flow_run_id != self.flow_run.id
            or set(kwargs) != {"flow_version", "empirical_policy"}
        ):
            self.join()
            return self._update(flow_run_id, *args, **kwargs)
        import httpx

        version, policy = kwargs["flow_version"], kwargs["empirical_policy"]
        self.patched_version = version
        if version == self.claimed_version and policy == self.claimed_policy:
            self.sent["patch_skipped"] += 1
            return httpx.Response(204)
        if policy.resuming or self.patch is not None or self.deferred is not None:
            self.join()
            return self._update(flow_run_id, **kwargs)
        self.deferred = dict(kwargs, empirical_policy=policy.model_copy(deep=True))
        self.sent["patch_background"] += 1
        return httpx.Response(202)

    def send_deferred(self) -> None:
        """Send the engine's PATCH, held back until ``Running`` was answered, in the
        background (a no-op when there is none)."""
        sent, self.deferred = self.deferred, None
        if sent is not None:
            self.patch = background().submit(self._update, self.flow_run.id, **sent)

    def set_flow_run_state(self, flow_run_id: UUID, state: Any, *args: Any, **kwargs: Any) -> Any:
        """Any state proposal but this run's ``Running`` waits for the PATCH first; the
        first ``Running`` makes the claim, if there is one."""
        is_running = getattr(state, "is_running", None)
        if flow_run_id != self.flow_run.id or not (callable(is_running) and is_running()):
            self.join()
        elif (claim := self.claim) is not None:
            self.claim = None
            state.message = claim.message
            force = bool(kwargs.get("force", args[0] if args else False))
            transition = claim.transition_id
            result = propose_shared(self.client, flow_run_id, state, transition, force=force)
            return self.patched_after(self.first_start(flow_run_id, claim_outcome(result, claim)))
        return self.patched_after(self._set_state(flow_run_id, state, *args, **kwargs))

    def patched_after(self, outcome: Any) -> Any:
        """``outcome`` of this run's ``Running``, once the held-back PATCH is on its way:
        dropped on an abort (the run is not this child's to start)."""
        from prefect.client.schemas.responses import SetStateStatus

        if getattr(outcome, "status", None) == SetStateStatus.ABORT:
            self.deferred = None
        self.send_deferred()
        return outcome

    def first_start(self, flow_run_id: UUID, outcome: Any) -> Any:
        """An accepted claim as the engine must see it: accepted when it is the run's first
        start since it was scheduled; else (Prefect accepts ``Running`` after a final
        state without a persisted result, and after ``Running`` with another transition
        id) the engine is told to abort, before the flow's first line. A final (or paused)
        state since the run was scheduled is put back as it was (type, name and message,
        which the relay and the video coordinator read; ``start_blocked_by``); a ``Running``
        is not, since the child that runs the run writes its next state (a put-back could
        overwrite that state).
        Anything but an acceptance is returned as it is."""
        from prefect.client.schemas.responses import (
            OrchestrationResult,
            SetStateStatus,
            StateAbortDetails,
        )
        from prefect.states import State

        if outcome.status != SetStateStatus.ACCEPT or outcome.state is None:
            return outcome
        blocking = start_blocked_by(self.client.read_flow_run_states(flow_run_id), outcome.state)
        if blocking is None:
            return outcome
        was = f"the run was {blocking.name or blocking.type.value} before {outcome.state.message!r}"
        if blocking.is_running():  # its child writes the run's next state: leave it to it
            reason = f"{LATE_CLAIM}: {was} was accepted; left to the child that runs it"
        else:  # over (or paused): nobody else writes, so it is put back as it was
            put_back = State(type=blocking.type, name=blocking.name, message=blocking.message)
            self._set_state(flow_run_id, put_back, force=True)
            reason = f"{LATE_CLAIM}: {was} was accepted; put back"
        return OrchestrationResult(
            state=outcome.state,
            status=SetStateStatus.ABORT,
            details=StateAbortDetails(reason=reason),
        )

    def read_flow_run(self, flow_run_id: UUID) -> Any:
        """The engine's first re-read of this run once ``Running``, answered here."""
        if flow_run_id == self.flow_run.id and not self.read_served and self.can_serve_read():
            self.read_served = True
            self.sent["read_local"] += 1
            return self.started_run()
        self.join()
        return self._read(flow_run_id)

    def can_serve_read(self) -> bool:
        """Whether the run is a deployment run (a suspension observer watches it) whose
        ``Running`` the server has just accepted, and not one resuming from a pause."""
        run = self.flow_run
        state = run.state
        return (
            run.deployment_id is not None
            and state is not None
            and state.is_running()
            and state.id is not None
            and not self.claimed_policy.resuming
        )

    def started_run(self) -> Any:
        """The run as the server holds it once ``Running`` is accepted and the PATCH lands."""
        run = self.flow_run.model_copy(deep=True)
        state = run.state
        run.state_id = state.id
        run.run_count = self.claimed_run_count + 1
        run.start_time = run.start_time or state.timestamp
        run.next_scheduled_start_time = None
        if self.patched_version is not None:
            run.flow_version = self.patched_version
        expected = run.expected_start_time
        if expected is not None and run.start_time > expected:
            run.estimated_start_time_delta = run.start_time - expected
        return run


def claim_outcome(result: Any, claim: RunClaim) -> Any:
    """Prefect's answer to a claiming ``Running`` proposal, as the engine must see it.

    Rejected with a state of the claim's transition id: the run's current state is a claim
    of the same run. A ``Running`` with the claim's message is this child's own (a request
    sent again after its answer was lost): accepted. Any other (another worker's child
    started the run, or another worker holds it ``Pending`` for a child of its own): an
    abort, which the engine raises as ``Abort`` before the flow runs. Any other answer is
    Prefect's as it is (a rejection into ``Cancelled``, a wait)."""
    from prefect.client.schemas.responses import (
        OrchestrationResult,
        SetStateStatus,
        StateAbortDetails,
        StateAcceptDetails,
    )

    current = result.state
    if (
        result.status != SetStateStatus.REJECT
        or current is None
        or str(current.state_details.transition_id) != claim.transition_id
    ):
        return result
    if current.is_running() and current.message == claim.message:
        return OrchestrationResult(
            state=current, status=SetStateStatus.ACCEPT, details=StateAcceptDetails()
        )
    if current.is_running():
        reason = f"another worker started the run first ({current.message})"
    else:
        reason = f"another worker claimed the run first ({current.name}: {current.message})"
    return OrchestrationResult(
        state=current, status=SetStateStatus.ABORT, details=StateAbortDetails(reason=reason)
    )


def start_blocked_by(states: list[Any], ours: Any) -> Any:
    """The state that makes the accepted claim ``ours`` a second start, from the run's
    ``states`` (any order) since the last ``Scheduled`` one before ``ours`` (and up to the
    next): None when every other one is ``Pending`` (the run's first start), or when
    ``ours`` is not among them. Else the latest final (or paused) state, which the claim
    displaced or which ended the run after it (put back), or else the latest ``Running``
    (another child runs the run). The server stamps a proposal as it arrives, before it
    takes the run's lock, so a claim that arrives just before another child's start or end
    and is accepted just after it sorts before that state: every state of the span counts,
    not only those before ``ours``."""
    from prefect.client.schemas.objects import StateType

    ordered = sorted(states, key=lambda state: state.timestamp)
    mine = [i for i, state in enumerate(ordered) if state.id == ours.id]
    if not mine:
        return None
    first = last = mine[0]
    while first > 0 and ordered[first - 1].type is not StateType.SCHEDULED:
        first -= 1
    while last + 1 < len(ordered) and ordered[last + 1].type is not StateType.SCHEDULED:
        last += 1
    others = [
        state
        for state in ordered[first : last + 1]
        if state.id != ours.id and state.type is not StateType.PENDING
    ]
    ended = [state for state in others if not state.is_running()]
    return (ended or others or [None])[-1]
