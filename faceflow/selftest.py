"""``faceflow selftest``: suites that check a running FaceFlow end to end.

``app`` is a Typer app; mount it with ``app.add_typer(selftest.app, name="selftest")``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(help="End-to-end self-tests of the whole stack.", no_args_is_help=True)


@app.callback()
def selftest() -> None:
    """End-to-end self-tests of the whole stack."""


@app.command()
def faults(
    full: Annotated[
        bool, typer.Option("--full/--short", help="Full matrix (minutes) or the short one.")
    ] = False,
    only: Annotated[
        list[str] | None, typer.Option("--only", help="Scenario number(s) to run (repeatable).")
    ] = None,
    database: Annotated[
        str | None,
        typer.Option(help="Job store: sqlite or postgres (default: postgres for --full)."),
    ] = None,
    worker_type: Annotated[
        str, typer.Option(help="Worker type: faceflow-gpu (warm) or process.")
    ] = "faceflow-gpu",
    home: Annotated[
        Path | None, typer.Option(help="Keep the stack's home (logs) here instead of a temp dir.")
    ] = None,
) -> None:
    """Start the stack, inject faults one scenario at a time, print one row per scenario.

    Exits 1 when a must-be-zero column (late, lost, dup-exec, ...) is not zero.
    """
    from faceflow.faults.runner import run
    from faceflow.faults.scenarios import FULL, SHORT

    profile = FULL if full else SHORT
    store = database or ("postgres" if full else "sqlite")
    if store not in ("sqlite", "postgres"):
        raise typer.BadParameter("use sqlite or postgres", param_hint="--database")
    result = run(
        profile,
        only=only,
        database=store,  # type: ignore[arg-type]
        worker_type=worker_type,
        home=home,
        out=lambda line: typer.echo(line),
        progress=lambda line: typer.echo(line, err=True),
    )
    if not result.ok:
        raise typer.Exit(1)
