"""Where the time of one ``fuse-faces`` run goes inside the engine (issue 24, deliverable 3).

Starts ``prefect server start`` (own PREFECT_HOME, 127.0.0.1), saves the default blocks,
stores the sample inputs and deploys ``fuse-faces`` into a pool no worker polls. Then, in
this process and with the warm child's engine settings (one long-lived client, no flow-run
heartbeat, logs to the API), it runs ``--jobs`` runs back to back with ``run_flow`` after
one untimed run, the pipeline GPU-shaped (``--gpu-ms``, ``bench/gpu_shaped.py``).

``--ab-stage-task-runs`` alternates, run by run, a settings block whose single runs call
their stages inline (``FusionSettings.stage_task_runs="never"``) and one that gives each
stage a task run (``"always"``), and prints a table for each (``--settle-s 1.2`` lets the
server's batched writes of a run, every second, land inside that run's window).

Like the child, it keeps a plain console handler unless ``--rich-console``. Per run it
records every Prefect API request the run's process makes (offset from the
``run_flow`` call, duration, endpoint; from the run's thread or another), the time spent in
log handlers, the run's state timestamps, and the CPU of this process and of the Prefect
server's processes from the ``run_flow`` call until the next run is created. It prints the
median time table: run_flow call → Running, Running → Completed (the flow function),
Completed → run_flow returns, CPU ms per run (this process, the server), requests per
endpoint (count and ms per run), log handler ms per run. ``--profile`` also
prints cProfile's top functions (cumulative) over the timed runs. Asserts nothing.

    PYTHONPATH=$PWD .venv/bin/python bench/run_profile.py --jobs 10
    PYTHONPATH=$PWD .venv/bin/python bench/run_profile.py --server-db postgresql --profile
    PYTHONPATH=$PWD .venv/bin/python bench/run_profile.py --jobs 20 --server-db postgresql \
        --ab-stage-task-runs --settle-s 1.2
"""

from __future__ import annotations

import argparse
import cProfile
import logging
import os
import pstats
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any
from uuid import UUID

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.fuse_jobs import (  # noqa: E402
    ID_IN_PATH,
    job_parameters,
    pool_template,
    prepare_inputs,
    ts,
)
from faceflow.testing.prefect import (  # noqa: E402
    PrefectRest,
    PrefectServer,
    server_database,
    start_server,
)
from faceflow.testing.procstat import process_tree_cpu_s  # noqa: E402

Request = tuple[float, float, str, bool]
"""(start offset s, duration s, "METHOD /path", made on the run's thread)."""


class Recorder:
    """API requests and log-handler time of the process, since ``reset``."""

    def __init__(self) -> None:
        self.origin = time.perf_counter()
        self.requests: list[Request] = []
        self.handler_s: dict[str, float] = {}
        self.main = threading.get_ident()
        self._lock = threading.Lock()

    def reset(self) -> None:
        with self._lock:
            self.origin, self.requests, self.handler_s = time.perf_counter(), [], {}

    def install(self) -> None:
        """Wrap httpx's sync and async ``send`` and ``logging.Handler.handle``."""
        recorder = self
        sync_send, async_send = httpx.Client.send, httpx.AsyncClient.send
        handle = logging.Handler.handle

        def path(request: httpx.Request) -> str:
            return f"{request.method} {ID_IN_PATH.sub('{id}', request.url.path)}"

        def record(request: httpx.Request, start: float) -> None:
            end = time.perf_counter()
            with recorder._lock:
                recorder.requests.append(
                    (
                        start - recorder.origin,
                        end - start,
                        path(request),
                        threading.get_ident() == recorder.main,
                    )
                )

        def send(self: httpx.Client, request: httpx.Request, **kw: Any) -> httpx.Response:
            start = time.perf_counter()
            try:
                return sync_send(self, request, **kw)
            finally:
                record(request, start)

        async def asend(self: httpx.AsyncClient, request: httpx.Request, **kw: Any) -> Any:
            start = time.perf_counter()
            try:
                return await async_send(self, request, **kw)
            finally:
                record(request, start)

        def timed_handle(self: logging.Handler, rec: logging.LogRecord) -> bool:
            start = time.perf_counter()
            try:
                return handle(self, rec)
            finally:
                name = type(self).__name__
                with recorder._lock:
                    recorder.handler_s[name] = recorder.handler_s.get(name, 0.0) + (
                        time.perf_counter() - start
                    )

        httpx.Client.send = send  # type: ignore[method-assign]
        httpx.AsyncClient.send = asend  # type: ignore[method-assign,assignment]
        logging.Handler.handle = timed_handle  # type: ignore[method-assign,assignment]


STAGE_MODES = {"inline": "never", "task runs": "always"}
"""``--ab-stage-task-runs``: each table's ``FusionSettings.stage_task_runs``."""


def stage_mode_blocks(url: str) -> dict[str, str]:
    """Per ``STAGE_MODES`` entry, a saved settings block as ``prepare_inputs``'s GPU-shaped
    default but for ``stage_task_runs``; its block name."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from blocks.settings import FusionSettings

    names = {}
    with temporary_settings(updates={PREFECT_API_URL: url}):
        for mode, value in STAGE_MODES.items():
            name = f"bench-stages-{value}"
            FusionSettings(model_threads=1, stage_task_runs=value).save(name, overwrite=True)
            names[mode] = f"fusion-settings/{name}"
    return names


def profile_runs(
    server: PrefectServer, api: PrefectRest, inputs: tuple[str, str, bytes, bytes], args: Any
) -> None:
    """Run and time ``args.jobs`` runs in this process; print the table."""
    url = server.api_url
    from prefect.context import SyncClientContext
    from prefect.flow_engine import run_flow
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
        temporary_settings,
    )

    from bench import gpu_shaped
    from faceflow.worker.child import plain_console
    from faceflow.worker.suspension import install_shared_observer
    from flows.fuse import fuse_faces

    gpu_shaped.install(args.gpu_ms)
    api.create_pool("bench-profile", "process", pool_template("process"))
    deployment_id = api.deploy("fuse-faces", "flows/fuse.py:fuse_faces", "bench-profile")
    recorder = Recorder()
    recorder.install()
    rows: list[dict[str, Any]] = []
    profiler = cProfile.Profile() if args.profile else None
    blocks = stage_mode_blocks(url) if args.ab_stage_task_runs else {}
    updates = {PREFECT_API_URL: url, PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}
    with temporary_settings(updates=updates), SyncClientContext.get_or_create() as ctx:
        install_shared_observer()  # as the warm child does
        rich = handlers_now()
        plain = rich
        if not args.rich_console:
            plain_console()
            plain = handlers_now()
        for i in range(args.jobs + 2):
            console = "rich" if args.ab_console and i % 2 else "plain"
            restore(rich if console == "rich" or args.rich_console else plain)
            stages = sorted(blocks)[i % 2] if blocks else "settings block"
            settings = {"settings_block": blocks[stages]} if blocks else {}
            run_id = api.create_run(deployment_id, job_parameters(*inputs[:2], **settings))
            flow_run = ctx.client.read_flow_run(UUID(run_id))
            time.sleep(0.3)  # the last run's background writes settle
            recorder.reset()
            cpu, server_cpu = time.process_time(), process_tree_cpu_s(server.pids)
            called = time.time()
            if profiler is not None and i:
                profiler.enable()
            state = run_flow(fuse_faces, flow_run=flow_run, return_type="state")
            if profiler is not None and i:
                profiler.disable()
            returned = time.time()
            time.sleep(args.settle_s)
            cpu = time.process_time() - cpu
            server_cpu = process_tree_cpu_s(server.pids) - server_cpu
            if i < 2:  # one untimed run of each kind
                continue
            run = api.run(run_id)
            assert state.is_completed(), state  # type: ignore[union-attr]
            start, end = ts(run["start_time"]), ts(run["end_time"])
            rows.append(
                {
                    "call_to_running_ms": (start - called) * 1e3,
                    "flow_ms": (end - start) * 1e3,
                    "completed_to_return_ms": (returned - end) * 1e3,
                    "run_flow_ms": (returned - called) * 1e3,
                    "requests": list(recorder.requests),
                    "handlers": dict(recorder.handler_s),
                    "returned_s": returned - called,
                    "console": "rich" if args.rich_console else console,
                    "stages": stages,
                    "cpu_ms": cpu * 1e3,
                    "server_cpu_ms": server_cpu * 1e3,
                }
            )
    for console in sorted({r["console"] for r in rows}):
        for stages in sorted({r["stages"] for r in rows}):
            print(f"console handler: {console}; stages: {stages}")
            print_table([r for r in rows if r["console"] == console and r["stages"] == stages])
    if profiler is not None:
        stats = pstats.Stats(profiler)
        stats.sort_stats("cumulative").print_stats(args.profile_lines)
        stats.sort_stats("tottime").print_stats(args.profile_lines)


def handlers_now() -> dict[logging.Logger, list[logging.Handler]]:
    """Every logger's handlers now (the root's included)."""
    loggers = [logging.getLogger()] + [
        lg
        for lg in list(logging.Logger.manager.loggerDict.values())
        if isinstance(lg, logging.Logger)
    ]
    return {lg: list(lg.handlers) for lg in loggers}


def restore(handlers: dict[logging.Logger, list[logging.Handler]]) -> None:
    """Give each logger the handlers of ``handlers_now``'s snapshot."""
    for logger, saved in handlers.items():
        logger.handlers = list(saved)


def print_table(rows: list[dict[str, Any]]) -> None:
    """Medians of the spans, then per endpoint, then per log handler."""
    n = len(rows)
    print(f"one fuse-faces run in this process, median of {n} (ms)")
    spans = ("call_to_running_ms", "flow_ms", "completed_to_return_ms", "run_flow_ms")
    for span in (*spans, "cpu_ms", "server_cpu_ms"):
        print(f"  {span:28} {statistics.median(r[span] for r in rows):8.1f}")
    Key = tuple[str, bool, bool]
    run_totals: list[dict[Key, float]] = []
    counts: dict[Key, int] = {}
    for r in rows:
        totals: dict[Key, float] = {}
        for start, dur, endpoint, main in r["requests"]:
            key = (endpoint, main, start <= r["returned_s"])
            totals[key] = totals.get(key, 0.0) + dur * 1e3
            counts[key] = counts.get(key, 0) + 1
        run_totals.append(totals)
    per = {key: [t.get(key, 0.0) for t in run_totals] for key in counts}
    print("  API requests per run: count, total ms (median), thread, before run_flow returned")
    ordered = sorted(per.items(), key=lambda kv: -statistics.median(kv[1]))
    for (endpoint, main, before), values in ordered:
        thread = "run" if main else "other"
        when = "before" if before else "after"
        print(
            f"    {counts[(endpoint, main, before)] / n:5.1f} {statistics.median(values):7.1f}"
            f"  {thread:5} {when:6} {endpoint}"
        )
    handlers = sorted({h for r in rows for h in r["handlers"]})
    print("  log handlers, ms per run (median, any thread)")
    for h in handlers:
        print(f"    {statistics.median(r['handlers'].get(h, 0.0) * 1e3 for r in rows):7.1f}  {h}")
    first = rows[-1]
    print("  the last run's requests (offset ms, duration ms, thread, endpoint):")
    for start, dur, endpoint, main in sorted(first["requests"]):
        print(f"    {start * 1e3:7.1f} {dur * 1e3:6.1f}  {'run' if main else 'other':5} {endpoint}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=10)
    parser.add_argument("--gpu-ms", type=float, default=30.0)
    parser.add_argument("--server-db", choices=["sqlite", "postgresql"], default="sqlite")
    parser.add_argument(
        "--rich-console",
        action="store_true",
        help="keep Prefect's rich console handler (FACEFLOW_WORKER_RICH_CONSOLE=true)",
    )
    parser.add_argument(
        "--ab-console",
        action="store_true",
        help="alternate the rich and the plain console handler run by run; a table for each",
    )
    parser.add_argument(
        "--ab-stage-task-runs",
        action="store_true",
        help="alternate stages inline and as task runs (stage_task_runs) run by run; a table "
        "for each",
    )
    parser.add_argument(
        "--settle-s",
        type=float,
        default=0.3,
        help="pause after each run, inside its CPU window (the server writes every second)",
    )
    parser.add_argument("--profile", action="store_true", help="print cProfile's top functions")
    parser.add_argument("--profile-lines", type=int, default=40)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="faceflow-profile-") as tmp:
        home = Path(tmp)
        with server_database(args.server_db) as database_env:
            server = start_server(home, database_env)
            try:
                api = PrefectRest(server.api_url)
                inputs = prepare_inputs(server.api_url, home / "faceflow", gpu_shaped=True)
                profile_runs(server, api, inputs, args)
            finally:
                server.stop(grace=10)


if __name__ == "__main__":
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    main()
