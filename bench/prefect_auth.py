"""What the Prefect API's HTTP basic auth costs per request (issue 22).

Two Prefect servers on 127.0.0.1 side by side (services in the API process, each on a
PostgreSQL database of its own: SQLite answers 503 to writes on a busy machine), one asking
for ``PREFECT_SERVER_API_AUTH_STRING``. The same
requests go to both in alternation (A B, B A, ...), one at a time over a kept-alive connection, so the
machine's noise falls on both alike:

- ``read``: ``POST /api/flow_runs/filter`` for one run (what the relay's sync sends);
- ``write``: ``POST /api/deployments/{id}/create_flow_run`` (what its dispatch sends).

Per server and request: median and p95 latency; and the difference of the medians.

Then the same comparison without network or database, where the auth check's own cost
shows: Prefect's API app built twice in this process (with and without the setting),
``GET /api/admin/version`` through ``httpx.ASGITransport``, alternated; and the 401 that a
client without the credential gets.

    .venv/bin/python bench/prefect_auth.py --requests 300
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from faceflow import prefect_server  # noqa: E402
from faceflow.testing.prefect import PrefectRest, server_database, start_server  # noqa: E402
from webapi.prefect_api import auth_headers  # noqa: E402

Request = Callable[[], None]


def requests_of(rest: PrefectRest) -> dict[str, Request]:
    """The two timed requests against one server (a deployment and a run made first)."""
    flow = rest.call("POST", "/flows/", {"name": "auth-bench"})
    deployment = rest.call("POST", "/deployments/", {"name": "bench", "flow_id": flow["id"]})
    run = rest.call("POST", f"/deployments/{deployment['id']}/create_flow_run", {})

    def read() -> None:
        body = {"flow_runs": {"id": {"any_": [run["id"]]}}, "limit": 1}
        rest.call("POST", "/flow_runs/filter", body)

    def write() -> None:
        body = {"name": uuid.uuid4().hex}
        path = f"/deployments/{deployment['id']}/create_flow_run"
        rest.call("POST", path, body)

    return {"read": read, "write": write}


def timed_ms(request: Request) -> float:
    started = time.perf_counter()
    request()
    return (time.perf_counter() - started) * 1000


def in_process(requests: int, credential: str) -> None:
    """The API app with and without the auth check, in this process (no socket, no DB)."""
    import httpx
    from prefect.server.api.server import create_api_app
    from prefect.settings import PREFECT_SERVER_API_AUTH_STRING, temporary_settings

    plain = create_api_app()
    with temporary_settings({PREFECT_SERVER_API_AUTH_STRING: credential}):
        locked = create_api_app()

    async def run() -> dict[str, list[float]]:
        clients = {
            "no auth": httpx.AsyncClient(transport=httpx.ASGITransport(app=plain)),
            "basic auth": httpx.AsyncClient(
                transport=httpx.ASGITransport(app=locked),
                headers=auth_headers(auth_string=credential),
            ),
            "refused": httpx.AsyncClient(transport=httpx.ASGITransport(app=locked)),
        }
        url = "http://prefect/admin/version"
        samples: dict[str, list[float]] = {name: [] for name in clients}
        order = list(clients)
        for index in range(requests + 100):
            order.reverse()
            for name in order:
                started = time.perf_counter()
                response = await clients[name].get(url)
                if index >= 100:  # warm-up
                    samples[name].append((time.perf_counter() - started) * 1000)
                assert response.status_code == (401 if name == "refused" else 200)
        for client in clients.values():
            await client.aclose()
        return samples

    print(f"in process, GET /api/admin/version, {requests} requests each, alternated")
    report(asyncio.run(run()), "admin")


def report(samples: dict[str, list[float]], kind: str) -> None:
    """Median and p95 per variant, and what auth adds to the median."""
    medians = {}
    for name, values in samples.items():
        values = sorted(values)
        medians[name] = statistics.median(values)
        p95 = values[int(0.95 * (len(values) - 1))]
        print(f"  {kind:5} {name:10}  median {medians[name]:6.2f} ms  p95 {p95:6.2f} ms")
    delta = medians["basic auth"] - medians["no auth"]
    print(f"  {kind:5} auth costs {delta:+.2f} ms per request (median)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300, help="per server and kind")
    parser.add_argument("--in-process-requests", type=int, default=3000)
    args = parser.parse_args()
    credential = prefect_server.new_auth_string()
    with (
        tempfile.TemporaryDirectory(prefix="prefect-auth-bench-") as tmp,
        server_database("postgresql") as plain_db,
        server_database("postgresql") as auth_db,
    ):
        servers = {}
        for name, database, extra in (
            ("no auth", plain_db, {}),
            ("basic auth", auth_db, {prefect_server.SERVER_AUTH_VAR: credential}),
        ):
            home = Path(tmp) / name.replace(" ", "-")
            home.mkdir()
            servers[name] = start_server(home, database, extra_env=extra)
        try:
            clients = {
                "no auth": PrefectRest(servers["no auth"].api_url),
                "basic auth": PrefectRest(
                    servers["basic auth"].api_url, headers=auth_headers(auth_string=credential)
                ),
            }
            bare = PrefectRest(servers["basic auth"].api_url)
            refused = bare.http.post("/flow_runs/filter", json={}).status_code
            assert refused == 401, f"the server with auth answered {refused} without it"
            calls = {name: requests_of(rest) for name, rest in clients.items()}
            samples: dict[tuple[str, str], list[float]] = {}
            for kind in ("read", "write"):
                for name in calls:  # warm-up
                    for _ in range(20):
                        calls[name][kind]()
                order = list(calls)
                for _ in range(args.requests):
                    order.reverse()  # A B, B A, ...: drift in the machine's load cancels out
                    for name in order:
                        samples.setdefault((name, kind), []).append(timed_ms(calls[name][kind]))
            print(f"{args.requests} requests per server and kind, alternated, loopback")
            for kind in ("read", "write"):
                report({name: samples[(name, kind)] for name in calls}, kind)
        finally:
            for server in servers.values():
                server.stop()
    in_process(args.in_process_requests, credential)


if __name__ == "__main__":
    main()
