"""``faceflow worker``: start the warm ``faceflow-gpu`` worker, or read a running one's status.

Mounted by ``faceflow.cli`` as a sub-app. ``faceflow worker start`` is the same worker as
``prefect worker start --pool gpu --type faceflow-gpu``; its options override the
``FACEFLOW_WORKER_*`` environment variables (``faceflow.worker.settings``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

REPO_ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = REPO_ROOT / "work_pools" / "faceflow-gpu.json"

app = typer.Typer(help="The warm GPU worker (Prefect worker type faceflow-gpu).")


@app.command()
def start(
    pool: Annotated[str, typer.Option(help="Work pool to poll (created if missing).")] = "gpu",
    name: Annotated[str | None, typer.Option(help="Worker name shown in Prefect.")] = None,
    work_queue: Annotated[
        list[str] | None, typer.Option("--work-queue", "-q", help="Queues to poll (default all).")
    ] = None,
    children: Annotated[
        int | None, typer.Option(min=1, help="Warm children (default: one per GPU).")
    ] = None,
    gpus: Annotated[str | None, typer.Option(help="GPU indices to pin, e.g. '0,1'.")] = None,
    max_runs_per_child: Annotated[
        int | None, typer.Option(min=1, help="Recycle a child after this many runs.")
    ] = None,
    max_rss_mb: Annotated[
        float | None, typer.Option(help="Recycle a child above this RSS (MiB).")
    ] = None,
    health_port: Annotated[
        int | None, typer.Option(help="Serve /health, /ready, /status on 127.0.0.1:PORT.")
    ] = None,
    status_file: Annotated[
        Path | None, typer.Option(help="Keep a status JSON file up to date.")
    ] = None,
    log_dir: Annotated[Path | None, typer.Option(help="Write children's output here.")] = None,
) -> None:
    """Run the worker until SIGTERM/SIGINT (the first drains, a second stops at once)."""
    import anyio

    from faceflow.worker.settings import WorkerSettings
    from faceflow.worker.worker import FaceFlowGpuWorker

    overrides: dict[str, Any] = {
        "children": children,
        "gpus": gpus,
        "max_runs_per_child": max_runs_per_child,
        "max_rss_mb": max_rss_mb,
        "health_port": health_port,
        "status_file": status_file,
        "log_dir": log_dir,
    }
    settings = WorkerSettings(**{k: v for k, v in overrides.items() if v is not None})
    worker = FaceFlowGpuWorker(
        work_pool_name=pool,
        work_queues=work_queue or None,
        name=name,
        settings=settings,
        base_job_template=json.loads(TEMPLATE.read_text()) if TEMPLATE.is_file() else None,
    )
    anyio.run(worker.start)


@app.command()
def status(
    port: Annotated[int, typer.Option(help="The worker's --health-port.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the raw status JSON.")] = False,
) -> None:
    """Show a running worker's readiness and its children (exit 1 when not ready)."""
    import httpx

    try:
        body = httpx.get(f"http://127.0.0.1:{port}/status", timeout=5).json()
    except httpx.HTTPError as exc:
        typer.echo(f"error[worker_unreachable]: {exc}", err=True)
        raise typer.Exit(2) from None
    if as_json:
        typer.echo(json.dumps(body, indent=1))
    else:
        flags = f"alive={body['alive']} ready={body['ready']} draining={body['draining']}"
        typer.echo(f"{body['worker']} on pool {body['work_pool']!r}: {flags}")
        for child in body["children"]:
            gpu = child["gpu"] or {}
            memory = gpu.get("process_memory_mb")
            typer.echo(
                f"  child {child['index']}: {child['state']:<8} pid {child['pid']} "
                f"runs {child['runs_done']} rss {child['rss_mb']} MB "
                f"gpu {f'{memory:.0f} MB' if memory is not None else 'none'} "
                f"loads {child['model_loads']}"
            )
    if not body["ready"]:
        raise typer.Exit(1)


if __name__ == "__main__":
    app()
