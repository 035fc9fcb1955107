"""Database engines: created lazily, one per URL per process.

SQLite (the embedded default) runs in WAL mode with a busy timeout, and every transaction
starts with ``BEGIN IMMEDIATE``: the write lock is taken up front, so a transaction that
reads then writes never fails half-way with "database is locked" (SQLite cannot upgrade
a read snapshot that another writer has moved past). Sessions on ``read_only(engine)``
begin ``DEFERRED`` instead (readers do not queue behind writers); they must not write.
PostgreSQL goes through psycopg 3 (the option is ignored there).
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine, make_url
from sqlmodel import Session

SQLITE_BUSY_TIMEOUT_MS = 15_000
_BEGIN_OPTION = "faceflow_sqlite_begin"

_engines: dict[str, Engine] = {}
_lock = threading.Lock()


def get_engine(database_url: str) -> Engine:
    """The engine of ``database_url``, created on first use."""
    with _lock:
        engine = _engines.get(database_url)
        if engine is None:
            engine = _engines[database_url] = create_engine(database_url)
        return engine


def create_engine(database_url: str) -> Engine:
    """A new engine configured for the dialect of ``database_url``."""
    url = make_url(database_url)
    if url.get_backend_name() == "sqlite":
        return _sqlite_engine(database_url)
    return sa.create_engine(
        database_url, pool_pre_ping=True, pool_size=10, max_overflow=20, pool_recycle=1800
    )


def dispose_engines() -> None:
    """Close every pooled connection (tests, shutdown)."""
    with _lock:
        for engine in _engines.values():
            engine.dispose()
        _engines.clear()


@contextmanager
def session_scope(engine: Engine) -> Iterator[Session]:
    """A session that is closed (rolled back if uncommitted) on exit."""
    with Session(engine, expire_on_commit=False) as session:
        yield session


def read_only(engine: Engine) -> Engine:
    """``engine`` for read-only sessions (same pool; SQLite transactions begin DEFERRED)."""
    return engine.execution_options(**{_BEGIN_OPTION: "DEFERRED"})


def is_sqlite(engine: Engine) -> bool:
    """Whether ``engine`` talks to SQLite."""
    return engine.dialect.name == "sqlite"


def _sqlite_engine(database_url: str) -> Engine:
    url = make_url(database_url)
    if url.database and url.database != ":memory:":
        Path(url.database).parent.mkdir(parents=True, exist_ok=True)
    engine = sa.create_engine(
        database_url,
        connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000},
        pool_size=20,
        max_overflow=20,
    )

    @sa.event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: sqlite3.Connection, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # we emit BEGIN ourselves
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    writers = _WriterQueue()

    @sa.event.listens_for(engine, "begin")
    def _on_begin(connection: sa.Connection) -> None:
        mode = connection.get_execution_options().get(_BEGIN_OPTION, "IMMEDIATE")
        dbapi_connection = connection.connection.dbapi_connection
        if mode == "IMMEDIATE":
            writers.enter(dbapi_connection)
        try:
            connection.exec_driver_sql(f"BEGIN {mode}")
        except BaseException:
            writers.leave(dbapi_connection)
            raise

    dialect = engine.dialect
    do_commit, do_rollback = dialect.do_commit, dialect.do_rollback

    def _commit(dbapi_connection: Any) -> None:
        try:
            do_commit(dbapi_connection)
        finally:
            writers.leave(dbapi_connection)

    def _rollback(dbapi_connection: Any) -> None:
        try:
            do_rollback(dbapi_connection)
        finally:
            writers.leave(dbapi_connection)

    dialect.do_commit = _commit  # type: ignore[method-assign]
    dialect.do_rollback = _rollback  # type: ignore[method-assign]
    return engine


class _WriterQueue:
    """One in-process writer at a time, queued on a lock.

    SQLite's own busy handler polls with growing sleeps (up to a whole second where it is
    built without ``usleep``), which turns write contention into latency spikes; waiting
    on a Python lock instead hands the write lock over at once. Other processes (a
    standalone relay) still meet the busy timeout. A holder that vanishes without commit
    or rollback only costs the next writer the busy timeout, after which it proceeds.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders: set[int] = set()

    def enter(self, dbapi_connection: Any) -> None:
        if self._lock.acquire(timeout=SQLITE_BUSY_TIMEOUT_MS / 1000):
            self._holders.add(_key(dbapi_connection))

    def leave(self, dbapi_connection: Any) -> None:
        key = _key(dbapi_connection)
        if key in self._holders:
            self._holders.discard(key)
            self._lock.release()


def _key(connection: Any) -> int:
    """Identity of the raw DBAPI connection behind a pool proxy (or the raw one)."""
    return id(getattr(connection, "dbapi_connection", None) or connection)
