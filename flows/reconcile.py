"""The ``reconcile`` flow: one pass of the webapi relay (fetch, dispatch, sync, expire, reap,
notify).

Scheduled every minute in prefect.yaml as a safety net beside the relay loops that run in
the webapi; an operator can also run it from the UI. It reads the webapi's settings from
the ``FACEFLOW_*`` environment of the worker that runs it. Every relay step takes leases,
so a run overlapping a webapi replica's loops is safe; its input fetches keep the fetch
lane's limits (per-user bound over every replica, each within ``fetch_deadline_seconds``,
at most 40 s: well inside the flow's timeout).

A control-plane flow: it sits above the webapi (imports it), and nothing below imports it
(``tests/test_import_cycles.py`` checks the layers).
"""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact

from webapi.relay.runner import reconcile_once

RECONCILE_FLOW_NAME = "reconcile"


@flow(name=RECONCILE_FLOW_NAME, persist_result=False, retries=0, timeout_seconds=55)
def reconcile() -> dict[str, int]:
    """Run every relay step once, in order; returns how many items each step handled."""
    counts = reconcile_once()
    get_run_logger().info("Reconciled: %s", ", ".join(f"{step}={n}" for step, n in counts.items()))
    create_table_artifact(
        table=[{"step": step, "handled": n} for step, n in counts.items()],
        description="Items each relay step handled in this pass.",
    )
    return counts
