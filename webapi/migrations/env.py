"""Alembic environment: runs on the connection handed over by ``webapi.migrations``."""

from __future__ import annotations

from alembic import context
from sqlmodel import SQLModel

import webapi.models  # noqa: F401  (registers the tables on SQLModel.metadata)

target_metadata = SQLModel.metadata


def run_migrations() -> None:
    """Run the migrations on ``config.attributes["connection"]`` (online only)."""
    connection = context.config.attributes.get("connection")
    if connection is None:
        raise RuntimeError("use webapi.migrations.upgrade(database_url)")
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


run_migrations()
