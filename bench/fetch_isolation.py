"""Another user's job end to end while one user's input URLs hang (issue 22, item 3).

Everything on loopback: a real Prefect server (``prefect server start``), the real relay
(its threads, production timings, a SQLite job store), a stand-in worker that executes
each flow run in-process as soon as the relay has created it (the stand-in
``fuse-faces`` flow of ``faceflow/testing/relay.py``: it writes a small result), and
a tarpit that answers every GET with a 200 and then one body byte a second.

User B's job (inputs stored at submit) is timed from submit (as the API does it, then
the relay is woken) to ``succeeded`` in the job store, one at a time, in ``rounds``
rounds (interleaved, so that the shared machine's load weighs on both alike) of:

1. ``runs`` jobs with nothing else queued (normal);
2. ``runs`` jobs while ``tarpit_jobs`` jobs of user A, whose source is a tarpit URL, are
   pending: submitted first (queue timeout 600 s, deadline 900 s), their fetches in flight throughout;
   then A's jobs are cancelled (which cuts their fetches).

Prints each job's time and the medians. One web-API relay, one job per flow run
(``batch_max_jobs=1``: the stand-in worker runs ``fuse-faces`` only).

    PYTHONPATH=$PWD .venv/bin/python bench/fetch_isolation.py --rounds 4 --runs 5
"""

from __future__ import annotations

import argparse
import contextvars
import os
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from sqlmodel import Session, col, select

from faceflow.testing.jobs import make_user
from faceflow.testing.relay import (
    SCRIPT,
    execute_run,
    stand_in_server,
    submit,
    tarpit,
)
from webapi import crud
from webapi.config import Settings
from webapi.db import get_engine, read_only
from webapi.migrations import upgrade
from webapi.models import Job, JobStatus
from webapi.relay.context import Relay
from webapi.relay.runner import RelayRunner, build_relay
from webapi.storage import LocalObjectStore


class StandInWorker:
    """Executes each job's flow run as soon as the relay has created it (polls 20 ms)."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.done: set[uuid.UUID] = set()
        self._stop = threading.Event()
        context = contextvars.copy_context()
        self.thread = threading.Thread(target=lambda: context.run(self._run), daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            with Session(read_only(self.relay.engine)) as session:
                runs = session.exec(
                    select(Job.flow_run_id).where(
                        col(Job.status) == JobStatus.queued, col(Job.flow_run_id).is_not(None)
                    )
                ).all()
            for run_id in runs:
                if run_id is not None and run_id not in self.done:
                    self.done.add(run_id)
                    execute_run(str(run_id))

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(30)


def status_of(relay: Relay, job_id: uuid.UUID) -> JobStatus:
    with Session(read_only(relay.engine)) as session:
        found = session.get(Job, job_id)
        assert found is not None
        return found.status


def end_to_end(relay: Relay, runner: RelayRunner, owner: crud.NewUser, timeout_s: float) -> str:
    """Submit one job of ``owner`` and wait for it to end; its seconds, or its status."""
    started = time.monotonic()
    job_id = submit(relay.engine, relay.settings, relay.store, owner).id
    runner.wake()
    while time.monotonic() - started < timeout_s:
        status = status_of(relay, job_id)
        if status.is_terminal:
            took = time.monotonic() - started
            return f"{took:.3f}" if status is JobStatus.succeeded else status.value
        time.sleep(0.01)
    return "timeout"


def phase(name: str, runs: int, one: Callable[[], str]) -> list[float]:
    results = [one() for _ in range(runs)]
    print(f"{name}: {' '.join(results)}", flush=True)
    return [float(r) for r in results if r.replace(".", "", 1).isdigit()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--runs", type=int, default=5, help="jobs of B per phase")
    parser.add_argument("--tarpit-jobs", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=90.0, help="per job of B (s)")
    args = parser.parse_args()
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")  # not a line per flow run
    with tempfile.TemporaryDirectory(prefix="fetch-bench-") as tmp:
        home = Path(tmp)
        database_url = f"sqlite:///{home / 'webapi.db'}"
        upgrade(database_url)
        settings = Settings.model_validate(
            {
                "home": home,
                "database_url": database_url,
                "storage_url": (home / "storage").as_uri(),
                "allow_private_urls": True,
                "run_relay": False,
                "batch_max_jobs": 1,
            }
        )
        (home / "prefect").mkdir()
        with stand_in_server(home / "prefect") as server, tarpit(interval_s=1.0) as slow:
            settings = settings.model_copy(update={"prefect_api_url": server.api_url})
            store = LocalObjectStore(home / "storage")
            SCRIPT.storage_dir = store.basepath
            engine = get_engine(database_url)
            relay = build_relay(settings, engine=engine, store=store)
            a = make_user(engine, settings, quota=1000)
            b = make_user(engine, settings, quota=1000)
            runner = RelayRunner(relay)
            runner.start()
            worker = StandInWorker(relay)
            normal: list[float] = []
            loaded: list[float] = []
            one = lambda: end_to_end(relay, runner, b, args.timeout)  # noqa: E731
            try:
                one()  # warm-up, untimed
                for round_ in range(1, args.rounds + 1):
                    normal += phase(f"round {round_}: normal", args.runs, one)
                    hung = [
                        submit(
                            engine,
                            settings,
                            store,
                            a,
                            source_url=f"{slow.url}/{round_}-{i}.jpg",
                            deadline_seconds=900,
                            queue_timeout_seconds=600,
                        ).id
                        for i in range(args.tarpit_jobs)
                    ]
                    runner.wake()
                    while slow.open == 0:
                        time.sleep(0.01)
                    name = f"round {round_}: {args.tarpit_jobs} tarpit jobs pending"
                    loaded += phase(name, args.runs, one)
                    states = [status_of(relay, j).value for j in hung]
                    print(f"  A's jobs: {states}; tarpit connections open: {slow.open}")
                    for job_id in hung:
                        if not status_of(relay, job_id).is_terminal:
                            with Session(engine, expire_on_commit=False) as session:
                                crud.cancel_job(session, owner=a.user, job_id=job_id)
                    while slow.open:
                        time.sleep(0.01)
                print(f"tarpit: at most {slow.peak} connections at once", flush=True)
            finally:
                worker.stop()
                runner.stop()
        if normal and loaded:
            base, with_tarpit = statistics.median(normal), statistics.median(loaded)
            print(
                f"median end to end: normal {base:.3f} s, with tarpit jobs {with_tarpit:.3f} s "
                f"({with_tarpit - base:+.3f} s)"
            )


if __name__ == "__main__":
    main()
