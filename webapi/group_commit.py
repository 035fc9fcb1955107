"""Group commit of submits: one thread admits waiting submissions together.

Under load, many requests wait for the job store's write lock (SQLite) or the backlog lock
(PostgreSQL) only to run the same few statements each. ``GroupCommit`` keeps one thread
per app that takes every submission waiting at that moment (up to ``max_batch``) and
admits them in one transaction with ``crud.submit_jobs``: one backlog count, one quota count per
owner, one insert per table, one commit. A submission alone is admitted at once (nothing
waits to fill a batch), and each caller gets its answer only after the commit that holds
its job (invariant 1).
"""

from __future__ import annotations

import logging
import queue
import threading
import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from sqlalchemy.engine import Engine
from sqlmodel import Session

from webapi import crud
from webapi.config import Settings
from webapi.models import WebhookDelivery
from webapi.storage import ObjectStore

log = logging.getLogger(__name__)

DEFAULT_MAX_BATCH = 64


@dataclass(frozen=True)
class Admitted:
    """A submission's admission and, for a replay, the job's webhook deliveries so far."""

    admission: crud.Admission
    callbacks: Sequence[WebhookDelivery] = field(default_factory=tuple)


class GroupCommit:
    """Admits submissions in groups, one transaction each, on one daemon thread (started
    on first use)."""

    def __init__(
        self,
        engine: Engine,
        settings: Settings,
        *,
        store: ObjectStore | None = None,
        max_batch: int = DEFAULT_MAX_BATCH,
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.store = store
        self.max_batch = max_batch
        self._queue: queue.SimpleQueue[tuple[crud.Submission, Future[Admitted]] | None] = (
            queue.SimpleQueue()
        )
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.batches = 0
        self.admitted = 0

    def submit(self, submission: crud.Submission) -> Future[Admitted]:
        """Queue ``submission``; the future resolves after its transaction ends."""
        future: Future[Admitted] = Future()
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="faceflow-group-commit", daemon=True
                )
                self._thread.start()
        self._queue.put((submission, future))
        return future

    def close(self, timeout_s: float = 10.0) -> None:
        """Admit what is queued, then stop the thread (a later submit starts a new one)."""
        with self._lock:
            thread, self._thread = self._thread, None
            if thread is not None:
                self._queue.put(None)
        if thread is not None:
            thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            batch = [item]
            stop = False
            while len(batch) < self.max_batch:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                batch.append(more)
            self._commit(batch)
            if stop:
                return

    def _commit(self, batch: list[tuple[crud.Submission, Future[Admitted]]]) -> None:
        try:
            with Session(self.engine, expire_on_commit=False) as session:
                admissions = crud.submit_jobs(
                    session,
                    submissions=[submission for submission, _ in batch],
                    settings=self.settings,
                    store=self.store,
                )
                replayed: list[uuid.UUID] = [
                    a.job.id for a in admissions if a.job is not None and not a.created
                ]
                callbacks = crud.callbacks_for(session, job_ids=replayed) if replayed else {}
                session.commit()
        except Exception as exc:  # the database failed: every caller of this batch hears it
            log.warning("admitting %d submissions failed: %r", len(batch), exc)
            for _, future in batch:
                future.set_exception(exc)
            return
        self.batches += 1
        self.admitted += len(batch)
        for (_, future), admission in zip(batch, admissions, strict=True):
            job = admission.job
            future.set_result(
                Admitted(admission, callbacks.get(job.id, ()) if job is not None else ())
            )
