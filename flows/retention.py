"""The ``retention`` flow: delete expired inputs, results and job rows (``webapi.retention``).

Scheduled every five minutes in prefect.yaml on the control pool; an operator can also run
it from the UI. It reads the webapi's settings (job store, storage, retention times) from
the ``FACEFLOW_*`` environment of the worker that runs it. Passes are safe to overlap with
the API and the relay: input deletions hold the admission lock, and only jobs that have
ended are touched.

A control-plane flow: it sits above the webapi (imports it), and nothing below imports it
(``tests/test_import_cycles.py`` checks the layers).
"""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact

from webapi.retention import run_pass_from_settings

RETENTION_FLOW_NAME = "retention"


@flow(name=RETENTION_FLOW_NAME, persist_result=False, retries=0, timeout_seconds=1800)
def retention() -> dict[str, float]:
    """Run one retention pass; returns what it deleted and how long it took."""
    report = run_pass_from_settings().as_dict()
    get_run_logger().info(
        "Retention pass: %s", ", ".join(f"{name}={value:g}" for name, value in report.items())
    )
    create_table_artifact(
        table=[{"item": name, "value": value} for name, value in report.items()],
        description="What this retention pass deleted.",
    )
    return report
