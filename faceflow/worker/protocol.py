"""Messages between the worker (parent) and its warm children, sent over a
``multiprocessing`` pipe. Plain picklable dataclasses; no Prefect or torch types."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from faceflow.worker.memory import HEAP_KEEP_MB


@dataclass(frozen=True)
class ChildSpec:
    """How to start and warm one child."""

    index: int
    env: dict[str, str] = field(default_factory=dict)
    detector: str = "mtcnn"
    fuser: str = "classic"
    model_dir: str | None = None
    preload: tuple[str, ...] = ()
    working_dir: str | None = None
    flow_heartbeats: bool = False
    shared_suspension_observer: bool = True
    lean_run_start: bool = True
    rich_console: bool = False
    heap_keep_mb: float = HEAP_KEEP_MB


@dataclass(frozen=True)
class Telemetry:
    """What a child reports about itself after warm-up and after every run."""

    pid: int
    runs_done: int
    model_loads: dict[str, int]
    rss_mb: float
    gpu: dict[str, Any]


# ---------------------------------------------------------------- parent → child


@dataclass(frozen=True)
class RunClaim:
    """The run is claimed by the child's ``Running`` proposal, not by a ``Pending`` state
    before it (``WorkerSettings.claim_on_start``). Prefect rejects a ``Running`` proposal
    whose ``transition_id`` is that of the run's current state, so two workers that propose
    the same id cannot both start the run; ``message`` (the ``Running`` state's message)
    tells the claimant whether the ``Running`` it is answered with is its own."""

    transition_id: str
    message: str


@dataclass(frozen=True)
class RunRequest:
    """Run the existing flow run ``flow_run_id`` from ``entrypoint`` through Prefect's engine.

    ``flow_run_json``: the flow run as the worker claimed it (Prefect's ``FlowRun`` as JSON),
    so the child need not read it again (one API request per run fewer); None: the child
    reads it. ``claim``: set when the child's ``Running`` proposal is the claim."""

    flow_run_id: str
    entrypoint: str
    working_dir: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    flow_run_json: str | None = None
    claim: RunClaim | None = None


@dataclass(frozen=True)
class Shutdown:
    """Exit after the current message (the parent only sends it between runs)."""


# ---------------------------------------------------------------- child → parent


@dataclass(frozen=True)
class Ready:
    """Models loaded and the warm-up inference passed."""

    device: str
    warmup_ms: float
    startup_ms: float
    telemetry: Telemetry


@dataclass(frozen=True)
class WarmupFailed:
    """The child could not warm up; it exits after sending this."""

    error: str


@dataclass(frozen=True)
class RunStarted:
    """The flow is loaded and ``run_flow`` is about to be called."""

    flow_run_id: str
    load_ms: float


@dataclass(frozen=True)
class RunFinished:
    """``run_flow`` returned (or raised) for ``flow_run_id``."""

    flow_run_id: str
    state_type: str | None
    state_message: str | None
    run_ms: float
    telemetry: Telemetry
    error: str | None = None
    not_started: str | None = None
    """Why the run was not started: Prefect aborted its ``Running`` (another claimed it)."""


ToChild = RunRequest | Shutdown
FromChild = Ready | WarmupFailed | RunStarted | RunFinished
