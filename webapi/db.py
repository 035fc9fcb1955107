"""Database engines: created lazily, one per URL per process.

SQLite (the embedded default) runs in WAL mode with a busy timeout, and every transaction
starts with ``BEGIN IMMEDIATE``: the write lock is taken up front, so a transaction that
reads then writes never fails half-way with "database is locked" (SQLite cannot upgrade
a read snapshot that another writer has moved past). Writers queue on a lock file beside
the database first (``_WriterQueue``), so processes sharing one file (API workers, a
standalone relay) hand the write lock over within a fraction of a millisecond, where
SQLite's own busy handler sleeps for milliseconds. Sessions on
``read_only(engine)`` begin ``DEFERRED`` instead (readers do not queue behind writers);
they must not write.
PostgreSQL goes through psycopg 3 (the option is ignored there).
"""

from __future__ import annotations

import fcntl
import os
import sqlite3
import threading
import time
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

    writers = _WriterQueue(_lock_path(url.database))

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
    """One writer at a time, in this process and across processes on the same file.

    SQLite's own busy handler polls with growing sleeps (1, 2, 5, 10 ... ms, or a whole
    second where it is built without ``usleep``), which turns write contention into latency
    spikes. Writers here wait on a Python lock (this process), then on an exclusive
    ``flock`` of ``<database>.writer`` (other processes, e.g. several API workers and a
    standalone relay), polled at sub-millisecond steps. The file lock is released by the
    kernel if its holder dies. A holder that vanishes without commit or rollback
    only costs the next writer the busy timeout, after which it proceeds (and SQLite's
    own lock still guards the data).
    """

    def __init__(self, lock_path: str | None) -> None:
        self._lock = threading.Lock()
        self._holders: set[int] = set()
        self._lock_path = lock_path
        self._fd: int | None = None
        self._pid = os.getpid()

    def enter(self, dbapi_connection: Any) -> None:
        deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_MS / 1000
        if not self._lock.acquire(timeout=SQLITE_BUSY_TIMEOUT_MS / 1000):
            return
        if not self._lock_file(deadline):
            self._lock.release()
            return
        self._holders.add(_key(dbapi_connection))

    def leave(self, dbapi_connection: Any) -> None:
        key = _key(dbapi_connection)
        if key in self._holders:
            self._holders.discard(key)
            self._unlock_file()
            self._lock.release()

    def _lock_file(self, deadline: float) -> bool:
        """Take the cross-process lock (held with the thread lock); False on timeout.

        Polls without blocking, with sleeps from 0.1 ms doubling up to 2 ms: a holder's
        write transaction lasts about a millisecond, and a timeout stays possible.
        """
        fd = self._file()
        if fd is None:
            return True
        pause = 0.0001
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(pause)
                pause = min(pause * 2, 0.002)

    def _unlock_file(self) -> None:
        if self._fd is not None and self._pid == os.getpid():
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _file(self) -> int | None:
        if self._lock_path is None:
            return None
        if self._fd is None or self._pid != os.getpid():  # a forked child opens its own
            self._fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o600)
            self._pid = os.getpid()
        return self._fd


def _lock_path(database: str | None) -> str | None:
    """The writer lock file of a SQLite database file (None for in-memory databases)."""
    if not database or database == ":memory:" or database.startswith("file:"):
        return None
    return f"{database}.writer"


def _key(connection: Any) -> int:
    """Identity of the raw DBAPI connection behind a pool proxy (or the raw one)."""
    return id(getattr(connection, "dbapi_connection", None) or connection)
