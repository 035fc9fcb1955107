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
  otherwise it goes out in a background thread, beside the engine's ``Running`` proposal
  and the flow's body, and is joined before any other state proposal, read or end of the
  run, so the server holds the run's flow version and retry policy before it orchestrates
  a ``Failed`` (retries), a pause or the final state, as with Prefect's order. A run that
  is resuming (its policy's ``resuming`` flag, which the ``Running`` transition clears) gets
  Prefect's synchronous PATCH.
- the re-read of a deployment run is answered from the run the worker handed over with
  what the server's ``Running`` transition sets (Prefect's ``GlobalFlowPolicy``: state,
  ``run_count`` + 1, ``start_time``, no next scheduled time) and the PATCH's values.
  What the re-read could add is a change made by someone else since: a cancellation is
  enforced by the worker (it kills the child), never read here; a suspension is caught by
  the run's suspension observer, registered before ``Running`` is proposed (as for a
  request that lands just after Prefect's own re-read); the worker's labels and pid are
  written once the run is ``Running``, so Prefect's re-read may or may not see them too.
  Later reads (a retry's) go to the server.

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

PATCH_CALL = "flow_version=self.flow.version"
"""What ``FlowRunEngine.initialize_run`` passes to ``update_flow_run`` (Prefect 3.9.1)."""

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

    def __init__(self, client: Any, flow_run: Any) -> None:
        self.client = client
        self.flow_run = flow_run
        """The object handed to ``run_flow``: the engine fills in its policy and state."""
        self.claimed_version: str | None = flow_run.flow_version
        self.claimed_policy = flow_run.empirical_policy.model_copy(deep=True)
        self.claimed_run_count: int = flow_run.run_count
        self.patched_version: str | None = None
        self.patch: Future[Any] | None = None
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
        """Wait for the background PATCH (its error, if any, is raised here once)."""
        patch, self.patch = self.patch, None
        if patch is not None:
            patch.result()

    def update_flow_run(self, flow_run_id: UUID, *args: Any, **kwargs: Any) -> Any:
        """The engine's PATCH of this run: skipped or sent beside; anything else as is."""
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
        if policy.resuming or self.patch is not None:
            self.join()
            return self._update(flow_run_id, **kwargs)
        sent = dict(kwargs, empirical_policy=policy.model_copy(deep=True))
        self.patch = background().submit(self._update, flow_run_id, **sent)
        self.sent["patch_background"] += 1
        return httpx.Response(202)

    def set_flow_run_state(self, flow_run_id: UUID, state: Any, *args: Any, **kwargs: Any) -> Any:
        """Any state proposal but this run's ``Running`` waits for the PATCH first."""
        is_running = getattr(state, "is_running", None)
        if flow_run_id != self.flow_run.id or not (callable(is_running) and is_running()):
            self.join()
        return self._set_state(flow_run_id, state, *args, **kwargs)

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
