"""dispatch: due ``dispatch`` outbox rows → one Prefect flow run per job attempt.

Dispatch leases only rows whose job has its inputs in storage (``runs.INPUTS_STORED``):
inputs given as URLs are fetched, validated and stored before, off this pass, by the fetch
lane (``webapi.relay.fetch_lane``), so a slow input server never delays a dispatch. For
each leased row the flow run is created with idempotency key ``job-<id>-attempt-<n>`` (a
repeat returns the same run), and its id is written to the job — still ``queued`` until
the run starts — together with closing the row, in one transaction conditional on the
job being queued with no run. While Prefect is unreachable the job stays queued: the first
failed call defers the row (exponential backoff, jitter, capped) and the rest of the
claimed batch untried, and dispatch pauses until Prefect's health check answers, which
makes the deferred rows due at once (``webapi.relay.outage``). A permanent refusal fails
the job with ``dispatch_rejected``. A ``high`` job's run goes to the GPU pool's priority
work queue (``settings.priority_work_queue``), which workers take first; others go to the
deployment's own queue (``default`` in prefect.yaml). With batching on, the pass is
``webapi.relay.batches``'s; both create and record runs through ``webapi.relay.runs``.
"""

from __future__ import annotations

import logging

from webapi.models import Outbox
from webapi.relay import batches, outage, runs
from webapi.relay.context import Relay

log = logging.getLogger(__name__)


def run_once(relay: Relay) -> int:
    """Lease due dispatch rows and process each; returns how many rows were handled.

    Once Prefect is found unreachable the rest of the batch is deferred untried, and later
    passes only probe Prefect's health until it answers (``webapi.relay.outage``)."""
    if relay.outage.active and not prefect_back(relay):
        return 0
    if relay.settings.batching:
        return batches.run_once(relay)
    return runs.until_prefect_down(relay, claim_due(relay), dispatch_row)


def prefect_back(relay: Relay) -> bool:
    """In an outage: probe Prefect's health when due; once it answers, make the deferred
    dispatch and cancel rows due now and leave the outage. Whether dispatch may go on."""
    state, t = relay.outage, relay.timings
    if not state.probe_due():
        return False
    if not relay.prefect.health():
        state.probe_failed(probe_s=t.prefect_probe_interval_s, cap_s=t.dispatch_backoff_cap_s)
        return False
    with relay.session() as session:
        due = outage.make_due(session)
        session.commit()
    lasted = state.end()
    log.info(
        "Prefect reachable again: dispatch resumed",
        extra={"rows_due": due, "outage_s": round(lasted, 1)},
    )
    return True


def claim_due(relay: Relay) -> list[Outbox]:
    """Lease due dispatch rows of jobs whose inputs are stored, for
    ``timings.dispatch_lease_s`` (short: see RelayTimings)."""
    return relay.claim(
        "dispatch", lease_s=relay.timings.dispatch_lease_s, job_filter=runs.INPUTS_STORED
    )


def dispatch_row(relay: Relay, row: Outbox) -> bool:
    """Create the flow run of one leased dispatch row and record it on the job.

    Returns False when Prefect was unreachable (the row is deferred and this replica is in
    outage mode: the caller defers the rest of its batch untried), else True."""
    plan = runs.plan_row(relay, row)
    if plan is None:
        return True
    plan = runs.ready(relay, row, plan)
    if plan is None:
        return True
    return runs.send_single(relay, row, plan)
