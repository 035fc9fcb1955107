"""SQLite writers queue on ``<database>.writer`` across processes (``webapi.db``).

Several API workers and a standalone relay share one SQLite file; without the file lock
they would meet only SQLite's busy handler, which sleeps in millisecond steps (latency
spikes under contention, "database is locked" after the busy timeout).
"""

from __future__ import annotations

import fcntl
import multiprocessing
import os
from pathlib import Path

import pytest
import sqlalchemy as sa

from webapi.db import create_engine

ROUNDS = 150


def _increment(url: str, rounds: int, start: multiprocessing.synchronize.Event) -> None:
    engine = create_engine(url)
    start.wait()
    for _ in range(rounds):
        with engine.begin() as connection:  # BEGIN IMMEDIATE: read, then write
            value = connection.execute(sa.text("SELECT n FROM counter")).scalar_one()
            connection.execute(sa.text("UPDATE counter SET n = :n"), {"n": value + 1})
    engine.dispose()


def _hold_write(
    url: str, held: multiprocessing.synchronize.Event, release: multiprocessing.synchronize.Event
) -> None:
    engine = create_engine(url)
    with engine.begin() as connection:
        connection.execute(sa.text("UPDATE counter SET n = n + 1"))
        held.set()
        release.wait(30)
    engine.dispose()


@pytest.fixture
def url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'jobs.db'}"
    engine = create_engine(url)
    with engine.begin() as connection:
        connection.execute(sa.text("CREATE TABLE counter (n INTEGER NOT NULL)"))
        connection.execute(sa.text("INSERT INTO counter VALUES (0)"))
    engine.dispose()
    return url


def test_a_write_transaction_holds_the_writer_file_lock(url: str, tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    held, release = context.Event(), context.Event()
    holder = context.Process(target=_hold_write, args=(url, held, release))
    holder.start()
    try:
        assert held.wait(60), "the holder never began its transaction"
        fd = os.open(tmp_path / "jobs.db.writer", os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            release.set()
            holder.join(30)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free once it committed
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
    finally:
        release.set()
        holder.join(30)
        if holder.is_alive():
            holder.kill()
    assert holder.exitcode == 0


def test_processes_writing_one_file_never_lose_an_update(url: str) -> None:
    context = multiprocessing.get_context("spawn")
    start = context.Event()
    workers = [context.Process(target=_increment, args=(url, ROUNDS, start)) for _ in range(3)]
    for worker in workers:
        worker.start()
    start.set()
    for worker in workers:
        worker.join(120)
    assert [worker.exitcode for worker in workers] == [0, 0, 0]
    engine = create_engine(url)
    with engine.connect() as connection:
        assert connection.execute(sa.text("SELECT n FROM counter")).scalar_one() == 3 * ROUNDS
    engine.dispose()
