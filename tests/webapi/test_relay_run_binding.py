"""A flow run cannot be forged or redirected: the relay against a real Prefect server, the
real ``fuse-faces`` and ``fuse-batch`` flows run in-process (as a worker runs them) on real
storage, on SQLite and PostgreSQL job stores.

- a scheduled run whose parameters another API client PATCHed (another user's input key,
  or job variables that choose the signing keys) is refused with ``run_binding_invalid``
  before any input is read; in a batch, only the tampered job;
- a state forced over the API (``FAILED "[content_blocked] x"``, ``CANCELLED``,
  ``COMPLETED``) decides nothing: the run is lost, re-dispatched, then failed
  ``worker_lost``; a failure recorded by a run the job does not hold is not the job's;
- a genuine failure (no face) still reaches the job with its code, single and batched;
- a run signed with the previous key is accepted during a rotation, a retired key is not.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from faceflow.testing.jobs import make_user, new_job, outbox_of
from faceflow.testing.prefect import PrefectServer
from faceflow.testing.relay import execute_run, job, submit
from flows.binding import PREVIOUS_KEYS_ENV, SIGNING_KEY_ENV
from flows.params import JobFailure, result_error_key, result_meta_key
from tests.samples import astronaut_jpeg_bytes, no_face_jpeg_bytes
from webapi import crud
from webapi.inputs import store_image
from webapi.models import Job, JobStatus
from webapi.relay import dispatch, sync
from webapi.relay.context import Relay

pytestmark = [pytest.mark.prefect, pytest.mark.slow]

BINDING = "run_binding_invalid"


@pytest.fixture
def relay(flow_relays: Callable[..., Relay]) -> Relay:
    """One ``fuse-faces`` run per job; storage shared with the flows' storage block."""
    return flow_relays()


@pytest.fixture
def owner(relay: Relay) -> crud.NewUser:
    return make_user(relay.engine, relay.settings, quota=100)


def _faceless(relay: Relay, owner: crud.NewUser) -> Job:
    """A job whose source and target photos have no face (a coffee cup): the real flow
    fails it at detection, fast."""
    cup = store_image(
        no_face_jpeg_bytes(), name="source", limits=relay.settings.image_limits, store=relay.store
    )
    return new_job(relay.engine, relay.settings, owner, source=cup, target=cup)


def _dispatched(relay: Relay, new: Job) -> str:
    """Dispatch ``new``; the id of its (Scheduled) flow run."""
    dispatch.run_once(relay)
    run_id = job(relay.engine, new.id).flow_run_id
    assert run_id is not None
    return str(run_id)


def _patch(server: PrefectServer, run_id: str, **body: Any) -> None:
    """Change a scheduled run as any client of the Prefect API can."""
    response = httpx.patch(f"{server.api_url}/flow_runs/{run_id}", json=body, timeout=10)
    assert response.status_code == 204, response.text


def _fuse(run_id: str) -> str:
    from flows.fuse import fuse_faces

    return execute_run(run_id, fuse_faces)


def _failed_with(relay: Relay, job_id: uuid.UUID) -> tuple[JobStatus, str | None]:
    stored = job(relay.engine, job_id)
    return stored.status, stored.error_code


# --------------------------------------------------------------------------- forged parameters


def test_a_run_patched_to_another_users_input_is_refused(
    relay: Relay, owner: crud.NewUser, prefect_server: PrefectServer
) -> None:
    victim = make_user(relay.engine, relay.settings, quota=10)
    private = store_image(
        astronaut_jpeg_bytes(), name="source", limits=relay.settings.image_limits, store=relay.store
    )
    theirs = new_job(relay.engine, relay.settings, victim, source=private, target=private)
    mine = submit(relay.engine, relay.settings, relay.store, owner)
    run_id = _dispatched(relay, mine)
    parameters = prefect_server.rest.run(run_id)["parameters"]
    assert parameters["binding"].startswith("v2=")
    _patch(prefect_server, run_id, parameters={**parameters, "source_key": theirs.source_key})
    assert prefect_server.rest.run(run_id)["parameters"]["source_key"] == theirs.source_key

    assert _fuse(run_id) == "FAILED"
    sync.run_once(relay)

    assert _failed_with(relay, mine.id) == (JobStatus.failed, BINDING)
    assert job(relay.engine, mine.id).result_key is None
    assert not relay.store.exists(result_meta_key(str(mine.id), 1))
    failure = JobFailure.model_validate_json(relay.store.get(result_error_key(str(mine.id), 1)))
    assert (failure.code, failure.retryable, failure.flow_run_id) == (BINDING, False, run_id)
    assert failure.stage is None  # refused before any stage loaded anything


def test_job_variables_that_choose_the_keys_are_refused(
    relay: Relay, owner: crud.NewUser, prefect_server: PrefectServer
) -> None:
    """A client that may change runs cannot hand the flow a key of its own choosing through
    the run's environment, even with parameters signed under that key."""
    from flows.binding import signed_parameters

    mine = submit(relay.engine, relay.settings, relay.store, owner)
    run_id = _dispatched(relay, mine)
    parameters = prefect_server.rest.run(run_id)["parameters"]
    forged = signed_parameters({**parameters, "source_key": "inputs/00/other.jpg"}, "chosen")
    _patch(
        prefect_server,
        run_id,
        parameters=forged,
        job_variables={"env": {SIGNING_KEY_ENV: "chosen"}},
    )
    assert _fuse(run_id) == "FAILED"
    sync.run_once(relay)
    assert _failed_with(relay, mine.id) == (JobStatus.failed, BINDING)


# --------------------------------------------------------------------------- forged states


@pytest.mark.parametrize(
    ("state", "message"),
    [("FAILED", "[content_blocked] x"), ("CANCELLED", None), ("COMPLETED", None)],
)
def test_a_state_forced_over_the_api_is_a_lost_run(
    relay: Relay,
    owner: crud.NewUser,
    prefect_server: PrefectServer,
    state: str,
    message: str | None,
) -> None:
    new = submit(relay.engine, relay.settings, relay.store, owner)
    first = _dispatched(relay, new)
    prefect_server.rest.set_state(first, state, message)
    assert sync.run_once(relay) == 1

    requeued = job(relay.engine, new.id)
    assert (requeued.status, requeued.error_code, requeued.flow_run_id) == (
        JobStatus.queued,
        None,
        None,
    )
    kinds = [(row.kind, row.payload.get("attempt")) for row in outbox_of(relay.engine, new.id)]
    assert ("dispatch", 2) in kinds

    second = _dispatched(relay, new)  # attempts are capped (2): the next one fails the job
    assert second != first
    prefect_server.rest.set_state(second, state, message)
    sync.run_once(relay)
    assert _failed_with(relay, new.id) == (JobStatus.failed, "worker_lost")


def test_a_failure_recorded_by_another_run_is_not_the_jobs(
    relay: Relay, owner: crud.NewUser, prefect_server: PrefectServer
) -> None:
    """A run created over the API with a victim job's id and attempt is refused, and the
    failure it records for that attempt is ignored: it is not the run the job holds."""
    new = submit(relay.engine, relay.settings, relay.store, owner)
    held = _dispatched(relay, new)
    parameters = {**prefect_server.rest.run(held)["parameters"], "source_key": "inputs/00/x.jpg"}
    deployment = prefect_server.rest.run(held)["deployment_id"]
    created = httpx.post(
        f"{prefect_server.api_url}/deployments/{deployment}/create_flow_run",
        json={"parameters": parameters, "name": "forged"},
        timeout=10,
    )
    assert created.status_code == 201, created.text
    forged = str(created.json()["id"])
    assert _fuse(forged) == "FAILED"
    record = JobFailure.model_validate_json(relay.store.get(result_error_key(str(new.id), 1)))
    assert (record.code, record.flow_run_id) == (BINDING, forged)

    sync.run_once(relay)
    assert job(relay.engine, new.id).status is JobStatus.queued  # its own run: Scheduled
    prefect_server.rest.set_state(held, "FAILED", f"[{BINDING}] forged")
    sync.run_once(relay)
    lost = job(relay.engine, new.id)
    assert (lost.status, lost.error_code, lost.flow_run_id) == (JobStatus.queued, None, None)


# --------------------------------------------------------------------------- genuine outcomes


def test_a_genuine_failure_reaches_the_job(
    relay: Relay, owner: crud.NewUser, prefect_server: PrefectServer
) -> None:
    faceless = _faceless(relay, owner)
    run_id = _dispatched(relay, faceless)
    assert _fuse(run_id) == "FAILED"
    sync.run_once(relay)
    assert _failed_with(relay, faceless.id) == (JobStatus.failed, "no_face_found")
    stored = job(relay.engine, faceless.id)
    assert stored.attempts == 1 and stored.error_message == "No face was found in the image."


def test_a_batch_refuses_only_the_tampered_job(
    flow_relays: Callable[..., Relay], prefect_server: PrefectServer
) -> None:
    """Two jobs in one ``fuse-batch`` run; another client points the first at someone
    else's input. The first is refused, the second (no face) fails with its own code."""
    from flows.batch import fuse_batch

    relay = flow_relays(batch_max_jobs=8, batch_ahead_linger_ms=0)
    owner = make_user(relay.engine, relay.settings, quota=100)
    tampered = _faceless(relay, owner)
    faceless = _faceless(relay, owner)
    run_id = _dispatched(relay, tampered)
    assert str(job(relay.engine, faceless.id).flow_run_id) == run_id  # one batch run
    parameters = prefect_server.rest.run(run_id)["parameters"]
    jobs = parameters["jobs"]
    assert all(entry["binding"].startswith("v2=") for entry in jobs)
    index = [entry["job_id"] for entry in jobs].index(str(tampered.id))
    jobs[index] = {**jobs[index], "target_key": "inputs/00/someone-elses.jpg"}
    _patch(prefect_server, run_id, parameters={**parameters, "jobs": jobs})

    assert execute_run(run_id, fuse_batch) == "COMPLETED"
    sync.run_once(relay)
    assert _failed_with(relay, tampered.id) == (JobStatus.failed, BINDING)
    assert _failed_with(relay, faceless.id) == (JobStatus.failed, "no_face_found")


# --------------------------------------------------------------------------- rotation


def test_a_run_signed_with_the_previous_key_is_accepted_during_a_rotation(
    relay: Relay, owner: crud.NewUser, monkeypatch: pytest.MonkeyPatch
) -> None:
    relay.settings = relay.settings.model_copy(update={"run_signing_key": SecretStr("old-key")})
    signed_old = _faceless(relay, owner)
    old_run = _dispatched(relay, signed_old)
    retired = _faceless(relay, owner)
    retired_run = _dispatched(relay, retired)

    monkeypatch.setenv(SIGNING_KEY_ENV, "new-key")  # the workers rotated first
    monkeypatch.setenv(PREVIOUS_KEYS_ENV, "old-key")
    assert _fuse(old_run) == "FAILED"
    monkeypatch.delenv(PREVIOUS_KEYS_ENV)  # the grace period is over
    assert _fuse(retired_run) == "FAILED"
    sync.run_once(relay)

    assert _failed_with(relay, signed_old.id) == (JobStatus.failed, "no_face_found")
    assert _failed_with(relay, retired.id) == (JobStatus.failed, BINDING)
