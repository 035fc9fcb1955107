"""``faceflow users ...`` and ``faceflow db ...``: the ``app`` here is mounted by faceflow.cli.

``users create NAME [--quota N]`` prints the API key and the webhook secret once (they
cannot be shown again); ``db upgrade`` applies the Alembic migrations.
"""

from __future__ import annotations

from typing import Annotated

import typer
from sqlmodel import Session

from webapi import crud
from webapi.config import get_settings
from webapi.db import get_engine
from webapi.errors import InvalidRequest
from webapi.migrations import DatabaseNotMigrated, check_migrated, upgrade

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Job store administration.")
users_app = typer.Typer(no_args_is_help=True, help="API users and their keys.")
db_app = typer.Typer(no_args_is_help=True, help="The job store database.")
app.add_typer(users_app, name="users")
app.add_typer(db_app, name="db")

DatabaseOption = Annotated[
    str | None, typer.Option("--database-url", help="Default: FACEFLOW_DATABASE_URL.")
]


def _url(database_url: str | None) -> str:
    return database_url or get_settings().database_url


@users_app.command("create")
def create_user(
    name: Annotated[str, typer.Argument(help="Unique user name.")],
    quota: Annotated[
        int | None, typer.Option(min=0, help="Unfinished jobs allowed at once.")
    ] = None,
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
            )
    except (DatabaseNotMigrated, InvalidRequest) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    typer.echo(f"user:           {new.user.name} ({new.user.id}), quota {new.user.quota}")
    typer.echo(f"api key:        {new.api_key}")
    typer.echo(f"webhook secret: {new.webhook_secret}")
    typer.echo("Store both now: they are not shown again.", err=True)


@users_app.command("list")
def list_users(database_url: DatabaseOption = None) -> None:
    """List users (never their secrets)."""
    engine = get_engine(_url(database_url))
    with Session(engine) as session:
        for user in crud.list_users(session):
            state = " (disabled)" if user.disabled else ""
            typer.echo(f"{user.name}\t{user.id}\tquota={user.quota}{state}")


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
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    typer.echo("job store is up to date")
