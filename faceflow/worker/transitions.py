"""State proposals that carry a transition id every worker derives alike: a run's claims.

Prefect's clients give every state proposal a fresh ``transition_id``; its
``PreventDuplicateTransitions`` rule refuses a proposal whose id is that of the run's
current state. A worker's ``Pending`` and a child's claiming ``Running`` of one run at one
run count carry the same id (``claim_transition``), so while a claim is the run's state
every other worker's claim of it is refused: two claims on start cannot both be accepted
while the run is ``Scheduled``, and the ``Pending`` one worker proposes to hold a run ahead
for a busy child shuts out another worker's claim on start until that child's engine
proposes ``Running`` (with a fresh id). A claim accepted after that, or after the run
ended, is caught by the child that made it (``run_start.first_start``). Each claim's
message is its own, so a claimant tells its own claim (an answer lost and the request sent
again) from another's.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from typing import Any
from uuid import UUID

CLAIM_NAMESPACE = uuid.UUID("5f0c3a52-7c1e-4c8e-9a59-6d2f0b1e4f7a")
"""The namespace of claims' transition ids: uuid5 of the run and its run count."""


def claim_transition(flow_run_id: UUID | str, run_count: int) -> str:
    """The transition id of every claim of ``flow_run_id`` at ``run_count``."""
    return str(uuid.uuid5(CLAIM_NAMESPACE, f"{flow_run_id}/{run_count}"))


def state_body(flow_run_id: UUID, state: Any, transition_id: str, *, force: bool) -> dict[str, Any]:
    """The body of ``POST /flow_runs/{id}/set_state`` proposing ``state`` with
    ``transition_id``, as Prefect's client sends it (prefect/client/orchestration/
    _flow_runs/client.py, 3.9.1) but for the id."""
    from prefect.states import to_state_create

    state_create = to_state_create(state)
    state_create.state_details.flow_run_id = flow_run_id
    state_create.state_details.transition_id = UUID(transition_id)
    return {"state": state_create.model_dump(mode="json", serialize_as_any=True), "force": force}


SET_STATE_PATH = "/flow_runs/{id}/set_state"


def propose_shared(
    client: Any, flow_run_id: UUID, state: Any, transition_id: str, *, force: bool = False
) -> Any:
    """Prefect's ``OrchestrationResult`` for ``state`` proposed with ``transition_id``
    through Prefect's sync client (whose own ``set_flow_run_state`` gives every proposal a
    fresh id)."""
    body = state_body(flow_run_id, state, transition_id, force=force)
    with _not_found_raised():
        response = client.request(
            "POST", SET_STATE_PATH, path_params={"id": flow_run_id}, json=body
        )
    return _orchestration_result(response)


class SharedTransition:
    """Prefect's async client as ``propose_state`` uses it, proposing with one transition id."""

    def __init__(self, client: Any, transition_id: str) -> None:
        self.client = client
        self.transition_id = transition_id

    async def set_flow_run_state(self, flow_run_id: UUID, state: Any, force: bool = False) -> Any:
        """Prefect's ``OrchestrationResult`` for ``state`` proposed with the shared id."""
        body = state_body(flow_run_id, state, self.transition_id, force=force)
        with _not_found_raised():
            response = await self.client.request(
                "POST", SET_STATE_PATH, path_params={"id": flow_run_id}, json=body
            )
        return _orchestration_result(response)


@contextlib.contextmanager
def _not_found_raised() -> Iterator[None]:
    """A 404 answer as Prefect's clients raise it: ``ObjectNotFound``."""
    import httpx
    from prefect.exceptions import ObjectNotFound

    try:
        yield
    except httpx.HTTPStatusError as exc:
        if exc.response.status_code == 404:
            raise ObjectNotFound(http_exc=exc) from exc
        raise


def _orchestration_result(response: Any) -> Any:
    from prefect.client.schemas import OrchestrationResult

    return OrchestrationResult.model_validate(response.json())
