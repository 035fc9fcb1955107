"""What creating one job's flow run costs the Prefect server, with the deployment's
parameter-schema check (``prefect deploy`` turns ``enforce_parameter_schema`` on) and
without it (the relay's client asks the server to skip it: ``webapi.prefect_api``).

A Prefect server on PostgreSQL (as the stack runs it), one ``fuse-faces`` deployment with
the flow's real parameter schema, enforced, in a ``faceflow-gpu`` pool with its base job
template (the server checks each run's job variables against it) that no worker polls; runs
created by ``PrefectAPI.create_flow_run`` (the relay's own call), alternating with the same
body sent with the check, one request at a time. Per arm: the request's median and
p90 wall time and the server's CPU per create. Nothing else talks to the server.

    PYTHONPATH=$PWD .venv/bin/python bench/run_create.py --runs 60
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.fuse_jobs import pool_template  # noqa: E402
from faceflow.testing.prefect import server_database, start_server  # noqa: E402
from faceflow.testing.procstat import process_tree_cpu_s, wait_until_quiet  # noqa: E402
from flows.params import DEPLOYMENT_NAME, FLOW_NAME, FuseFacesParams  # noqa: E402
from webapi.prefect_api import PrefectAPI, flow_run_body  # noqa: E402


def _params() -> FuseFacesParams:
    return FuseFacesParams(
        job_id=str(uuid.uuid4()),
        owner_id=str(uuid.uuid4()),
        source_key="inputs/aa/source.jpg",
        target_key="inputs/bb/target.jpg",
        deadline_at=datetime.now(UTC) + timedelta(minutes=5),
        binding="v2=" + "0" * 64,
    )


def _deploy(client: PrefectAPI) -> None:
    """``fuse-faces`` with its parameter schema, enforced, as ``prefect deploy`` makes it."""
    from prefect.utilities.callables import parameter_schema

    from flows.fuse import fuse_faces

    pool = {"name": "gpu", "type": "faceflow-gpu", "base_job_template": pool_template("warm")}
    client._request("POST", "work_pools/", json=pool)
    flow = client._request("POST", "flows/", json={"name": FLOW_NAME}).json()
    body: dict[str, object] = {
        "name": DEPLOYMENT_NAME,
        "flow_id": flow["id"],
        "entrypoint": "flows/fuse.py:fuse_faces",
        "parameter_openapi_schema": parameter_schema(fuse_faces).model_dump_for_openapi(),
        "enforce_parameter_schema": True,
        "work_pool_name": "gpu",
    }
    client._request("POST", "deployments/", json=body)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=60, help="creates per arm")
    args = parser.parse_args()
    arms: dict[str, list[tuple[float, float]]] = {"checked": [], "relay (unchecked)": []}
    with (
        tempfile.TemporaryDirectory(prefix="run-create-") as tmp,
        server_database("postgresql") as database,
    ):
        server = start_server(Path(tmp), database)
        try:
            with PrefectAPI(server.api_url) as client:
                _deploy(client)
                deployment = client.deployment_id()

                def checked() -> None:  # the relay's body, without its per-run override
                    body = flow_run_body(_params())
                    client._request("POST", f"deployments/{deployment}/create_flow_run", json=body)

                def relay() -> None:
                    client.create_flow_run(_params())

                for warm in (checked, relay):
                    warm()
                wait_until_quiet(server.pids)
                for _ in range(args.runs):
                    for name, create in (("checked", checked), ("relay (unchecked)", relay)):
                        cpu0, t0 = process_tree_cpu_s(server.pids), time.perf_counter()
                        create()
                        wall = time.perf_counter() - t0
                        arms[name].append((wall, process_tree_cpu_s(server.pids) - cpu0))
        finally:
            server.stop()
    print(f"{'create_flow_run':<20} {'median ms':>10} {'p90 ms':>8} {'server CPU ms':>14}")
    for name, samples in arms.items():
        walls = sorted(w * 1e3 for w, _ in samples)
        cpu = statistics.fmean(c for _, c in samples) * 1e3
        print(f"{name:<20} {statistics.median(walls):>10.1f} "
              f"{walls[int(0.9 * len(walls))]:>8.1f} {cpu:>14.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
