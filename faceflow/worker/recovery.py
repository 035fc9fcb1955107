"""What a ``faceflow-gpu`` worker does at start with the runs its dead predecessor claimed.

The claim journal (``claims.ClaimJournal``) names them; ``open_journal`` takes the
journal of the worker's identity and ``recover_claims`` ends each run Prefect still shows
as claimed: back to ``Scheduled`` if no child ever had it, ``Crashed`` (``[worker_lost]``)
if one did, ``Cancelled`` if a cancellation was under way; final runs are left alone.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefect.exceptions import ObjectNotFound
from prefect.states import Cancelled, Crashed, Scheduled

from faceflow.worker.claims import Claim, ClaimJournal, identity_slug, kill_stray_child
from tasks.error_codes import JobErrorCode

if TYPE_CHECKING:
    from prefect.client.orchestration import PrefectClient
    from prefect.client.schemas.objects import State

    Logger = logging.Logger | logging.LoggerAdapter[Any]

LOST_CODE = JobErrorCode.worker_lost
RECOVER_RETRY_S = 2.0
"""How long (s) the recovery waits before it tries the runs it could not end again."""


def open_journal(
    state_dir: Path, pool: str, worker: str, *, recover: bool, logger: Logger
) -> tuple[ClaimJournal | None, list[Claim]]:
    """Take the claim journal of ``worker`` on ``pool``: the journal (None when it cannot
    be had) and the claims a dead predecessor left (none unless ``recover``)."""
    journal = ClaimJournal(state_dir, identity_slug(pool, worker))
    try:
        left = journal.acquire()
    except OSError as exc:
        logger.warning("no claim journal (%s): runs are not recovered on restart", exc)
        return None, []
    if left is None:
        logger.warning(
            "Another live worker holds the identity %r (pool %r): this one neither "
            "journals nor recovers runs; give each worker its own --name.",
            worker,
            pool,
        )
        return None, []
    if not recover:
        return journal, []
    for claim in left:  # kept until handled: a crash now leaves them for the next start
        journal.keep(claim)
    return journal, left


async def recover_claims(
    client: PrefectClient,
    journal: ClaimJournal,
    left: list[Claim],
    worker: str,
    logger: Logger,
) -> None:
    """End the runs in ``left`` (``recover_run``), each struck from ``journal`` once done,
    trying the others again every ``RECOVER_RETRY_S`` while Prefect is unreachable."""
    pending = list(left)
    while pending:
        retry = []
        for claim in pending:
            try:
                await recover_run(client, claim, worker, logger)
            except Exception as exc:
                logger.debug("could not recover flow run %s: %s", claim.flow_run_id, exc)
                retry.append(claim)
                continue
            journal.remove(claim.flow_run_id)
        pending = retry
        if pending:
            await asyncio.sleep(RECOVER_RETRY_S)


async def recover_run(client: PrefectClient, claim: Claim, worker: str, logger: Logger) -> None:
    """One run the previous incarnation of ``worker`` had claimed and never ended: back to
    Scheduled if no child ever had it, ``Crashed`` (``[worker_lost]``) if one did,
    ``Cancelled`` if a cancellation was under way; final runs are left alone."""
    if kill_stray_child(claim):
        logger.warning("Killed the dead worker's child pid %s.", claim.child_pid)
    try:
        run = await client.read_flow_run(uuid.UUID(claim.flow_run_id))
    except (ObjectNotFound, ValueError):
        return
    state = run.state
    if state is None or state.is_final() or state.is_scheduled() or state.is_paused():
        return
    new: State[Any]
    if state.is_cancelling():
        new = Cancelled(message="Cancelled: the faceflow-gpu worker running it died.")
    elif state.is_pending() and not claim.child_pid:
        new = Scheduled(
            message=f"Rescheduled by the faceflow-gpu worker {worker!r}: its previous "
            "incarnation died before the run reached a child."
        )
    else:
        new = Crashed(
            message=f"[{LOST_CODE}] The faceflow-gpu worker {worker!r} died during the "
            f"run (child pid {claim.child_pid or 'none'}); found by its restart."
        )
    await client.set_flow_run_state(run.id, new, force=True)
    logger.warning(
        "Flow run %s was %s when this worker's previous incarnation died: now %s.",
        run.id,
        state.type.value,
        new.type.value,
    )
