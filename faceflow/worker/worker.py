"""``faceflow-gpu``: a Prefect worker that runs flow runs inside warm, pre-started children.

Start it as ``prefect worker start --pool gpu --type faceflow-gpu`` (discovered through the
``prefect.collections`` entry point ``faceflow = "faceflow.worker"``) or ``faceflow worker``.

For every scheduled run the worker does what Prefect's process worker does before it
starts a process (the claim, job configuration from the pool's template, worker labels),
then hands the run to an idle child, which runs it through ``prefect.flow_engine.run_flow``
(states, logs and the UI as usual). It skips the per-run work that a warm child makes
pointless: no ``Submitting`` state, the settings serialised into the run's environment once,
the deployment and flow read from a cache of a few seconds (``job.DefinitionCache``),
beside the ``Pending`` proposal when stale, never after it, the run's infrastructure pid
and labels written once the run is ``Running`` (``_after_start``), not beside the child's
start of it, no rename when the run already has its job's name. A run announced by its
pool's ``Scheduled`` event is claimed from that event (one read of the run); a run claimed
ahead is handed to its child without a second read unless a stop event named it or the
event stream was down meanwhile (``PoolEvents.may_have_stopped``); the polls stay as the fallback,
and the worker reconnects its event stream itself so that it knows of every gap.

A run that an idle child takes at once is claimed by the child's ``Running`` proposal
(``claim_on_start``, ``_claim_on_start``): no ``Pending`` state, one orchestrated API call
fewer on the run's path. Two workers' claims of one run carry the same transition id, which
Prefect refuses to repeat, so only one starts it (``run_start.claim_outcome``); a run claimed
ahead of a free child, or of a deployment with a concurrency limit, goes ``Pending`` first.

From outside the child the worker enforces the run's ``deadline_at`` (+ grace) and
cancellation by killing the child (SIGTERM, then SIGKILL), marks the run ``Crashed``
(``[deadline_exceeded] …``) or ``Cancelled``, and warms a fresh child. Deployment pull
steps are not run: flow code is imported from the worker's working directory
(``working_dir`` job variable, else ``FACEFLOW_WORKER_WORKING_DIR``, else cwd).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
from prefect.client.schemas.objects import StateType
from prefect.exceptions import Abort, ObjectNotFound
from prefect.settings import PREFECT_WORKER_QUERY_SECONDS, get_current_settings, temporary_settings
from prefect.states import Cancelled, Crashed, Pending, Scheduled
from prefect.utilities.engine import propose_state
from prefect.workers.base import BaseWorker, BaseWorkerResult

from faceflow.worker.claims import Claim, ClaimJournal
from faceflow.worker.health import HealthServer, write_status_file
from faceflow.worker.job import DEFINITIONS, FaceFlowJobConfiguration, FaceFlowVariables
from faceflow.worker.pool import CheckState, ChildGone, ChildPool, NoChildReady, PoolLimits, Slot
from faceflow.worker.pool_events import EVENTS_SETTLE_S, PoolEvents, run_id_of
from faceflow.worker.protocol import RunFinished, RunRequest, RunStarted
from faceflow.worker.recovery import LOST_CODE, open_journal, recover_claims
from faceflow.worker.run_start import LATE_CLAIM, engine_shape_known
from faceflow.worker.settings import DEFAULT_ENTRYPOINT, WorkerSettings
from faceflow.worker.start_claims import StartClaims, claiming_state
from faceflow.worker.transitions import SharedTransition, claim_transition
from tasks.error_codes import JobErrorCode

if TYPE_CHECKING:
    from collections.abc import Coroutine
    from uuid import UUID

    from prefect.client.schemas.objects import FlowRun, State
    from prefect.client.schemas.responses import WorkerFlowRunResponse
    from prefect.events.schemas.events import Event

WORKER_TYPE = "faceflow-gpu"
# The codes that open the message of a run this worker ends ``Crashed`` (for the Prefect UI:
# the relay never reads a state's message, it reaps the run itself).
DEADLINE_CODE = JobErrorCode.deadline_exceeded
# A child's claim in flight as the child died has been recorded this much later (s), or
# was not: see ``_claimed_here``.
CLAIM_SETTLE_S = 1.0
# A run claimed on start whose outcome no Running event told has its states read this
# often (s) until one claim shows (``_learn_claim``).
CLAIM_READ_S = 0.2
# The run's bookkeeping (its infrastructure pid, the worker's labels) waits for the run's
# Running event, at most this long (s): see ``_after_start``.
START_WAIT_S = 2.0
_KEEP_ON_KILL = frozenset({StateType.COMPLETED, StateType.FAILED, StateType.CANCELLED})
# A run that waited longer than this for a child is read again before one gets it (it may
# have been cancelled meanwhile), unless the events say it was not
# (``PoolEvents.may_have_stopped``); one that got a child at once goes without the read.
ACQUIRE_RECHECK_S = 0.05


class FaceFlowWorkerResult(BaseWorkerResult):
    """Outcome of one run. ``status_code`` is 0 once the run's final state is recorded in
    Prefect (by the engine or by the worker after a kill), so the base worker adds no
    generic ``Crashed`` on top; ``outcome`` says what happened."""

    outcome: str = "finished"


class FaceFlowGpuWorker(
    BaseWorker[FaceFlowJobConfiguration, FaceFlowVariables, FaceFlowWorkerResult]
):
    """Runs flow runs in warm children that keep their models loaded."""

    type = WORKER_TYPE
    job_configuration = FaceFlowJobConfiguration
    job_configuration_variables = FaceFlowVariables
    _description = (
        "FaceFlow's GPU worker: flow runs execute in pre-started children that keep the "
        "pipeline's models loaded; deadlines and cancellation are enforced by killing the child."
    )
    _display_name = "FaceFlow GPU"
    _documentation_url = ""
    _logo_url = ""

    def __init__(self, *args: Any, settings: WorkerSettings | None = None, **kwargs: Any) -> None:
        self.settings = settings or WorkerSettings()
        children = len(self.settings.child_specs())
        if kwargs.get("limit") is not None:  # --limit caps the runs executing at once
            children = max(1, min(int(kwargs["limit"]), children))
        self._children = children
        # One place more than children + prefetch: kept for a run of the priority queue.
        kwargs["limit"] = children + self.settings.prefetch_runs + 1
        super().__init__(*args, **kwargs)
        self._pool: ChildPool | None = None
        self._draining = False
        self._stop_scope: anyio.CancelScope | None = None
        self._services: list[asyncio.Task[None]] = []
        self._health: HealthServer | None = None
        self._poll_now = asyncio.Event()
        self._prefetch_paused = False
        self._priority_only = False
        self._last_poll_ok = time.monotonic()
        self._journal: ClaimJournal | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._announced: set[str] = set()  # runs being claimed from their Scheduled event
        self._left_for_poll = False  # a run announced since the last poll was not claimed
        self._events = PoolEvents(self._logger)
        self._starts: dict[str, asyncio.Event] = {}  # handed-over runs not seen Running yet
        self._on_start = StartClaims()  # runs claimed by their child's Running (no Pending)
        self._claims_on_start = False  # settled in ``setup``
        self.claims = {"event": 0, "poll": 0}  # runs claimed, by source
        self.polls = 0  # queries of the pool for scheduled runs
        # prefetched runs handed to a child after a wait: read again first, or not (events)
        self.handovers = {"read": 0, "unread": 0}

    # ------------------------------------------------------------------ lifecycle

    @property
    def pool(self) -> ChildPool:
        if self._pool is None:
            raise RuntimeError("the worker is not set up")
        return self._pool

    async def start(
        self,
        run_once: bool = False,
        with_healthcheck: bool = False,
        printer: Any = print,
    ) -> None:
        """Prefect's worker loop with a short poll interval, stoppable by SIGTERM (drain)."""
        with (
            temporary_settings({PREFECT_WORKER_QUERY_SECONDS: self.settings.query_seconds}),
            anyio.CancelScope() as scope,
        ):
            self._stop_scope = scope
            await super().start(
                run_once=run_once, with_healthcheck=with_healthcheck, printer=printer
            )

    async def setup(self) -> None:
        """Start the warm children, the health endpoint, event pickup and signal handling."""
        env = self.job_configuration._base_environment()  # the runs' Prefect settings
        env = {k: v for k, v in env.items() if k.startswith("PREFECT_")}
        specs = self.settings.child_specs(extra_env=env)[: self._children]
        limits = PoolLimits(
            ready_timeout=self.settings.ready_timeout_s,
            max_runs=self.settings.max_runs_per_child,
            max_rss_mb=self.settings.max_rss_mb,
            stop_grace=self.settings.stop_grace_s,
            kill_grace=self.settings.kill_grace_s,
        )
        if self.settings.log_dir:
            self.settings.log_dir.mkdir(parents=True, exist_ok=True)
        self._pool = ChildPool(specs, limits, self.settings.log_dir)
        self._pool.on_idle = self._child_idle
        await self._pool.start()
        if self.settings.health_port is not None:
            self._health = HealthServer(self.status, port=self.settings.health_port)
            self._health.start()
        await super().setup()
        self._claims_on_start = (
            self.settings.claim_on_start and self.settings.lean_run_start and engine_shape_known()
        )
        self._install_signal_handlers()
        left = self._open_journal()
        if left:
            assert self._journal is not None
            recovery = recover_claims(self.client, self._journal, left, self.name, self._logger)
            self._services.append(asyncio.create_task(recovery))
        if self.settings.status_file:
            self._services.append(asyncio.create_task(self._write_status_loop()))
        self._services.append(asyncio.create_task(self._poll_now_loop()))
        self._services.append(asyncio.create_task(self._poll_watchdog_loop()))
        if self.settings.event_pickup:
            self._services.append(asyncio.create_task(self._event_pickup_loop()))

    async def teardown(self, *exc_info: Any) -> None:
        """Stop the services and every child (by PID), then Prefect's teardown."""
        for task in [*self._services, *self._background]:
            task.cancel()
        for task in [*self._services, *self._background]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._services.clear()
        with anyio.CancelScope(shield=True):
            if self._pool is not None:
                await self._pool.close()
        if self.settings.status_file:
            write_status_file(self.settings.status_file, self.status())
        if self._health is not None:
            self._health.stop()
        self._remove_signal_handlers()
        if self._journal is not None:
            self._journal.release()
        await super().teardown(*exc_info)

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(signum, self.request_shutdown, signum)

    def _remove_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        with contextlib.suppress(Exception):
            loop = asyncio.get_running_loop()
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(signum)

    def request_shutdown(self, signum: int = signal.SIGTERM) -> None:
        """First call: stop taking runs and drain; a second call stops at once."""
        if self._draining:
            self._logger.warning("Second %s: stopping now.", signal.Signals(signum).name)
            self.settings.drain_grace_s = 0.0
            return
        self._draining = True
        self._logger.info(
            "Received %s: taking no new runs; waiting up to %.0f s for running ones.",
            signal.Signals(signum).name,
            self.settings.drain_grace_s,
        )
        self._services.append(asyncio.create_task(self._drain()))

    async def _drain(self) -> None:
        start = time.monotonic()

        def active() -> int:
            return self.pool.busy_count() + self.pool.waiting

        while active() and time.monotonic() - start < self.settings.drain_grace_s:
            await asyncio.sleep(0.05)
        if self._stop_scope is not None:
            self._stop_scope.cancel()

    # ------------------------------------------------------------------ claimed runs

    def state_dir(self) -> Path:
        """Where the claim journal lives (``FACEFLOW_WORKER_STATE_DIR`` or Prefect's home)."""
        if self.settings.state_dir is not None:
            return self.settings.state_dir
        return Path(get_current_settings().home) / "faceflow-worker"

    def _open_journal(self) -> list[Claim]:
        """Take this worker identity's claim journal; the claims a dead predecessor left."""
        self._journal, left = open_journal(
            self.state_dir(),
            self._work_pool_name,
            self.name,
            recover=self.settings.recover_claims,
            logger=self._logger,
        )
        return left

    # ------------------------------------------------------------------ pickup
    # Prefect 3.9's BaseWorker has no public hook for these five steps of its pickup (the
    # submission, the Pending claim, the Submitting state, the worker labels, the
    # scheduled-run query), so they override its private methods, each calling ``super()``
    # where it keeps Prefect's behaviour. The warm-worker tests (tests/worker/) exercise
    # each one against a real server, so a Prefect release that renames or reshapes them
    # fails CI, not production.
    # Everything else uses public hooks: ``setup``, ``teardown``, ``run``,
    # ``get_and_submit_flow_runs``, ``kill_infrastructure``.

    async def _submit_run(self, flow_run: FlowRun) -> None:
        """Prefect's submission of a claimed run (``BaseWorker._submit_run``), with its
        check that the run's deployment still exists made beside the ``Pending`` proposal
        instead of before it: one API round trip fewer between the run's pickup and its
        child. A run whose deployment is gone is still never handed to a child, and is
        cancelled, as Prefect does. With a child idle for it the run is claimed on start
        (``_claim_on_start``): the check, from the definition cache as a rule, comes first
        then, and says whether the deployment's concurrency limit needs ``Pending``."""
        check = asyncio.create_task(self._deployment_check(flow_run))
        try:
            if self._claim_on_start_now():
                with self._on_start.deciding():  # the idle child is this run's meanwhile
                    gone, limited = await check  # from the definition cache, as a rule
                if gone:
                    ready = False
                elif limited:  # Prefect takes the deployment's slot with Pending
                    ready = await self._propose_pending_state(flow_run)
                else:
                    ready = self._claim_on_start(flow_run)
            else:
                ready = await self._propose_pending_state(flow_run)
                gone, _limited = await check
        finally:
            check.cancel()  # a no-op once it is done
        if gone:
            self._logger.error(
                "Deployment %s no longer exists. Flow run %s will not be submitted for execution",
                flow_run.deployment_id,
                flow_run.id,
            )
            await self._mark_flow_run_as_cancelled(
                flow_run,
                state_updates={
                    "message": f"Deployment {flow_run.deployment_id} no longer exists, "
                    "cancelled run."
                },
            )
            if self._journal is not None:
                self._journal.remove(str(flow_run.id))
            ready = False
        if ready:
            assert self._runs_task_group is not None
            on_start = self._on_start.holds(str(flow_run.id))
            if self._events.live or on_start:
                self._starts[str(flow_run.id)] = start = asyncio.Event()
                if on_start:
                    self._in_background(self._learn_claim(str(flow_run.id), start))
            started = await self._runs_task_group.start(
                self._submit_run_and_capture_errors, flow_run
            )
            if started and not isinstance(started, Exception):
                run_logger = self.get_flow_run_logger(flow_run)
                await self._after_start(flow_run.id)
                if not self._on_start.started_here(str(flow_run.id)):
                    self._submitted(flow_run)
                    return
                try:
                    await self.client.update_flow_run(
                        flow_run_id=flow_run.id, infrastructure_pid=str(started)
                    )
                except Exception:
                    run_logger.exception(
                        "An error occurred while setting the `infrastructure_pid` on flow run "
                        f"{flow_run.id!r}. The flow run will not be cancellable."
                    )
                run_logger.info(f"Flow run '{flow_run.name}' submitted to infrastructure")
            else:
                self._release_limit_slot(flow_run.id)
                self._on_start.give_back(str(flow_run.id))  # ``run`` may never have had it:
                self._run_started(str(flow_run.id))  # its bookkeeping goes (``_learn_claim``)
        else:
            self._release_limit_slot(flow_run.id)
        self._submitted(flow_run)

    def _submitted(self, flow_run: FlowRun) -> None:
        """Prefect's bookkeeping once a run's submission is over."""
        self._submitting_flow_run_ids.discard(flow_run.id)
        if self._cancelling_observer is not None:
            self._cancelling_observer.remove_in_flight_flow_run_id(flow_run.id)

    async def _deployment_check(self, flow_run: FlowRun) -> tuple[bool, bool]:
        """Whether the run names a deployment that no longer exists (an API error: no), and
        whether that deployment has a concurrency limit (which Prefect enforces on
        ``Pending``). The deployment and the run's flow come from ``DEFINITIONS``: read beside
        ``Pending`` when the cache holds none younger than its TTL (after idle time), so
        that the run's job configuration, made once ``Pending`` is accepted, needs no
        request; while runs of the deployment keep coming, no read at all. Deleting a
        deployment deletes its ``Scheduled`` runs in the same transaction (Prefect's
        ``delete_deployment``), so a run claimed from ``Scheduled`` had its deployment then;
        only one that was out of ``Scheduled`` while it was deleted and is scheduled again
        within the TTL gets past this check, and it runs as its deployment last said."""
        if flow_run.deployment_id is None:
            return False, False
        deployment, _flow = await asyncio.gather(
            DEFINITIONS.deployment(self.client, flow_run.deployment_id),
            DEFINITIONS.flow(self.client, flow_run.flow_id),
            return_exceptions=True,
        )
        if isinstance(deployment, ObjectNotFound):
            return True, False
        if isinstance(deployment, BaseException):  # Prefect's own check would fail the
            self._logger.debug("could not read deployment: %s", deployment)  # submission
            return False, True  # unknown: claimed with Pending, as Prefect would
        limited = deployment.global_concurrency_limit is not None
        return False, limited or deployment.concurrency_limit is not None

    def _claim_on_start_now(self) -> bool:
        """Whether a run claimed now is claimed by its child's ``Running``: the mode is on
        and a warm child is idle for it, beyond the runs already claimed so or being claimed
        so (``StartClaims.deciding``; two runs found in one poll with one child idle: the
        second is claimed with ``Pending``, not left ``Scheduled`` while it waits for the
        child, where another worker's idle child may take it first)."""
        pool = self._pool
        return (
            self._claims_on_start
            and pool is not None
            and pool.idle_count() > self._on_start.waiting()
        )

    def _claim_on_start(self, flow_run: FlowRun) -> bool:
        """Journal the claim of a run that its child's ``Running`` will make (nothing is sent
        to Prefect now: the run stays ``Scheduled`` until then, for any worker to take)."""
        run_id = str(flow_run.id)
        if self._journal is not None:
            self._journal.add(run_id)
        self._on_start.take(run_id, flow_run.run_count)
        self._count_claim(run_id, made=True)
        return True

    def _count_claim(self, run_id: str, *, made: bool) -> None:
        """Count a claim that was ``made`` by where the run came from (its event, a poll)."""
        announced = run_id in self._announced
        self._announced.discard(run_id)
        if made:
            self.claims["event" if announced else "poll"] += 1

    async def _propose_pending_state(self, flow_run: FlowRun) -> bool:
        """Journal the claim *before* Prefect records it as ``Pending``.

        A worker killed between the two left a ``Pending`` run that no journal named: it
        held the pool's slot until the relay's pending timeout (found by the full fault
        matrix, scenario 1). Journalled first, a run that is still ``Scheduled`` at
        recovery is left alone and a ``Pending`` one goes back to ``Scheduled``.

        The ``Pending`` carries the transition id of the run's claims (``transitions``), so
        no other worker's child claims the run on start after it, and a message of this
        claim's own: Prefect answers a repeat of it (its answer lost) with this ``Pending``,
        which is this worker's claim, and another worker's with theirs, which is not.
        """
        run_id = str(flow_run.id)
        if self._journal is not None:
            self._journal.add(run_id)
        accepted = await self._propose_pending(flow_run)
        self._count_claim(run_id, made=accepted)
        if not accepted and self._journal is not None:
            self._journal.remove(run_id)
        return accepted

    async def _propose_pending(self, flow_run: FlowRun) -> bool:
        """Prefect's ``BaseWorker._propose_pending_state`` (3.9.1), with the claim's
        transition id and message: whether the run is this worker's now."""
        run_logger = self.get_flow_run_logger(flow_run)
        message = f"Claimed by faceflow-gpu worker {self.name} (claim {uuid.uuid4().hex[:8]})."
        transition = claim_transition(flow_run.id, flow_run.run_count)
        # ``propose_state`` calls its client's ``set_flow_run_state`` alone
        client: Any = SharedTransition(self.client, transition)
        try:
            state = await propose_state(client, Pending(message=message), flow_run_id=flow_run.id)
        except Abort as exc:
            run_logger.info(
                f"Aborted submission of flow run '{flow_run.id}'. Server sent an abort signal: {exc}"
            )
            return False
        except Exception:
            run_logger.exception(f"Failed to update state of flow run '{flow_run.id}'")
            return False
        if not state.is_pending() or state.message != message:
            run_logger.info(
                f"Aborted submission of flow run '{flow_run.id}': Server returned "
                f"{state.type.value!r} ({state.message})"
            )
            return False
        return True

    async def _propose_submitting_state(self, flow_run: FlowRun) -> None:
        """No ``Submitting`` state: the run goes from ``Pending`` to an idle warm child at
        once, and the child's engine records ``Running``. Prefect's extra state transition
        cost every run one orchestrated API call (≈ 40 ms, measured in bench/warm_worker.py)
        and told an operator nothing."""

    async def _give_worker_labels_to_flow_run(self, flow_run_id: UUID) -> None:
        """Label the run with this worker and pool (as Prefect does) without making the
        run wait for it: the request runs in the background once the run is ``Running``
        (``_after_start``)."""
        parent = super()._give_worker_labels_to_flow_run

        async def label() -> None:
            await self._after_start(flow_run_id)
            if not self._on_start.started_here(str(flow_run_id)):
                return
            try:
                await parent(flow_run_id)
            except Exception as exc:  # labels help operators; a failure must not stop a run
                self._logger.debug("could not label flow run %s: %s", flow_run_id, exc)

        self._in_background(label())

    async def _after_start(self, flow_run_id: UUID) -> None:
        """Wait until a handed-over run is ``Running`` (its event), has ended, or
        ``START_WAIT_S`` passed. The worker's own writes to the run (its infrastructure
        pid and labels, two requests to Prefect) then come after the child's engine has
        started the run, not beside the engine's update of the run and its ``Running``
        proposal, which would wait behind them on the server (the same row of Prefect's
        database and the same event loop). Prefect's cancellation of a run without a pid
        happens only before ``Running``; this worker's supervision stops the child either way
        (``_cancel_if_requested``, nudged by the run's ``Cancelling`` event). A run claimed
        on start waits until its claim's outcome is known (``_learn_claim``) or it ended:
        the worker whose child lost the claim writes nothing on the winner's run."""
        key = str(flow_run_id)
        start = self._starts.get(key)
        if start is None:
            return
        on_start = self._on_start.holds(key)
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(start.wait(), None if on_start else START_WAIT_S)
        finally:
            if self._starts.get(key) is start:  # no event came (a submission that failed)
                del self._starts[key]

    async def _learn_claim(self, run_id: str, start: asyncio.Event) -> None:
        """For a run claimed on start: whose claim started it, read from its states when
        no ``Running`` event told it within ``START_WAIT_S`` (at once while the event
        stream is down), every ``CLAIM_READ_S`` until a claim shows or the run is over."""
        if self._events.live:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(start.wait(), START_WAIT_S)
        while not start.is_set():
            claim = self._on_start.claim_of(run_id)  # None until the hand-over
            if claim is not None:
                try:
                    states = await self.client.read_flow_run_states(uuid.UUID(run_id))
                except Exception as exc:  # transient API trouble: read again
                    self._logger.debug("could not read the states of flow run %s: %s", run_id, exc)
                    states = []
                claiming = claiming_state(states, claim)
                if claiming is not None:
                    self._run_started(run_id, claiming.message)
                    return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(start.wait(), CLAIM_READ_S)

    def _run_started(self, flow_run_id: str, message: str | None = None) -> None:
        """The run is ``Running`` (or over): its bookkeeping may go (``_after_start``).
        ``message``: the ``Running`` state's, which tells a run claimed on start whether
        this worker's child started it (the child itself stops before the flow when its
        claim came after the run was stopped or started: ``run_start.first_start``)."""
        self._on_start.seen_running(flow_run_id, message)
        start = self._starts.pop(flow_run_id, None)
        if start is not None:
            start.set()

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` as a task of its own, kept until it ends (cancelled at teardown)."""
        task = asyncio.create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _open_places(self) -> tuple[int, list[str]]:
        """How many runs this worker may claim now, and from which work queues (all of
        the worker's when empty): while a warm child is idle, or all are running and a
        prefetch place is free, the children's and prefetch places but one, kept for the
        priority queue; when every other place is taken, that one place on the priority
        queue alone (other workers take the rest; nothing is claimed while no child is
        warm or while draining)."""
        pool = self._pool
        free = pool is not None and (
            pool.idle_count() > 0
            or (
                pool.busy_count() > 0
                and pool.waiting < self.settings.prefetch_runs
                and not self._prefetch_paused
            )
        )
        self._priority_only = not free and pool is not None and pool.priority_waiting == 0
        if self._draining or not (free or self._priority_only):
            return 0, []
        limiter = self._limiter
        tokens = self.limiter.total_tokens - self.limiter.borrowed_tokens if limiter else 1
        if not self._priority_only:
            return int(tokens) - 1, list(self._work_queues)
        priority = self.settings.priority_queue
        if self._work_queues and priority not in self._work_queues:
            return 0, []
        return min(1, int(tokens)), [priority]

    async def get_and_submit_flow_runs(self) -> list[FlowRun]:
        """Prefect's poll, only while ``_open_places`` finds a place."""
        if self._open_places()[0] <= 0:
            self._last_polled_time = datetime.now(UTC)
            self._last_poll_ok = time.monotonic()
            return []
        runs = await super().get_and_submit_flow_runs()
        self._last_poll_ok = time.monotonic()
        return runs

    async def _get_scheduled_flow_runs(self) -> list[WorkerFlowRunResponse]:
        """Prefect's poll, cut to ``_open_places``. The server returns runs of
        higher-priority queues first."""
        places, queues = self._open_places()
        if places <= 0:
            return []
        scheduled_before = datetime.now(UTC) + timedelta(seconds=int(self._prefetch_seconds))
        self._left_for_poll = False  # this poll sees them; what it cannot take is left again
        self.polls += 1
        try:
            runs = await self.client.get_scheduled_flow_runs_for_work_pool(
                work_pool_name=self._work_pool_name,
                scheduled_before=scheduled_before,
                work_queue_names=queues,
            )
        except ObjectNotFound:
            return []
        taken = self._cut_to_open_places(runs)
        if len(taken) < len(runs):
            self._left_for_poll = True
        return taken

    def _cut_to_open_places(self, runs: list[WorkerFlowRunResponse]) -> list[WorkerFlowRunResponse]:
        """``runs`` not claimed yet, cut to the places open now. Called with no await
        before Prefect's submission takes the limiter's places, so a claim made meanwhile
        (an announced run, another poll) is neither repeated nor given a second place, and
        the priority queue's place is kept."""
        places, queues = self._open_places()
        held: set[object] = set(self._submitting_flow_run_ids)
        if self._limiter is not None:
            held.update(self._limiter.statistics().borrowers)
        runs = [r for r in runs if r.flow_run.id not in held]
        if queues:
            runs = [r for r in runs if r.flow_run.work_queue_name in queues]
        return runs[: max(places, 0)]

    async def _claim_announced(self, event: Event) -> None:
        """Claim the run a ``Scheduled`` event names, without a poll of the whole pool: one
        read of that run, then Prefect's submission (limiter, ``Pending``, hand-over) as for
        a polled run. Only where a poll would take it now: a place is open for its work
        queue, it is still ``Scheduled`` in this pool and due. Anything else is left to the
        polls (one is asked for when the read fails). Two claims of one run cannot both
        start it: Prefect's submission skips a run it holds, and its orchestration refuses
        a second ``Pending``. A run left for want of a place makes the next child that is
        free poll (``_poll_if_runs_left``)."""
        from prefect.client.schemas.responses import WorkerFlowRunResponse

        queue = event.resource_in_role.get("work-queue")
        if self._work_pool is None or queue is None:
            return
        places, queues = self._open_places()
        if places <= 0 or (queues and queue.name not in queues):
            self._left_for_poll = True
            return
        try:
            announced = uuid.UUID(run_id_of(event.resource.id))
            run = await self.client.read_flow_run(announced)
        except Exception as exc:  # ObjectNotFound, API trouble: the poll decides
            self._logger.debug("could not read announced flow run: %s", exc)
            self._poll_now.set()
            return
        state = run.state
        if state is None or not state.is_scheduled() or run.work_queue_id is None:
            return
        if run.work_pool_id != self._work_pool.id:
            return
        due = datetime.now(UTC) + timedelta(seconds=int(self._prefetch_seconds))
        if (state.state_details.scheduled_time or state.timestamp) > due:
            return
        found = WorkerFlowRunResponse(
            work_pool_id=self._work_pool.id, work_queue_id=run.work_queue_id, flow_run=run
        )
        runs = self._cut_to_open_places([found])  # places may have been taken meanwhile
        if not runs:
            self._left_for_poll = True
            return
        run_id = str(run.id)
        self._announced.add(run_id)
        submitted = await self._submit_scheduled_flow_runs(runs)
        if all(str(r.id) != run_id for r in submitted):
            self._announced.discard(run_id)
            self._left_for_poll = True

    def _child_idle(self) -> None:
        """A child is free: claim ahead again, and poll if runs may wait
        (``_poll_if_runs_left``)."""
        self._prefetch_paused = False
        self._poll_if_runs_left()

    def _poll_if_runs_left(self) -> None:
        """Poll now, as a child turns idle, where a scheduled run may wait unclaimed:
        without the event subscription, or when a run announced since the last poll was
        left for want of a place (or a poll found more runs than places). With every
        announced run claimed from its event, a poll would find nothing: one pool query
        per run fewer, on the server while the next job is dispatched. A run's end polls
        always (``run``). A run whose event was lost (a subscriber's overflowing
        queue) waits for the periodic poll (``query_seconds``)."""
        if self._left_for_poll or not self._events.live:
            self._poll_now.set()

    async def _event_pickup_loop(self) -> None:
        """Claim the run of a ``Scheduled`` event of the pool at once (``_claim_announced``),
        and read a supervised run's state at once when it is ``Cancelling`` (websocket
        events; the polls stay as the fallback)."""
        while self._work_pool is None:
            await asyncio.sleep(0.1)
        await self._events.follow(
            self._work_pool.id,
            on_connect=self._events_connected,
            # beside the stream: a Cancelling event never waits for a claim
            on_scheduled=lambda event: self._in_background(self._claim_announced(event)),
            on_running=self._run_started,
            on_cancelling=self._check_state_now,
            on_drop=self._events_dropped,
        )

    def _events_connected(self) -> None:
        """The event stream is up: read once what it may hide. What happened before the
        subscription took effect may never arrive (backfill reads only persisted events,
        which the event persister writes up to a second late): every supervised run's state
        is read, and the pool polled now and ``EVENTS_SETTLE_S`` later (the server starts the
        stream only once it has read the filter the subscriber sent: a run scheduled between
        the first poll and that start is found by the second; with the periodic poll far
        apart, tests saw one wait a whole minute)."""
        for slot in self.pool.slots:
            if slot.flow_run_id is not None:
                slot.run_queue.put_nowait(CheckState(slot.flow_run_id))
        self._poll_now.set()
        asyncio.get_running_loop().call_later(EVENTS_SETTLE_S, self._poll_now.set)

    def _events_dropped(self) -> None:
        """The event stream ended (dropped, or closed cleanly): the worker polls until it is
        back, and the runs waiting for their ``Running`` event stop waiting (``_learn_claim``
        reads the states of those claimed on start)."""
        for run_id in list(self._starts):
            if not self._on_start.holds(run_id):
                self._run_started(run_id)

    def _check_state_now(self, run_id: str) -> None:
        """Nudge the supervision of flow run ``run_id``, if a child runs it."""
        for slot in self.pool.slots:
            if slot.flow_run_id == run_id:
                slot.run_queue.put_nowait(CheckState(run_id))

    async def _poll_watchdog_loop(self) -> None:
        """While polls fail (Prefect unreachable), Prefect's poll loop backs off up to about
        a minute; poll every ``query_seconds`` instead so runs are picked up as soon as the
        API is back."""
        interval = self.settings.query_seconds
        while True:
            await asyncio.sleep(interval)
            if time.monotonic() - self._last_poll_ok > 2 * interval + 1.0:
                self._poll_now.set()

    async def _poll_now_loop(self) -> None:
        """Poll as soon as a child turns idle or a run is scheduled in the pool."""
        while True:
            await self._poll_now.wait()
            self._poll_now.clear()
            try:
                await self.get_and_submit_flow_runs()
            except Exception as exc:
                self._logger.debug("event-triggered poll failed: %s", exc)

    # ------------------------------------------------------------------ runs

    async def run(
        self,
        flow_run: FlowRun,
        configuration: FaceFlowJobConfiguration,
        task_status: anyio.abc.TaskStatus[int] | None = None,
    ) -> FaceFlowWorkerResult:
        """Run ``flow_run`` in an idle warm child and supervise it until it ends (the
        claim was journalled when it was proposed ``Pending``; it ends here)."""
        try:
            return await self._run(flow_run, configuration, task_status)
        finally:
            self._run_started(str(flow_run.id))  # over: its bookkeeping need not wait
            self._events.forget(str(flow_run.id))
            self._on_start.forget(str(flow_run.id))
            if self._journal is not None:
                self._journal.remove(str(flow_run.id))
            # Prefect frees this run's limiter place right after ``run`` returns, with no
            # await between: poll then, so a run scheduled while this one was finishing
            # (its Scheduled event found no place) starts now, not at the next 1 s poll.
            # Always: left to ``_poll_if_runs_left``, a per-run burst reached 18-19 % of
            # the bare loop instead of 23-26 % (runs waited for the periodic poll).
            asyncio.get_running_loop().call_soon(self._poll_now.set)

    async def _run(
        self,
        flow_run: FlowRun,
        configuration: FaceFlowJobConfiguration,
        task_status: anyio.abc.TaskStatus[int] | None,
    ) -> FaceFlowWorkerResult:
        started = time.time()
        claimed = time.monotonic()
        priority = flow_run.work_queue_name == self.settings.priority_queue
        try:
            slot = await self.pool.acquire(
                str(flow_run.id), self.settings.acquire_timeout_s, priority=priority
            )
            if time.time() - started > ACQUIRE_RECHECK_S:
                if self._events.may_have_stopped(str(flow_run.id), claimed):
                    self.handovers["read"] += 1
                    current = await self._still_wanted(flow_run)
                    if current is None:  # cancelled while it waited for a child
                        await self.pool.release_unused(slot)
                        return FaceFlowWorkerResult(
                            identifier="", status_code=0, outcome="cancelled"
                        )
                    if not self._on_start.still_claimable(current):
                        await self.pool.release_unused(slot)
                        return FaceFlowWorkerResult(
                            identifier="", status_code=0, outcome="not_started"
                        )
                    flow_run = current
                else:
                    self.handovers["unread"] += 1
        except NoChildReady as exc:  # claimed ahead, but no child came free: give it back
            self._prefetch_paused = True  # (and claim nothing ahead until a child is free)
            await self._reschedule(flow_run, f"no warm child became free ({exc})")
            return FaceFlowWorkerResult(identifier="", status_code=0, outcome="rescheduled")
        except BaseException:  # the worker is stopping while the run waits for a child
            with anyio.CancelScope(shield=True):
                await self._reschedule(flow_run, "the worker stopped before a child was free")
            raise
        child = slot.child
        assert child is not None
        if self._journal is not None:
            self._journal.add(str(flow_run.id), child.pid)
        if task_status is not None:
            task_status.started(child.pid)
        claim = self._on_start.hand_over(flow_run, self.name, child.pid)
        request = RunRequest(
            flow_run_id=str(flow_run.id),
            entrypoint=configuration.entrypoint or DEFAULT_ENTRYPOINT,
            working_dir=str(configuration.working_dir) if configuration.working_dir else None,
            env={k: v for k, v in configuration.env.items() if v is not None},
            flow_run_json=flow_run.model_dump_json(),
            claim=claim,
        )
        done = False
        try:
            with contextlib.suppress(OSError):  # a dead child shows up as ChildGone
                child.send(request)
            outcome = await self._supervise_run(slot, flow_run, configuration, started)
            done = True
            return FaceFlowWorkerResult(identifier=str(child.pid), status_code=0, outcome=outcome)
        finally:
            if not done:  # cancelled (worker stopping) or an error while supervising
                with anyio.CancelScope(shield=True):
                    await self.pool.kill_child(slot, "worker stopped during the run")
                    await self._finalize(
                        flow_run,
                        Crashed(
                            message=f"[{LOST_CODE}] The faceflow-gpu worker stopped during the "
                            f"run; child pid {child.pid} was killed."
                        ),
                    )

    async def _supervise_run(
        self, slot: Slot, flow_run: FlowRun, configuration: FaceFlowJobConfiguration, started: float
    ) -> str:
        """Wait for the child's report while enforcing the deadline and cancellation."""
        child = slot.child
        assert child is not None
        kill_at = configuration.kill_at(flow_run, started)
        next_check = time.time() + self.settings.watch_interval_s
        while True:
            now = time.time()
            wait = next_check - now if kill_at is None else min(next_check, kill_at) - now
            message = None
            with contextlib.suppress(TimeoutError):
                message = await asyncio.wait_for(slot.run_queue.get(), timeout=max(wait, 0.0))
            if isinstance(message, RunStarted):
                continue
            if isinstance(message, CheckState):
                next_check = 0.0  # a Cancelling event: read the run's state now
            if isinstance(message, RunFinished):
                return await self._finished(slot, flow_run, message)
            if isinstance(message, ChildGone):
                code = await child.wait_exit(0.5)
                why = _describe_exit(code)
                self.pool.replace(slot, f"child died during a run ({why})")
                await self._finalize(
                    flow_run,
                    Crashed(
                        message=f"[{LOST_CODE}] The faceflow-gpu child (pid {child.pid}) "
                        f"{why} during the run."
                    ),
                )
                return "child_died"
            now = time.time()
            if kill_at is not None and now >= kill_at:
                await self.pool.kill_child(slot, f"deadline of {flow_run.id} passed")
                deadline = datetime.fromtimestamp(
                    kill_at - configuration.deadline_grace_seconds, UTC
                )
                await self._finalize(
                    flow_run,
                    Crashed(
                        message=f"[{DEADLINE_CODE}] The run passed its deadline "
                        f"({deadline.isoformat()} + {configuration.deadline_grace_seconds:g} s "
                        f"grace); the faceflow-gpu worker killed child pid {child.pid}."
                    ),
                )
                return "deadline_exceeded"
            if now >= next_check:
                next_check = now + self.settings.watch_interval_s
                if await self._cancel_if_requested(slot, flow_run):
                    return "cancelled"

    async def _finished(self, slot: Slot, flow_run: FlowRun, message: RunFinished) -> str:
        """The child ended the run (``finished``) or Prefect refused to let it start it
        (``not_started``: another worker's child claimed it first; the run is theirs and
        left as it is). A run cancelled just as it finished (or before it could
        start) is left ``Cancelling``: Prefect refuses a Cancelling run any state but
        Cancelled, so the engine's own end was refused and only the worker can end it."""
        if message.not_started is not None:
            self._on_start.lost_to_another(str(flow_run.id))
            self._logger.info("Flow run %s not started here: %s", flow_run.id, message.not_started)
            if message.not_started.startswith(LATE_CLAIM):  # the run's history shows the claim
                self.get_flow_run_logger(flow_run).info(
                    "Not started by worker %s: %s", self.name, message.not_started
                )
            await self.pool.release(slot)
            return "not_started"
        if message.error is not None:
            self.get_flow_run_logger(flow_run).error(
                "faceflow-gpu child could not run the flow: %s", message.error
            )
            await self._finalize(
                flow_run, Crashed(message=f"The faceflow-gpu child failed: {message.error}")
            )
        elif message.state_type == StateType.CANCELLING.value:
            await self._finalize(
                flow_run,
                Cancelled(message="Cancelled as the faceflow-gpu child ended the run."),
            )
        await self.pool.release(slot)
        return "finished"

    async def _cancel_if_requested(self, slot: Slot, flow_run: FlowRun) -> bool:
        """Kill the child when the run is CANCELLING (or was ended from outside)."""
        try:
            current = await self.client.read_flow_run(flow_run.id)
        except Exception as exc:  # transient API trouble: check again next time
            self._logger.debug("could not read flow run %s: %s", flow_run.id, exc)
            return False
        state = current.state
        if state is None:
            return False
        ended_outside = state.type in (StateType.CANCELLED, StateType.CRASHED)
        if not (state.is_cancelling() or ended_outside):
            return False
        child = slot.child
        assert child is not None
        # SIGKILL at once: on SIGTERM Prefect's engine in the child would record its own
        # "Crashed: termination signal" state, which the relay reads as a lost worker.
        reason = f"{flow_run.id} was {state.type.value.lower()}"
        await self.pool.kill_child(slot, reason, sigterm_first=False)
        if state.is_cancelling():
            await self._finalize(
                flow_run,
                Cancelled(
                    message=f"Cancelled: the faceflow-gpu worker stopped child pid {child.pid}."
                ),
            )
        self.get_flow_run_logger(flow_run).info(
            "Stopped child pid %s: the run is %s.", child.pid, state.type.value
        )
        return True

    async def _still_wanted(self, flow_run: FlowRun) -> FlowRun | None:
        """The run as it is now if it may still start; ``None`` when it was cancelled (or
        otherwise ended) while no child held it.

        Prefect lets a Cancelled run go back to Running (a manual rerun), so a run
        cancelled while it waited for a child would run anyway once the child proposed
        Running: it is read again before a child gets it. A Cancelling run (no process
        holds it) is made Cancelled here."""
        try:
            current = await self.client.read_flow_run(flow_run.id)
        except Exception as exc:  # transient API trouble: run it; the watch still checks
            self._logger.debug("could not read flow run %s: %s", flow_run.id, exc)
            return flow_run
        state = current.state
        if state is None or not (state.is_final() or state.is_cancelling()):
            return current
        if state.is_cancelling():
            await self.client.set_flow_run_state(
                flow_run.id,
                Cancelled(message="Cancelled before a faceflow-gpu child started it."),
                force=True,
            )
        self._logger.info(
            "Flow run %s was %s before a child was free: not started.",
            flow_run.id,
            state.type.value,
        )
        return None

    async def _reschedule(self, flow_run: FlowRun, why: str) -> None:
        """Put a claimed run that never reached a child back to Scheduled for any worker,
        unless it was cancelled (or ended) meanwhile: a forced Scheduled would revive it. A
        run claimed on start was never taken from ``Scheduled``: it is left as it is."""
        if self._on_start.give_back(str(flow_run.id)):
            self._logger.info("Flow run %s left to any worker: %s", flow_run.id, why)
            return
        if await self._still_wanted(flow_run) is None:
            return
        self._logger.warning("Rescheduling flow run %s: %s", flow_run.id, why)
        try:
            state: State[Any] = Scheduled(message=f"Rescheduled by the faceflow-gpu worker: {why}.")
            await self.client.set_flow_run_state(flow_run.id, state, force=True)
        except Exception:
            self._logger.exception("could not reschedule flow run %s", flow_run.id)

    async def _finalize(self, flow_run: FlowRun, state: State[Any]) -> None:
        """Record ``state`` unless the run already reached an outcome of its own, or it
        was claimed on start and another worker's child started it (``_claimed_here``)."""
        try:
            if not await self._claimed_here(flow_run):
                return
            current = await self.client.read_flow_run(flow_run.id)
            if current.state is not None and current.state.type in _KEEP_ON_KILL:
                return
            await self.client.set_flow_run_state(flow_run.id, state, force=True)
        except Exception:
            self._logger.exception("could not set the final state of flow run %s", flow_run.id)

    async def _claimed_here(self, flow_run: FlowRun) -> bool:
        """Whether this worker may end ``flow_run`` (its child died, passed its deadline,
        the worker stopped): a run it claimed with ``Pending``, or one claimed on start that
        its own child started or that nobody started at this run count. Two workers' children
        are handed one run when both claim it on start; the one whose claim Prefect refused
        may die or be killed before it says so, and must not end the run that the other one
        runs. A claim in flight as its child died lands within ``CLAIM_SETTLE_S``: the
        states are read again once after that when they show none."""
        claim = self._on_start.claim_of(str(flow_run.id))
        if claim is None:
            return True
        for settle in (True, False):
            claiming = claiming_state(await self.client.read_flow_run_states(flow_run.id), claim)
            if claiming is not None or not settle:
                break
            await asyncio.sleep(CLAIM_SETTLE_S)
        if claiming is not None and claiming.message != claim.message:
            self._on_start.started_elsewhere(str(flow_run.id))
            self._logger.info(
                "Flow run %s left as it is: another worker's child started it.", flow_run.id
            )
            return False
        return True

    async def kill_infrastructure(
        self,
        infrastructure_pid: str,
        configuration: FaceFlowJobConfiguration,
        grace_seconds: int = 30,
    ) -> None:
        """Kill the child with PID ``infrastructure_pid`` (cancellation before start)."""
        from prefect.exceptions import InfrastructureNotFound

        for slot in self.pool.slots:
            if slot.child is not None and str(slot.child.pid) == str(infrastructure_pid):
                await self.pool.kill_child(slot, "cancelled by Prefect")
                return
        raise InfrastructureNotFound(f"no faceflow-gpu child with pid {infrastructure_pid}")

    # ------------------------------------------------------------------ status

    def status(self) -> dict[str, Any]:
        """Readiness (any child warm), liveness (worker polling) and per-child telemetry."""
        children = self._pool.status() if self._pool else []
        since_poll = (datetime.now(UTC) - self._last_polled_time).total_seconds()
        return {
            "worker": self.name,
            "type": self.type,
            "work_pool": self._work_pool_name,
            "alive": self.is_setup and since_poll < max(30.0, 10 * self.settings.query_seconds),
            "draining": self._draining,
            "ready": any(c["ready"] for c in children),
            "idle": self._pool.idle_count() if self._pool else 0,
            "prefetched": self._pool.waiting if self._pool else 0,
            "claims": dict(self.claims),
            "claims_on_start": self._on_start.made,
            "claims_lost": self._on_start.lost,
            "polls": self.polls,
            "event_connects": self._events.connects,
            "events_live": self._events.live,
            "handovers": dict(self.handovers),
            "last_polled": self._last_polled_time.isoformat(),
            "children": children,
        }

    async def _write_status_loop(self) -> None:
        assert self.settings.status_file is not None
        while True:
            write_status_file(self.settings.status_file, self.status())
            await asyncio.sleep(1.0)


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "stopped answering"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited with code {code}"
