"""A flow whose module takes a while to import: a warm child that has not loaded it yet
holds a run it was handed for that long before its engine proposes ``Running``, which
opens the window between the worker's read of a ``Scheduled`` run and its child's claim
(``tests/worker/test_claim_on_start.py``). Its body waits, then adds a line to a file
named for the run (one line per start)."""

from __future__ import annotations

import time
from pathlib import Path

from prefect import flow

IMPORT_S = 2.0
time.sleep(IMPORT_S)


@flow(name="slow-start-probe", persist_result=False)
def slow_start_probe(out_dir: str, body_s: float = 6.0) -> None:
    from prefect.runtime import flow_run

    time.sleep(body_s)
    with Path(out_dir, f"{flow_run.id}.done").open("a") as done:  # a line per start
        done.write("ran to the end\n")
