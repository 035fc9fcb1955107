"""Job ends told to the requests that wait for them (``Prefer: wait``), without a poll.

``jobstate.transition`` marks each job it moves to a terminal status on the session
(``mark_ended``); when that transaction commits, the jobs are announced to every waiter of
this process (``JOB_ENDS``); a rollback drops them. Across processes (several API
replicas, or the relay run as its own service) PostgreSQL carries them: the same
transaction sends ``NOTIFY faceflow_job_ended, '<job id>'`` (delivered at commit, dropped
on rollback), and each API process's ``EndListener`` thread ``LISTEN``s and announces
them locally. A waiter still reads the job store every ``wait_poll_seconds`` as the safety
net (a lost listener connection, SQLite with an out-of-process relay).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import Iterable

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlmodel import Session

log = logging.getLogger(__name__)

CHANNEL = "faceflow_job_ended"
_ENDED = "faceflow_jobs_ended"  # Session.info key: job ids ended in this transaction


class JobEnds:
    """Waiters by job id, woken from any thread when their job ends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: dict[uuid.UUID, set[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = {}

    async def wait(self, job_id: uuid.UUID, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for ``job_id`` to be announced; whether it was."""
        waiter = (asyncio.get_running_loop(), asyncio.Event())
        with self._lock:
            self._waiters.setdefault(job_id, set()).add(waiter)
        try:
            await asyncio.wait_for(waiter[1].wait(), timeout=max(0.0, timeout_s))
            return True
        except TimeoutError:
            return False
        finally:
            with self._lock:
                waiters = self._waiters.get(job_id)
                if waiters is not None:
                    waiters.discard(waiter)
                    if not waiters:
                        del self._waiters[job_id]

    def announce(self, job_ids: Iterable[uuid.UUID]) -> None:
        """Wake every waiter of ``job_ids`` (thread-safe; unknown ids are ignored)."""
        with self._lock:
            woken = [w for job_id in job_ids for w in self._waiters.get(job_id, ())]
        for loop, ended in woken:
            try:
                loop.call_soon_threadsafe(ended.set)
            except RuntimeError:  # its loop closed: the request is gone
                pass

    @property
    def waiting(self) -> int:
        """Jobs waited for now."""
        with self._lock:
            return len(self._waiters)


JOB_ENDS = JobEnds()


def mark_ended(session: Session, job_id: uuid.UUID) -> None:
    """Announce ``job_id`` when ``session``'s transaction commits (and, on PostgreSQL, to
    the other processes: a ``NOTIFY`` in the same transaction)."""
    session.info.setdefault(_ENDED, set()).add(job_id)
    if session.get_bind().dialect.name == "postgresql":
        session.execute(sa.select(sa.func.pg_notify(CHANNEL, str(job_id))))


@event.listens_for(Session, "after_commit")
def _announce_committed(session: Session) -> None:
    ended = session.info.pop(_ENDED, None)
    if ended:
        JOB_ENDS.announce(ended)


@event.listens_for(Session, "after_rollback")
def _forget_rolled_back(session: Session) -> None:
    session.info.pop(_ENDED, None)


class EndListener:
    """``LISTEN faceflow_job_ended`` on PostgreSQL in a daemon thread, announcing each job
    to ``JOB_ENDS``; reconnects with backoff until ``stop``."""

    def __init__(self, database_url: str, ends: JobEnds = JOB_ENDS) -> None:
        url = make_url(database_url).set(drivername="postgresql")
        self._dsn = url.render_as_string(hide_password=False)
        self._ends = ends
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.listening = threading.Event()

    @staticmethod
    def wanted(database_url: str) -> bool:
        """Whether ``database_url`` is PostgreSQL (the only store that carries NOTIFY)."""
        return make_url(database_url).get_backend_name() == "postgresql"

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="faceflow-job-ends", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        import psycopg

        backoff = 0.5
        while not self._stop.is_set():
            try:
                with psycopg.connect(self._dsn, autocommit=True, connect_timeout=5) as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    self.listening.set()
                    backoff = 0.5
                    while not self._stop.is_set():
                        for note in conn.notifies(timeout=1.0):
                            self._announce(note.payload)
            except psycopg.Error as exc:
                log.warning("job-end listener: %s; waiters fall back to polling", exc)
            finally:
                self.listening.clear()
            self._stop.wait(backoff)
            backoff = min(backoff * 2, 10.0)

    def _announce(self, payload: str) -> None:
        try:
            self._ends.announce([uuid.UUID(payload)])
        except ValueError:
            log.warning("job-end listener: not a job id: %r", payload)
