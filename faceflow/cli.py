"""The ``faceflow`` command: run the pipeline, inspect models, and drive the service.

Heavy imports (torch, prefect, the webapi) happen inside the commands that need them, so
``faceflow --help`` stays fast.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(
    name="faceflow",
    help="FaceFlow: face fusion as a service, orchestrated by Prefect.",
    no_args_is_help=True,
    add_completion=False,
)
models_app = typer.Typer(help="Inspect the model registry.", no_args_is_help=True)
app.add_typer(models_app, name="models")


def _fail(code: str, message: str, exit_code: int = 1) -> typer.Exit:
    typer.echo(f"error[{code}]: {message}", err=True)
    return typer.Exit(exit_code)


def _parse_face(value: str) -> str | int:
    if value in ("largest", "all"):
        return value
    if value.isdigit():
        return int(value)
    raise typer.BadParameter("use 'largest', 'all' or a face index (0 = largest)")


@app.command()
def fuse(
    source: Annotated[Path, typer.Argument(help="Image with the face to carry (JPEG/PNG/WebP).")],
    target: Annotated[Path, typer.Argument(help="Photo whose face(s) are replaced.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Where to write the result.")],
    identity_weight: Annotated[
        float, typer.Option(help="How much of the source face to carry, 0..1.")
    ] = 0.85,
    detector: Annotated[str, typer.Option(help="Face detector: mtcnn or scrfd.")] = "mtcnn",
    fuser: Annotated[str, typer.Option(help="Fusion method: classic or inswapper.")] = "classic",
    face: Annotated[str, typer.Option(help="Target face: largest, all or an index.")] = "largest",
    blend: Annotated[
        str, typer.Option(help="Blend: multiband, seamless or feather.")
    ] = "multiband",
    sharpen: Annotated[float, typer.Option(help="Unsharp-mask amount, 0 = off.")] = 0.0,
    model_dir: Annotated[
        Path | None, typer.Option(help="Directory with operator-provided models.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON summary.")] = False,
) -> None:
    """Fuse the face of SOURCE into TARGET in this process and print per-stage timings."""
    from pydantic import ValidationError

    from tasks.errors import FaceFlowError
    from tasks.options import FusionOptions

    fmt = {".jpg": "jpeg", ".jpeg": "jpeg", ".webp": "webp"}.get(output.suffix.lower(), "png")
    try:
        options = FusionOptions(
            identity_weight=identity_weight,
            detector=detector,  # type: ignore[arg-type]
            fuser=fuser,  # type: ignore[arg-type]
            face=_parse_face(face),
            blend=blend,  # type: ignore[arg-type]
            sharpen=sharpen,
            output_format=fmt,  # type: ignore[arg-type]
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise _fail("invalid_options", f"{where}: {first['msg']}", 2) from None
    try:
        source_bytes, target_bytes = source.read_bytes(), target.read_bytes()
    except OSError as exc:
        raise _fail("invalid_input", f"cannot read input: {exc.strerror}: {exc.filename}") from None

    from tasks.pipeline import PipelineContext, fuse_images

    ctx = PipelineContext.for_this_machine(model_dir=model_dir)
    try:
        result = fuse_images(source_bytes, target_bytes, options, ctx)
    except FaceFlowError as exc:
        raise _fail(exc.code, str(exc).split("] ", 1)[-1]) from None
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_bytes(result.data)
    summary = {
        "output": str(output),
        "width": result.width,
        "height": result.height,
        "content_type": result.content_type,
        "faces_replaced": result.faces_replaced,
        "device": result.device,
        "timings_ms": {k: round(v, 1) for k, v in result.timings_ms.items()},
        "total_ms": round(sum(result.timings_ms.values()), 1),
    }
    if as_json:
        typer.echo(json.dumps(summary))
        return
    typer.echo(f"wrote {output} ({result.width}x{result.height}, {result.content_type})")
    for stage, ms in summary["timings_ms"].items():  # type: ignore[attr-defined]
        typer.echo(f"  {stage:<12} {ms:8.1f} ms")
    typer.echo(f"  {'total':<12} {summary['total_ms']:8.1f} ms  on {result.device}")


@models_app.command("list")
def models_list(
    model_dir: Annotated[
        Path | None, typer.Option(help="Directory with operator-provided models.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Show every registered model and whether its file is present and verified."""
    from tasks.registry import MODEL_NAMES, model_status

    rows = [model_status(name, directory=model_dir) for name in MODEL_NAMES]  # type: ignore[arg-type]
    if as_json:
        typer.echo(
            json.dumps(
                [
                    {
                        "name": r.spec.name,
                        "file": r.spec.filename,
                        "sha256": r.spec.sha256,
                        "origin": r.spec.origin,
                        "present": r.present,
                        "verified": r.verified,
                        "path": str(r.path) if r.path else None,
                        "problem": r.problem,
                        "licence": r.spec.licence,
                    }
                    for r in rows
                ]
            )
        )
        return
    for r in rows:
        state = "verified" if r.verified else ("MISMATCH" if r.present else "missing")
        typer.echo(f"{r.spec.name:<20} {state:<9} {r.spec.filename:<20} {r.spec.source}")
        if r.problem and r.present:
            typer.echo(f"    {r.problem}")


@app.command()
def demo(
    output: Annotated[Path, typer.Option("-o", "--output", help="Result path.")] = Path(
        ".faceflow/demo/astronaut_on_grace_hopper.png"
    ),
) -> None:
    """Fuse the sample astronaut onto the sample Grace Hopper photo in this process."""
    from faceflow import samples

    output.parent.mkdir(parents=True, exist_ok=True)
    src = output.parent / "astronaut.jpg"
    src.write_bytes(samples.astronaut_jpeg_bytes())
    fuse(src, samples.grace_hopper_path(), output)


def main() -> None:
    """Entry point used by ``python -m faceflow``."""
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
