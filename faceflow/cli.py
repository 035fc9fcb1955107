"""The ``faceflow`` command: run the pipeline, inspect models, and drive the service.

Heavy imports (torch, prefect, the webapi) happen inside the commands that need them, so
``faceflow --help`` stays fast.
"""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from tasks.error_codes import JobErrorCode

if TYPE_CHECKING:
    from faceflow.client import FaceFlowClient, Job
    from tasks.provenance import Marker

app = typer.Typer(
    name="faceflow",
    help="FaceFlow: face fusion as a service, orchestrated by Prefect.",
    no_args_is_help=True,
    add_completion=False,
)
models_app = typer.Typer(help="Inspect the model registry.", no_args_is_help=True)
app.add_typer(models_app, name="models")
blocks_app = typer.Typer(help="Prefect blocks of the local stack.", no_args_is_help=True)
app.add_typer(blocks_app, name="blocks")
relay_app = typer.Typer(help="The relay: dispatch, sync, expire, reap, notify.")
app.add_typer(relay_app, name="relay")


def _mount_webapi() -> None:
    from webapi.cli import db_app, keys_app, retention_app, services_app, users_app

    app.add_typer(users_app, name="users")
    app.add_typer(keys_app, name="keys")
    app.add_typer(db_app, name="db")
    app.add_typer(retention_app, name="retention")
    app.add_typer(services_app, name="services")


_mount_webapi()


def _mount_operations() -> None:
    from faceflow import selftest
    from faceflow.worker import cli as worker_cli

    app.add_typer(worker_cli.app, name="worker")
    app.add_typer(selftest.app, name="selftest")


_mount_operations()


AlsoOption = Annotated[
    list[Path] | None,
    typer.Option("--source", help="Another source image (repeatable; source 1, 2, ...)."),
]
ReferenceOption = Annotated[
    list[Path] | None,
    typer.Option(help="A reference image for --map S:rR (repeatable; reference 0, 1, ...)."),
]
FaceMapOption = Annotated[
    list[str] | None,
    typer.Option(
        "--map",
        help="Per-face mapping (repeatable): S:T puts source S onto target face T "
        "(reading order), S:rR onto the target face most like reference R.",
    ),
]
"""The options naming the extra sources, references and per-face mapping (fuse, submit)."""
ModelDirOption = Annotated[
    Path | None, typer.Option(help="Directory with operator-provided models.")
]
"""The operator's model files (fuse, models list)."""
HomeOption = Annotated[Path | None, typer.Option(help="FaceFlow home (default .faceflow).")]
"""The FaceFlow home whose blocks and development chain a command uses (blocks init, verify)."""


def _fail(code: str, message: str, exit_code: int = 1) -> typer.Exit:
    typer.echo(f"error[{code}]: {message}", err=True)
    return typer.Exit(exit_code)


def _parse_map(spec: str) -> dict[str, int]:
    """``S:T`` or ``S:rR`` as a mapping entry."""
    source, _, face = spec.partition(":")
    if source.isdigit() and face.isdigit():
        return {"source": int(source), "target": int(face)}
    if source.isdigit() and face[:1] == "r" and face[1:].isdigit():
        return {"source": int(source), "reference": int(face[1:])}
    raise typer.BadParameter(f"{spec!r}: use S:T or S:rR (numbers)")


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
    enhancer: Annotated[
        str, typer.Option(help="Face restoration: none or gfpgan (operator model, pinned).")
    ] = "none",
    enhancer_blend: Annotated[
        float, typer.Option(help="How much of the restored face to keep, 0..1.")
    ] = 0.8,
    pin: Annotated[
        list[str] | None,
        typer.Option(help="Pin an operator model file: MODEL=SHA256 (repeatable)."),
    ] = None,
    min_identity: Annotated[
        float | None,
        typer.Option(help="Quality floor (0..1, 0.5 = same person): below it, retry once."),
    ] = None,
    model_dir: ModelDirOption = None,
    moderation: Annotated[
        str, typer.Option(help="NSFW check of inputs and result: enforce, report or off.")
    ] = "enforce",
    also: AlsoOption = None,
    reference: ReferenceOption = None,
    face_map: FaceMapOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON summary.")] = False,
    mark: Annotated[
        bool,
        typer.Option(
            "--mark/--no-mark",
            help="Mark the result (C2PA manifest signed with the local development chain, "
            "and the watermark) as the service does; --no-mark writes it unmarked.",
        ),
    ] = True,
    home: Annotated[
        Path | None, typer.Option(help="FaceFlow home whose development chain signs.")
    ] = None,
) -> None:
    """Fuse the face of SOURCE into TARGET in this process and print per-stage timings.
    The result is marked as the service marks it (the local development certificate chain
    under HOME signs it, made on first use); a result that cannot be marked is not
    written (``marking_failed``)."""
    from pydantic import ValidationError

    from tasks.errors import FaceFlowError
    from tasks.options import FusionOptions, ModerationPolicy

    fmt = {".jpg": "jpeg", ".jpeg": "jpeg", ".webp": "webp"}.get(output.suffix.lower(), "png")
    try:
        options = FusionOptions(
            identity_weight=identity_weight,
            detector=detector,  # type: ignore[arg-type]
            fuser=fuser,  # type: ignore[arg-type]
            face=_parse_face(face),
            blend=blend,  # type: ignore[arg-type]
            sharpen=sharpen,
            enhancer=enhancer,  # type: ignore[arg-type]
            enhancer_blend=enhancer_blend,
            min_identity=min_identity,
            mapping=[_parse_map(spec) for spec in face_map or []],  # type: ignore[misc]
            output_format=fmt,  # type: ignore[arg-type]
        )
        policy = ModerationPolicy(mode=moderation)  # type: ignore[arg-type]
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise _fail("invalid_options", f"{where}: {first['msg']}", 2) from None
    try:
        source_bytes, target_bytes = source.read_bytes(), target.read_bytes()
        extra_bytes = [path.read_bytes() for path in also or []]
        reference_bytes = [path.read_bytes() for path in reference or []]
    except OSError as exc:
        raise _fail(
            JobErrorCode.invalid_input, f"cannot read input: {exc.strerror}: {exc.filename}"
        ) from None

    from tasks.pipeline import PipelineContext
    from tasks.stages import fuse_images

    pins = dict(p.split("=", 1) for p in pin or [] if "=" in p)
    ctx = PipelineContext.for_this_machine(model_dir=model_dir, pins=pins, moderation=policy)
    job_id = str(uuid.uuid4())
    try:
        if mark:
            ctx = replace(ctx, marker=_local_marker(home))
        else:
            typer.echo(UNMARKED_WARNING, err=True)
        result = fuse_images(
            source_bytes,
            target_bytes,
            options,
            ctx,
            extra_sources=extra_bytes,
            references=reference_bytes,
            job_id=job_id,
        )
    except FaceFlowError as exc:
        raise _fail(exc.code, exc.message) from None
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
        "quality": result.quality.as_json() if result.quality is not None else None,
        "moderation": list(result.moderation_flags),
        "marks": list(result.marks),
        "job_id": job_id,
    }
    if as_json:
        typer.echo(json.dumps(summary))
        return
    typer.echo(f"wrote {output} ({result.width}x{result.height}, {result.content_type})")
    if result.marks:
        typer.echo(f"  marked: {', '.join(result.marks)} (job tag {job_id[:8]})")
    for stage, ms in summary["timings_ms"].items():  # type: ignore[attr-defined]
        typer.echo(f"  {stage:<16} {ms:8.1f} ms")
    typer.echo(f"  {'total':<16} {summary['total_ms']:8.1f} ms  on {result.device}")
    if result.quality is not None:
        q = result.quality
        typer.echo(
            f"quality: identity to source {q.source_similarity}, to target "
            f"{q.target_similarity} (0.5 = same person), faces lost {q.faces_lost}, "
            f"pose mismatch {q.pose_mismatch}, settings {q.settings.identity_weight:g} "
            f"{q.settings.blend} ({len(q.attempts)} attempt(s))"
        )
    for flag in result.moderation_flags:
        typer.echo(f"  moderation (report only) flagged {flag}")


UNMARKED_WARNING = (
    "warning: --no-mark: the result carries no Content Credentials and no watermark. It is "
    "a deep fake: whoever publishes it must disclose that (EU AI Act Art. 50)."
)


def _local_marker(home: Path | None) -> Marker:
    """The marker of a local fuse: the development chain under ``home`` (made on first
    use); ``MarkingFailed`` when it cannot be read or made."""
    from blocks.signing import dev_chain
    from blocks.storage import faceflow_home
    from tasks.errors import MarkingFailed
    from tasks.provenance import Marker

    try:
        return Marker(dev_chain(faceflow_home(home)).credentials)
    except (OSError, ValueError) as exc:
        detail = f"development chain: {type(exc).__name__}: {exc}"
        raise MarkingFailed("The signing certificate is not available.", detail=detail) from exc


@models_app.command("list")
def models_list(
    model_dir: ModelDirOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Show every registered model and whether its file is present and verified."""
    from tasks.registry import LIBRARIES, MODEL_NAMES, model_status

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
    for library in LIBRARIES.values():
        typer.echo(
            f"{library.name:<20} {'library':<9} {library.distribution:<20} {library.licence}"
        )


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


@app.command("prefect-auth")
def prefect_auth(
    path: Annotated[
        Path, typer.Argument(help="Environment file to write, e.g. /etc/faceflow/prefect-auth.env.")
    ],
    replace: Annotated[
        bool, typer.Option("--replace", help="Replace an existing credential (a rotation).")
    ] = False,
) -> None:
    """Write a new Prefect API credential for the systemd units (EnvironmentFile=): the
    server's PREFECT_SERVER_API_AUTH_STRING and the clients' PREFECT_API_AUTH_STRING, one
    value, mode 0600. Prints where it is, never what it is."""
    from faceflow import prefect_server

    try:
        prefect_server.write_auth_env(path, replace=replace)
    except (OSError, prefect_server.AuthFileError) as exc:
        raise _fail("prefect_auth", str(exc), 1) from exc
    typer.echo(f"wrote a new Prefect API credential to {path} (mode 0600)")


@blocks_app.command("init")
def blocks_init(
    home: HomeOption = None,
) -> None:
    """Save the default storage, FusionSettings and C2PA signing blocks (overwrite); the
    signing block holds a development certificate chain, made at first use."""
    from blocks.defaults import init_default_blocks

    saved = init_default_blocks(home)
    typer.echo(f"saved {saved.storage} ({saved.storage_path}), {saved.settings}, {saved.signing}")
    if saved.signing_created:
        typer.echo(
            f"created a development C2PA signing chain (root: {saved.trust_anchor}): results "
            "are signed with it; no C2PA reader trusts it: give production a certificate "
            "from a CA on the C2PA trust list (docs/provenance.md)"
        )


@relay_app.callback(invoke_without_command=True)
def relay(ctx: typer.Context) -> None:
    """Run the relay loops standalone (when the webapi runs with FACEFLOW_RUN_RELAY=false)."""
    if ctx.invoked_subcommand is None:
        from webapi.relay.runner import run_relay_forever

        run_relay_forever()


@relay_app.command("reconcile")
def relay_reconcile() -> None:
    """Run one pass of every relay step and print what it did."""
    from webapi.relay.runner import reconcile_once

    typer.echo(json.dumps(reconcile_once(), default=str))


@app.command()
def up(
    demo: Annotated[bool, typer.Option(help="Also run a demo job and print its result.")] = False,
    workers: Annotated[int, typer.Option(min=1, help="Workers on the GPU pool.")] = 1,
    worker_type: Annotated[
        str, typer.Option(help="Worker type: faceflow-gpu (warm) or process (stock).")
    ] = "faceflow-gpu",
    api_port: Annotated[int, typer.Option(help="Port of the webapi on 127.0.0.1.")] = 8000,
    prefect_port: Annotated[int, typer.Option(help="Port of the Prefect server.")] = 4200,
    home: Annotated[Path | None, typer.Option(help="State directory (default .faceflow).")] = None,
    prefect: Annotated[
        str,
        typer.Option(
            help="Prefect server layout: embedded (one process, SQLite) or scale-out "
            "(PostgreSQL FACEFLOW_PREFECT_DATABASE_URL + Redis FACEFLOW_PREFECT_REDIS_URL, "
            "several API processes, background services in their own process)."
        ),
    ] = "embedded",
    prefect_api_workers: Annotated[
        int, typer.Option(min=1, help="API processes of the scale-out Prefect server.")
    ] = 2,
) -> None:
    """Start the whole stack on this machine; Ctrl-C or SIGTERM stops it cleanly."""
    from faceflow.stack import Stack, StackConfig, run_demo, serve_forever
    from faceflow.supervisor import ServiceFailed

    if prefect not in ("embedded", "scale-out"):
        raise _fail("bad_option", f"--prefect must be embedded or scale-out, not {prefect!r}", 2)
    config = StackConfig(
        api_port=api_port,
        prefect_port=prefect_port,
        workers=workers,
        worker_type=worker_type,
        prefect_mode="scale-out" if prefect == "scale-out" else "embedded",
        prefect_api_workers=prefect_api_workers,
    )
    if home is not None:
        config.home = home.resolve()
    stack = Stack(config)
    try:
        stack.start()
        if demo:
            run_demo(stack)
    except ServiceFailed as exc:
        stack.stop()
        raise _fail("stack_failed", str(exc)) from None
    except BaseException:
        stack.stop()
        raise
    serve_forever(stack)


def _client() -> FaceFlowClient:
    import os

    from faceflow.client import FaceFlowClient

    key = os.environ.get("FACEFLOW_API_KEY")
    if not key:
        raise _fail("no_api_key", "set FACEFLOW_API_KEY (from `faceflow users create NAME`)", 2)
    return FaceFlowClient(os.environ.get("FACEFLOW_API_URL", "http://127.0.0.1:8000"), key)


@app.command()
def submit(
    source: Annotated[str, typer.Argument(help="Source face: a path or an https:// URL.")],
    target: Annotated[
        str, typer.Argument(help="Target photo or video: a path or an https:// URL.")
    ],
    wait: Annotated[bool, typer.Option(help="Wait for the job to end.")] = False,
    output: Annotated[Path | None, typer.Option("-o", "--output", help="Save the result.")] = None,
    identity_weight: Annotated[float | None, typer.Option(help="0..1.")] = None,
    deadline: Annotated[int | None, typer.Option(help="Deadline in whole seconds.")] = None,
    also: AlsoOption = None,
    reference: ReferenceOption = None,
    face_map: FaceMapOption = None,
) -> None:
    """Submit a job to the API (FACEFLOW_API_URL, FACEFLOW_API_KEY)."""
    from faceflow.client import FaceFlowAPIError, wait_with_progress

    options: dict[str, object] = {}
    if identity_weight is not None:
        options["identity_weight"] = identity_weight
    if face_map:
        options["mapping"] = [_parse_map(spec) for spec in face_map]
    with _client() as client:
        try:
            src = source if source.startswith("https://") else Path(source)
            tgt = target if target.startswith("https://") else Path(target)
            job = client.submit(
                src,
                tgt,
                options=options or None,
                deadline_seconds=deadline,
                extra_sources=list(also or []),
                references=list(reference or []),
            )
            typer.echo(f"job {job['id']} {job['status']}")
            if wait or output:
                job = wait_with_progress(client, job["id"], timeout=_time_left(job) + 30)
                typer.echo(json.dumps(job, indent=2, default=str))
                if output and job["status"] == "succeeded":
                    client.download(job["id"], output)  # streamed: a video may be large
                    typer.echo(f"wrote {output}")
                if job["status"] != "succeeded":
                    raise typer.Exit(1)
        except FaceFlowAPIError as exc:
            raise _fail(exc.code, exc.message) from None
        except OSError as exc:
            raise _fail(
                JobErrorCode.invalid_input, f"cannot read input: {exc.strerror}: {exc.filename}"
            ) from None


def _time_left(job: dict[str, object]) -> float:
    """Seconds until the job's deadline (at least 1)."""
    deadline = datetime.fromisoformat(str(job["deadline_at"]))
    return max(1.0, (deadline - datetime.now(UTC)).total_seconds())


def _print_job(call: Callable[[FaceFlowClient], Job]) -> None:
    """Print the job object ``call`` gets from the API (or the API's error, exit 1)."""
    from faceflow.client import FaceFlowAPIError

    with _client() as client:
        try:
            typer.echo(json.dumps(call(client), indent=2, default=str))
        except FaceFlowAPIError as exc:
            raise _fail(exc.code, exc.message) from None


@app.command()
def status(job_id: Annotated[str, typer.Argument(help="Job id.")]) -> None:
    """Print a job."""
    _print_job(lambda client: client.status(job_id))


@app.command()
def cancel(job_id: Annotated[str, typer.Argument(help="Job id.")]) -> None:
    """Cancel a queued or running job."""
    _print_job(lambda client: client.cancel(job_id))


@app.command()
def verify(
    file: Annotated[Path, typer.Argument(help="An image or MP4 to check.")],
    api: Annotated[
        bool,
        typer.Option(help="Ask the API (FACEFLOW_API_URL, FACEFLOW_API_KEY): it names your job."),
    ] = False,
    trust: Annotated[
        Path | None,
        typer.Option(help="PEM of trusted roots (default: the local stack's development root)."),
    ] = None,
    home: HomeOption = None,
) -> None:
    """Check a file's Content Credentials and invisible watermark. Exit 0 when either says
    this service made it, 1 when neither does."""
    from faceflow.client import FaceFlowAPIError

    try:
        data = file.read_bytes()
    except OSError as exc:
        raise _fail("invalid_input", f"cannot read {file}: {exc.strerror}") from None
    if api:
        with _client() as client:
            try:
                found = client.verify(data)
            except FaceFlowAPIError as exc:
                raise _fail(exc.code, exc.message) from None
    else:
        from tasks.errors import FaceFlowError

        try:
            found = _verify_here(data, trust, home)
        except FaceFlowError as exc:
            raise _fail(exc.code, exc.public_message) from None
    typer.echo(json.dumps(found, indent=2))
    if not found["made_by_this_service"]:
        raise typer.Exit(1)


def _verify_here(data: bytes, trust: Path | None, home: Path | None) -> dict[str, object]:
    """``faceflow verify`` without the API: the marks read in this process (the
    watermark's job tag in hex, as the job id's first 8 hex digits)."""
    from dataclasses import asdict

    from blocks.storage import faceflow_home
    from tasks.provenance import dev_root_path, inspect_file

    anchors = trust or dev_root_path(faceflow_home(home))
    found = inspect_file(data, anchors.read_text() if anchors.is_file() else None)
    mark = found.watermark
    return {
        "media_type": found.media_type,
        "made_by_this_service": found.made_here,
        "manifest": {**asdict(found.manifest), "ours": found.manifest.ours},
        "watermark": {
            "checked": found.watermark_checked,
            "present": mark is not None,
            "job_tag": f"{mark.tag:08x}" if mark is not None else None,
        },
    }


def main() -> None:
    """Entry point used by ``python -m faceflow``."""
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
