"""Throw-away databases for tests and benchmarks on the local PostgreSQL (127.0.0.1:5432,
database ``test``, trust authentication) or SQLite."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Literal

import sqlalchemy as sa

PG_ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
"""The local PostgreSQL that tests and benchmarks create their databases and schemas in."""

JobStoreKind = Literal["sqlite", "postgresql"]


def postgres_unavailable(admin_url: str = PG_ADMIN_URL) -> str | None:
    """Why PostgreSQL cannot be used here, or None when it can."""
    try:
        engine = sa.create_engine(admin_url, connect_args={"connect_timeout": 3})
        with engine.connect() as connection:
            connection.execute(sa.text("SELECT 1"))
        engine.dispose()
    except Exception as exc:
        return f"PostgreSQL at 127.0.0.1:5432/test is unreachable: {type(exc).__name__}: {exc}"
    return None


@contextmanager
def postgres_database(prefix: str, admin_url: str = PG_ADMIN_URL) -> Iterator[str]:
    """A fresh database ``<prefix>_<random>`` on the server of ``admin_url``; its URL (the
    same driver). Dropped on exit, connections or not (``WITH (FORCE)``)."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    # No pool: a PostgreSQL restart (the fault suite's) must not leave a dead connection.
    admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    try:
        with admin.connect() as connection:
            connection.execute(sa.text(f'CREATE DATABASE "{name}"'))
        yield admin_url.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with admin.connect() as connection:
            connection.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@contextmanager
def postgres_schema(prefix: str, admin_url: str = PG_ADMIN_URL) -> Iterator[str]:
    """A fresh schema ``<prefix>_<random>`` in the database of ``admin_url``; a URL whose
    connections use it (``search_path``). Dropped with what it holds on exit."""
    schema = f"{prefix}_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(admin_url)
    try:
        with admin.begin() as connection:
            connection.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
        yield f"{admin_url}?options=-csearch_path%3D{schema}"
    finally:
        with admin.begin() as connection:
            connection.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()


@contextmanager
def job_store(kind: JobStoreKind, workdir: Path, *, prefix: str = "bench") -> Iterator[str]:
    """A migrated, empty job store: a SQLite file in ``workdir`` or a fresh PostgreSQL
    schema (dropped on exit, after this process's engines are disposed); its URL."""
    from webapi.db import dispose_engines
    from webapi.migrations import upgrade

    with ExitStack() as schema:
        if kind == "sqlite":
            url = f"sqlite:///{workdir / f'{prefix}.db'}"
        else:
            url = schema.enter_context(postgres_schema(prefix))
        upgrade(url)
        try:
            yield url
        finally:
            dispose_engines()
