"""Alembic migrations of the job store, driven from Python (no alembic.ini needed).

``upgrade(database_url)`` applies every revision (``faceflow db upgrade``);
``check_migrated(engine)`` is what the app runs at start to refuse an unmigrated database.
"""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Engine

from webapi.db import create_engine

MIGRATIONS_DIR = Path(__file__).resolve().parent


class DatabaseNotMigrated(RuntimeError):
    """The database schema is missing or older than this code."""


def alembic_config() -> Config:
    """An Alembic config pointing at this package's scripts."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    return config


def head_revision() -> str:
    """The newest revision this code knows."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if head is None:
        raise DatabaseNotMigrated("no migration scripts found")
    return head


def current_revision(engine: Engine) -> str | None:
    """The revision the database is at (None when never migrated)."""
    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def upgrade(database_url: str, revision: str = "head") -> str:
    """Apply migrations up to ``revision``; returns the revision reached."""
    engine = create_engine(database_url)
    try:
        with engine.begin() as connection:
            config = alembic_config()
            config.attributes["connection"] = connection
            command.upgrade(config, revision)
        reached = current_revision(engine)
    finally:
        engine.dispose()
    return reached or ""


def check_migrated(engine: Engine) -> None:
    """Raise ``DatabaseNotMigrated`` unless the database is at the head revision."""
    head = head_revision()
    try:
        current = current_revision(engine)
    except sa.exc.OperationalError as exc:
        raise DatabaseNotMigrated(f"cannot open the job store database: {exc.orig}") from exc
    if current != head:
        url = engine.url.render_as_string(hide_password=True)
        raise DatabaseNotMigrated(
            f"the job store at {url} is at revision {current or 'none (empty)'}, this code "
            f"needs {head}: run `faceflow db upgrade` (FACEFLOW_DATABASE_URL={url})"
        )
