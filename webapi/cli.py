"""``faceflow users|keys|db ...``: the ``app`` here is mounted by faceflow.cli.

``users create NAME [--quota N] [--priority high] [--input-retention S] [--result-retention S]``
prints the API key and the webhook secret once (they cannot be shown again); ``users set
NAME ...`` changes those settings; ``users disable|enable NAME`` turns a user off (keys
refused, unfinished jobs cancelled, webhooks stopped) and on; ``keys list NAME``, ``keys
revoke KEY-ID`` and ``keys rotate NAME [--grace S]`` manage API keys by their id (a key is
printed only once, when it is made); ``db upgrade`` applies the Alembic migrations;
``retention run`` runs one retention pass (what the ``retention`` deployment schedules);
``services record-start|record-exit|list|wait-ready`` serve the systemd units (deploy/systemd).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, NoReturn, TypeVar, get_args

import typer
from sqlmodel import Session

from webapi import crud, services
from webapi.config import get_settings
from webapi.db import get_engine
from webapi.errors import InvalidRequest, NotFound
from webapi.migrations import DatabaseNotMigrated, check_migrated, upgrade
from webapi.models import ApiKey, Priority, User, utcnow

T = TypeVar("T")

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Job store administration.")
users_app = typer.Typer(no_args_is_help=True, help="API users and their keys.")
keys_app = typer.Typer(no_args_is_help=True, help="API keys: list, revoke, rotate.")
db_app = typer.Typer(no_args_is_help=True, help="The job store database.")
retention_app = typer.Typer(no_args_is_help=True, help="Deleting expired inputs and results.")
services_app = typer.Typer(
    no_args_is_help=True, help="Supervised services: start records, readiness (systemd units)."
)
app.add_typer(users_app, name="users")
app.add_typer(keys_app, name="keys")
app.add_typer(db_app, name="db")
app.add_typer(retention_app, name="retention")
app.add_typer(services_app, name="services")

DatabaseOption = Annotated[
    str | None, typer.Option("--database-url", help="Default: FACEFLOW_DATABASE_URL.")
]
UserArgument = Annotated[str, typer.Argument(metavar="NAME", help="The user's name.")]
ServiceArgument = Annotated[str, typer.Argument(help="Service name (systemd: %N).")]


QuotaOption = Annotated[int | None, typer.Option(min=0, help="Unfinished jobs allowed at once.")]
PriorityChoice = StrEnum("PriorityChoice", {name: name for name in get_args(Priority)})  # type: ignore[misc]
PriorityOption = Annotated[
    PriorityChoice | None,
    typer.Option(help="Priority class: 'high' may use the priority lane (default: the setting)."),
]
InputRetentionOption = Annotated[
    int | None,
    typer.Option(
        "--input-retention", min=-1, help="Seconds inputs are kept after a job ends (-1: setting)."
    ),
]
ResultRetentionOption = Annotated[
    int | None,
    typer.Option(
        "--result-retention",
        min=-1,
        help="Seconds results are kept after a job ends (-1: setting).",
    ),
]


def _url(database_url: str | None) -> str:
    return database_url or get_settings().database_url


def _retention(value: int | None) -> int | None:
    """``-1`` on the command line means "the setting" (stored as NULL)."""
    return None if value is None or value < 0 else value


def _describe(user: User) -> str:
    def seconds(value: int | None) -> str:
        return "setting" if value is None else f"{value}s"

    return (
        f"quota {user.quota}, priority {user.priority}, inputs kept "
        f"{seconds(user.input_retention_s)}, results kept {seconds(user.result_retention_s)}"
    )


@users_app.command("create")
def create_user(
    name: Annotated[str, typer.Argument(help="Unique user name.")],
    quota: QuotaOption = None,
    priority: PriorityOption = None,
    input_retention: InputRetentionOption = None,
    result_retention: ResultRetentionOption = None,
    database_url: DatabaseOption = None,
) -> None:
    """Create a user; prints its API key and webhook secret (shown only now)."""
    settings = get_settings()
    engine = get_engine(_url(database_url))
    try:
        check_migrated(engine)
        with Session(engine, expire_on_commit=False) as session:
            new = crud.create_user(
                session,
                name=name,
                quota=settings.default_quota if quota is None else quota,
                pepper=settings.api_key_pepper.get_secret_value(),
                priority=priority.value if priority else settings.default_priority,  # type: ignore[arg-type]
                input_retention_s=_retention(input_retention),
                result_retention_s=_retention(result_retention),
            )
    except (DatabaseNotMigrated, InvalidRequest) as exc:
        _fail(exc)
    typer.echo(f"user:           {new.user.name} ({new.user.id}), {_describe(new.user)}")
    typer.echo(f"api key:        {new.api_key}")
    typer.echo(f"key id:         {new.key_id}")
    typer.echo(f"webhook secret: {new.webhook_secret}")
    typer.echo("Store both now: they are not shown again.", err=True)


@users_app.command("set")
def set_user(
    name: UserArgument,
    quota: QuotaOption = None,
    priority: PriorityOption = None,
    input_retention: InputRetentionOption = None,
    result_retention: ResultRetentionOption = None,
    database_url: DatabaseOption = None,
) -> None:
    """Change a user's quota, priority class or retention times (for jobs submitted next)."""
    changes: dict[str, Any] = {}
    if quota is not None:
        changes["quota"] = quota
    if priority is not None:
        changes["priority"] = priority.value
    if input_retention is not None:
        changes["input_retention_s"] = _retention(input_retention)
    if result_retention is not None:
        changes["result_retention_s"] = _retention(result_retention)
    if not changes:
        typer.echo("error: nothing to change", err=True)
        raise typer.Exit(2)
    user = _on_store(database_url, crud.update_user, name=name, **changes)
    typer.echo(f"user {user.name}: {_describe(user)}")


@users_app.command("disable")
def disable_user(name: UserArgument, database_url: DatabaseOption = None) -> None:
    """Disable a user: keys refused, unfinished jobs cancelled, webhooks no longer sent."""
    done = _on_store(database_url, crud.disable_user, name=name)
    typer.echo(
        f"user {done.user.name} disabled: {done.cancelled} queued jobs cancelled, "
        f"{done.cancel_requested} running jobs asked to stop; submits refused now, "
        f"other requests within {_cache_time()}"
    )


@users_app.command("enable")
def enable_user(name: UserArgument, database_url: DatabaseOption = None) -> None:
    """Enable a disabled user again (jobs cancelled meanwhile stay cancelled)."""
    user = _on_store(database_url, crud.enable_user, name=name)
    typer.echo(f"user {user.name} enabled")


@users_app.command("list")
def list_users(database_url: DatabaseOption = None) -> None:
    """List users (never their secrets)."""
    engine = get_engine(_url(database_url))
    with Session(engine) as session:
        for user in crud.list_users(session):
            state = " (disabled)" if user.disabled else ""
            typer.echo(
                f"{user.name}\t{user.id}\tquota={user.quota}\tpriority={user.priority}{state}"
            )


@keys_app.command("list")
def list_keys(name: UserArgument, database_url: DatabaseOption = None) -> None:
    """A user's API keys: id, first characters, creation and state (never the key)."""
    keys = _on_store(database_url, crud.list_keys, name=name)
    now = utcnow()
    for key in keys:
        typer.echo(
            f"{key.id}\t{key.prefix}…\tcreated {_when(key.created_at)}\t{_key_state(key, now)}"
        )


@keys_app.command("revoke")
def revoke_key(
    key_id: Annotated[uuid.UUID, typer.Argument(metavar="KEY-ID", help="From keys list.")],
    database_url: DatabaseOption = None,
) -> None:
    """Revoke one API key now."""
    key = _on_store(database_url, crud.revoke_key, key_id=key_id)
    typer.echo(f"key {key.id} {_key_state(key, utcnow())}: refused within {_cache_time()}")


@keys_app.command("rotate")
def rotate_key(
    name: UserArgument,
    grace: Annotated[
        float | None,
        typer.Option(
            min=0,
            help="Seconds the older keys keep working (default: "
            "FACEFLOW_KEY_ROTATION_GRACE_SECONDS).",
        ),
    ] = None,
    database_url: DatabaseOption = None,
) -> None:
    """Give a user a new API key (printed once); the older ones stop after the grace."""
    settings = get_settings()
    rotated = _on_store(
        database_url,
        crud.rotate_key,
        name=name,
        pepper=settings.api_key_pepper.get_secret_value(),
        grace_s=settings.key_rotation_grace_seconds if grace is None else grace,
    )
    typer.echo(f"user:    {rotated.user.name} ({rotated.user.id})")
    typer.echo(f"api key: {rotated.api_key}")
    typer.echo(f"key id:  {rotated.key.id}")
    now = utcnow()
    for key in rotated.old:
        typer.echo(f"old key: {key.id} {_key_state(key, now)}")
    typer.echo("Store the key now: it is not shown again.", err=True)


def _key_state(key: ApiKey, now: datetime) -> str:
    if key.revoked_at is None:
        return "active"
    if key.revoked_at > now:
        return f"valid until {_when(key.revoked_at)}"
    return f"revoked {_when(key.revoked_at)}"


def _when(moment: datetime) -> str:
    return moment.isoformat(timespec="seconds")


def _cache_time() -> str:
    return f"{get_settings().auth_cache_seconds:g} s (FACEFLOW_AUTH_CACHE_SECONDS)"


def _on_store(database_url: str | None, action: Callable[..., T], **keywords: Any) -> T:
    """``action(session, **keywords)`` in a session on the job store (a ``crud``
    function); ``NotFound`` or ``InvalidRequest`` end the command with its message and
    exit status 1."""
    try:
        with Session(get_engine(_url(database_url)), expire_on_commit=False) as session:
            return action(session, **keywords)
    except (NotFound, InvalidRequest) as exc:
        _fail(exc)


def _fail(exc: Exception) -> NoReturn:
    typer.echo(f"error: {exc}", err=True)
    raise typer.Exit(1) from exc


@db_app.command("upgrade")
def db_upgrade(database_url: DatabaseOption = None) -> None:
    """Apply every migration to the job store."""
    url = _url(database_url)
    revision = upgrade(url)
    typer.echo(f"job store at revision {revision}")


@db_app.command("check")
def db_check(database_url: DatabaseOption = None) -> None:
    """Exit 1 unless the job store is fully migrated."""
    try:
        check_migrated(get_engine(_url(database_url)))
    except DatabaseNotMigrated as exc:
        _fail(exc)
    typer.echo("job store is up to date")


@retention_app.command("run")
def retention_run(
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Run one retention pass now (the ``retention`` deployment runs one every 5 minutes)."""
    from webapi.retention import run_pass_from_settings

    try:
        report = run_pass_from_settings()
    except DatabaseNotMigrated as exc:
        _fail(exc)
    if as_json:
        typer.echo(json.dumps(report.as_dict()))
        return
    typer.echo(
        f"inputs: {report.input_objects} objects deleted for {report.input_jobs} jobs "
        f"({report.inputs_shared} kept: still used); results: {report.result_jobs} jobs "
        f"({report.results_expired} expired); rows deleted: {report.rows_deleted}; "
        f"{report.seconds:.2f} s"
    )


@services_app.command("record-start")
def services_record_start(
    name: ServiceArgument,
) -> None:
    """Count one start of a supervised service (systemd ``ExecStartPre``)."""
    settings = get_settings()
    assert settings.services_dir is not None
    record = services.record_start(settings.services_dir, name)
    typer.echo(f"{record.service}: start {record.starts} (restarts {record.restarts})")


@services_app.command("record-exit")
def services_record_exit(
    name: ServiceArgument,
    result: Annotated[str, typer.Option(help="systemd's $SERVICE_RESULT.")] = "",
    code: Annotated[str, typer.Option(help="systemd's $EXIT_CODE.")] = "",
    status: Annotated[str, typer.Option(help="systemd's $EXIT_STATUS.")] = "",
) -> None:
    """Note why a supervised service stopped (systemd ``ExecStopPost``)."""
    settings = get_settings()
    assert settings.services_dir is not None
    reason = " ".join(part for part in (result, code, status) if part) or "stopped"
    services.record_exit(settings.services_dir, name, reason)


@services_app.command("list")
def services_list() -> None:
    """Starts, restarts and last exit of every supervised service on this host."""
    settings = get_settings()
    for record in services.read_records(settings.services_dir):
        typer.echo(
            f"{record.service}\tstarts={record.starts}\trestarts={record.restarts}\t"
            f"last_start={record.last_start}\tlast_exit={record.last_exit or '-'}"
        )


@services_app.command("wait-ready")
def services_wait_ready(
    url: Annotated[str, typer.Argument(help="Readiness URL: 200 means ready.")],
    timeout: Annotated[float, typer.Option(min=0, help="Seconds to wait at most.")] = 120.0,
    interval: Annotated[float, typer.Option(min=0.05, help="Seconds between tries.")] = 0.5,
) -> None:
    """Wait until URL answers 200 (systemd ``ExecStartPost``: the unit counts as started,
    and units ordered after it start, only once it is ready); exit 1 on timeout."""
    import httpx

    deadline = time.monotonic() + timeout
    last = "no answer"
    while True:
        try:
            response = httpx.get(url, timeout=min(5.0, max(interval, 1.0)))
            if response.status_code == 200:
                typer.echo(f"ready: {url}")
                return
            last = f"HTTP {response.status_code}"
        except httpx.HTTPError as exc:
            last = type(exc).__name__
        if time.monotonic() >= deadline:
            typer.echo(f"error: {url} not ready after {timeout:.0f} s ({last})", err=True)
            raise typer.Exit(1)
        time.sleep(interval)
