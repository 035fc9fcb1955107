"""A single job's way from its run's creation to its end, hop by hop (bench only).

Installed by ``bench/gpu_shaped_site/sitecustomize.py`` when ``FACEFLOW_BENCH_TRACE`` names
a file, in every process that has that folder on its path: it wraps the relay's creation
of a run (webapi), the worker's and the child's steps and Prefect's flow engine steps, and
appends one JSON line per step (``run``, ``mark``, ``t``: epoch seconds, comparable across
the processes) to that file. Nothing of it runs outside the bench. Set both for the bench
itself, which hands its environment to the webapi and the worker; read the file with
``report`` (``main``), with the job store beside it for the job's creation and end:

    BENCH_KEEP_DIR=/tmp/keep FACEFLOW_BENCH_TRACE=/tmp/keep/trace.jsonl \
        PYTHONPATH=$PWD:$PWD/bench/gpu_shaped_site .venv/bin/python bench/warm_worker.py \
        --modes per-job --gpu-ms 30 --jobs 20 --server-db postgresql --no-in-process
    PYTHONPATH=$PWD .venv/bin/python bench/dispatch_trace.py /tmp/keep/trace.jsonl \
        /tmp/keep/jobs-per-job.db

The table has the median of each step over the jobs run one after another (ms after the
job's creation, and the step's own length). With ``--runs`` (a batched burst: ``--modes
batched``) it has one row per run instead, in the order the child ran them: its jobs, its
way from creation to the flow's first line, its body, and the hand-over from the previous
run's body end to this one's first line, step by step (where a burst loses time between
two batch runs).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sqlite3
import statistics
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

_PATH = os.environ.get("FACEFLOW_BENCH_TRACE", "")
_CURRENT: dict[str, str] = {}  # the child's run now (one run at a time)

# The steps in order: (mark, what it is)
STEPS: list[tuple[str, str]] = [
    ("job_created", "job row created (POST /v1/jobs)"),
    ("relay_create_called", "relay calls create_flow_run"),
    ("run_created", "run created on the server (its Scheduled event's time)"),
    ("event_at_worker", "Scheduled event reaches the worker"),
    ("relay_create_returned", "relay has the created run"),
    ("run_read", "worker has read the run (submission starts)"),
    ("submit_started", "worker's submission of the run starts"),
    ("configured", "worker has the run's job configuration"),
    ("pending_proposed", "worker proposes Pending"),
    ("pending_accepted", "Pending accepted"),
    ("sent_to_child", "worker sends the run to the child"),
    ("child_got", "child has the request"),
    ("run_flow_called", "child calls run_flow"),
    ("engine_patch_done", "engine's PATCH of the run done"),
    ("running_proposed", "engine proposes Running"),
    ("claim_sent", "the claim's Running sent"),
    ("claim_answered", "the claim's Running answered"),
    ("running_accepted", "Running accepted (a claim: and the run's states read)"),
    ("flow_first_line", "flow function called (run context set up)"),
    ("body_end", "flow body returned"),
    ("completed_accepted", "Completed accepted"),
    ("hooks_done", "state hooks done (the run's final artifacts)"),
    ("run_flow_returned", "run_flow returned"),
    ("worker_finished", "worker has the child's report"),
    ("job_finished", "job row finished"),
]


def mark(run: str, name: str, t: float | None = None) -> None:
    """Append one step of ``run`` to the trace file."""
    line = json.dumps({"run": run, "mark": name, "t": time.time() if t is None else t})
    fd = os.open(_PATH, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def _wrap(owner: Any, attr: str, before: Callable[..., None] | None, after: Any = None) -> None:
    original = getattr(owner, attr)
    if getattr(original, "_traced", False):
        return
    if _is_coroutine(original):

        @functools.wraps(original)
        async def awrapper(*args: Any, **kwargs: Any) -> Any:
            if before is not None:
                before(*args, **kwargs)
            result = await original(*args, **kwargs)
            if after is not None:
                after(result, *args, **kwargs)
            return result

        awrapper._traced = True  # type: ignore[attr-defined]
        setattr(owner, attr, awrapper)
        return

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if before is not None:
            before(*args, **kwargs)
        result = original(*args, **kwargs)
        if after is not None:
            after(result, *args, **kwargs)
        return result

    wrapper._traced = True  # type: ignore[attr-defined]
    setattr(owner, attr, wrapper)


def _is_coroutine(fn: Any) -> bool:
    import inspect

    return inspect.iscoroutinefunction(fn)


def _current(name: str) -> Callable[..., None]:
    def record(*_args: Any, **_kwargs: Any) -> None:
        if "run" in _CURRENT:
            mark(_CURRENT["run"], name)

    return record


def install_worker() -> None:
    """Wrap the worker's steps (called at its import)."""
    from faceflow.worker import pool, worker
    from faceflow.worker.protocol import RunRequest

    cls = worker.FaceFlowGpuWorker

    def on_event(_self: Any, event: Any) -> None:
        run = event.resource.id.removeprefix("prefect.flow-run.")
        mark(run, "run_created", event.occurred.timestamp())
        mark(run, "event_at_worker")

    def on_submit(_self: Any, *args: Any, **kwargs: Any) -> None:
        for r in args[0] if args else kwargs["flow_run_response"]:
            mark(str(r.flow_run.id), "run_read")

    _wrap(cls, "_claim_announced", on_event)
    _wrap(cls, "_submit_scheduled_flow_runs", on_submit)
    _wrap(cls, "_submit_run", lambda _s, fr, *_a, **_k: mark(str(fr.id), "submit_started"))
    _wrap(
        cls,
        "run",
        lambda _s, *a, **k: mark(str((a[0] if a else k["flow_run"]).id), "configured"),
    )
    _wrap(
        cls,
        "_propose_pending_state",
        lambda _s, fr, **_k: mark(str(fr.id), "pending_proposed"),
        lambda ok, _s, fr, **_k: mark(str(fr.id), "pending_accepted") if ok else None,
    )
    _wrap(cls, "_finished", lambda _s, _slot, fr, *_a, **_k: mark(str(fr.id), "worker_finished"))
    _wrap(
        pool.ChildProcess,
        "send",
        lambda _s, m: mark(m.flow_run_id, "sent_to_child") if isinstance(m, RunRequest) else None,
    )


def install_child() -> None:
    """Wrap the child's and the flow engine's steps (called at the child's import)."""
    import sys

    import prefect.flow_engine as engine
    from prefect.client.orchestration import SyncPrefectClient

    def on_run(_self: Any, request: Any, _client: Any) -> None:
        _CURRENT["run"] = request.flow_run_id
        mark(request.flow_run_id, "child_got")

    child = sys.modules.get("__main__")
    if child is not None and hasattr(child, "WarmChild"):  # python -m faceflow.worker.child
        _wrap(child.WarmChild, "run", on_run)
    _wrap(engine, "run_flow", _current("run_flow_called"), _current("run_flow_returned"))
    _wrap(SyncPrefectClient, "update_flow_run", None, _current("engine_patch_done"))
    _wrap(
        engine.FlowRunEngine,
        "begin_run",
        _current("running_proposed"),
        _current("running_accepted"),
    )
    from faceflow.worker import run_start

    _wrap(run_start, "propose_shared", _current("claim_sent"), _current("claim_answered"))
    _wrap(engine.FlowRunEngine, "call_flow_fn", _current("flow_first_line"))
    _wrap(engine.FlowRunEngine, "handle_success", _current("body_end"), _current("hooks_done"))
    completed = _current("completed_accepted")
    _wrap(
        engine,
        "propose_state_sync",
        None,
        lambda state, *_a, **_k: completed() if state.is_completed() else None,
    )


def install_relay() -> None:
    """Wrap the relay's creation of a run (called at the webapi's import of its client)."""
    from webapi.prefect_api import PrefectAPI

    original = PrefectAPI.create_flow_run
    if getattr(original, "_traced", False):
        return

    @functools.wraps(original)
    def create(*args: Any, **kwargs: Any) -> Any:
        called = time.time()
        run = original(*args, **kwargs)
        mark(str(run.id), "relay_create_called", called)
        mark(str(run.id), "relay_create_returned")
        return run

    create._traced = True  # type: ignore[attr-defined]
    PrefectAPI.create_flow_run = create  # type: ignore[method-assign]


def install() -> None:
    """Install the wrappers that fit this process (worker, child or webapi), once imported."""
    _after_import("webapi.prefect_api", install_relay)
    _after_import("faceflow.worker.worker", install_worker)
    _after_import("prefect.flow_engine", install_child)


def _after_import(module: str, then: Callable[[], None]) -> None:
    """Run ``then`` once ``module`` is imported (now if it is)."""
    import importlib.abc
    import sys

    if module in sys.modules:
        then()
        return

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
            if name != module:
                return None
            sys.meta_path.remove(self)
            import importlib.util

            spec = importlib.util.find_spec(name)
            if spec is None or spec.loader is None:
                return spec
            exec_module = spec.loader.exec_module

            def exec_then(mod: Any) -> None:
                exec_module(mod)
                then()

            spec.loader.exec_module = exec_then  # type: ignore[method-assign,assignment]
            return spec

    sys.meta_path.insert(0, Finder())


def _epoch(text: str) -> float:
    value = datetime.fromisoformat(text.replace("Z", "+00:00"))
    if value.tzinfo is None:
        from datetime import UTC

        value = value.replace(tzinfo=UTC)
    return value.timestamp()


def _read_marks(trace: str) -> dict[str, dict[str, float]]:
    """Each run's marks (the first time of each) from the trace file."""
    marks: dict[str, dict[str, float]] = {}
    with open(trace) as fh:
        for line in fh:
            item = json.loads(line)
            marks.setdefault(item["run"], {}).setdefault(item["mark"], item["t"])
    return marks


def _run_id(flow_run_id: object) -> str:
    """The job store's flow-run id as the trace writes it (a UUID with dashes)."""
    run = str(flow_run_id)
    if len(run) == 32:
        run = f"{run[:8]}-{run[8:12]}-{run[12:16]}-{run[16:20]}-{run[20:]}"
    return run


def report(trace: str, jobs_db: str) -> list[tuple[str, float, float]]:
    """Median ms after the job's creation and median step length, per step, over the jobs
    that ran one after another (created after the previous job finished)."""
    marks = _read_marks(trace)
    con = sqlite3.connect(jobs_db)
    rows = con.execute(
        "select flow_run_id, created_at, finished_at from jobs order by created_at"
    ).fetchall()
    previous_end = 0.0
    runs: list[dict[str, float]] = []
    for flow_run_id, created, finished in rows:
        if flow_run_id is None or finished is None:
            continue
        c, f = _epoch(created), _epoch(finished)
        run = _run_id(flow_run_id)
        if c > previous_end and run in marks:
            steps = dict(marks[run], job_created=c, job_finished=f)
            runs.append(steps)
        previous_end = max(previous_end, f)
    table: list[tuple[str, float, float]] = []
    previous = "job_created"
    for name, _what in STEPS:
        at = [r[name] - r["job_created"] for r in runs if name in r]
        step = [r[name] - r[previous] for r in runs if name in r and previous in r]
        if at:
            table.append((name, statistics.median(at) * 1e3, statistics.median(step) * 1e3))
            previous = name
    print(f"{len(runs)} jobs one after another")
    return table


# A hand-over between two runs of a child: the previous run's steps, then this run's.
HANDOVER_BEFORE = ["body_end", "completed_accepted", "hooks_done", "worker_finished"]
HANDOVER_AFTER = ["sent_to_child", "engine_patch_done", "running_accepted", "flow_first_line"]


def run_rows(trace: str, jobs_db: str) -> list[dict[str, Any]]:
    """One row per traced run that a child ran, in the order it got them: its jobs, ms
    from its creation to its first line, its body's ms, and each hand-over step's ms
    (from the previous run's body end; none for the first run)."""
    marks = _read_marks(trace)
    con = sqlite3.connect(jobs_db)
    jobs: dict[str, int] = {}
    for (flow_run_id,) in con.execute("select flow_run_id from jobs where flow_run_id is not null"):
        run = _run_id(flow_run_id)
        jobs[run] = jobs.get(run, 0) + 1
    ran = sorted(
        (m for m in marks.items() if "sent_to_child" in m[1] and "body_end" in m[1]),
        key=lambda item: item[1]["sent_to_child"],
    )
    rows: list[dict[str, Any]] = []
    previous: dict[str, float] | None = None
    for run, m in ran:
        row: dict[str, Any] = {"run": run[:8], "jobs": jobs.get(run, 0)}
        row["start_ms"] = (m["flow_first_line"] - m.get("run_created", m["sent_to_child"])) * 1e3
        row["body_ms"] = (m["body_end"] - m["flow_first_line"]) * 1e3
        if previous is not None:
            steps = [previous.get(k) for k in HANDOVER_BEFORE] + [m.get(k) for k in HANDOVER_AFTER]
            names = HANDOVER_BEFORE + HANDOVER_AFTER
            for i in range(1, len(names)):
                if steps[i - 1] is not None and steps[i] is not None:
                    row[names[i]] = (steps[i] - steps[i - 1]) * 1e3  # type: ignore[operator]
            row["handover_ms"] = (m["flow_first_line"] - previous["body_end"]) * 1e3
        rows.append(row)
        previous = m
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("trace")
    parser.add_argument("jobs_db")
    parser.add_argument("--runs", action="store_true", help="one row per run (batched bursts)")
    args = parser.parse_args()
    if args.runs:
        names = ["jobs", "start_ms", "body_ms", *HANDOVER_BEFORE[1:], *HANDOVER_AFTER]
        print("| run | " + " | ".join([*names, "handover_ms"]) + " |")
        print("|---" * (len(names) + 2) + "|")
        for row in run_rows(args.trace, args.jobs_db):
            cells = [f"{row[n]:.0f}" if n in row else "" for n in [*names, "handover_ms"]]
            print(f"| {row['run']} | " + " | ".join(cells) + " |")
        return
    what = dict(STEPS)
    table = report(args.trace, args.jobs_db)
    print("| step | ms after job created | step ms |\n|---|---|---|")
    for name, at, step in table:
        print(f"| {what[name]} | {at:.0f} | {step:.0f} |")


if __name__ == "__main__":
    main()
