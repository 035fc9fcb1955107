"""A small typed client for the parts of the Prefect REST API the relay uses.

Plain ``httpx`` (synchronous: the relay loops run in a background thread), never
``import prefect``: the webapi stays light. Failures are typed: ``PrefectUnavailable``
(transient: 5xx, 503, dropped connections, timeouts, a deployment not created yet; its
``PrefectAuthRefused`` for 401 and 403: the credential is missing or wrong) and
``PrefectRejected`` (permanent: the server refused the request itself, e.g. a 409 schema
error on the parameters).
"""

from __future__ import annotations

import base64
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import httpx

from flows.params import (
    BATCH_DEPLOYMENT_NAME,
    BATCH_FLOW_NAME,
    DEPLOYMENT_NAME,
    FLOW_NAME,
    FuseBatchParams,
    FuseFacesParams,
    JobAttempt,
    batch_run_name,
    batch_tags,
    idempotency_key,
    run_tags,
)
from tasks.closing import Closing

if TYPE_CHECKING:
    from webapi.config import Settings

FILTER_BATCH = 200  # PREFECT_SERVER_API_DEFAULT_LIMIT: the most runs one filter call returns
# 4xx answers that say "not now" rather than "never": auth being fixed, a deployment
# re-created, rate limits. The job keeps waiting instead of failing.
TRANSIENT_4XX = frozenset({401, 403, 404, 408, 425, 429})
#: Pauses before a 503 is asked again: Prefect answers 503 while its SQLite database is
#: locked by a burst of writes (a run ending), for tens of milliseconds; only then is it an
#: outage (dispatch pauses until /health answers: ``webapi.relay.outage``). Every call the
#: relay makes may be repeated: runs are created with idempotency keys, and a 503 changed
#: nothing. Prefect's own client retries 503s the same way.
BUSY_RETRIES_S = (0.05, 0.15)


MAPPING_INPUTS = ("extra_source_keys", "reference_keys")


def sent_parameters(params: JobAttempt) -> dict[str, Any]:
    """A job attempt's flow parameters as sent: only the options the client set (the flow
    takes the rest from its settings block), and a per-face mapping's extra image keys only
    when there are some (so a flow deployed before them still accepts every other job)."""
    sent = {**params.model_dump(mode="json"), "options": params.options.as_sent()}
    for name in MAPPING_INPUTS:
        if not sent.get(name):
            sent.pop(name, None)
    return sent


def auth_headers(*, auth_string: str | None = None, api_key: str | None = None) -> dict[str, str]:
    """The ``Authorization`` header Prefect's own client sends: HTTP basic auth with a
    self-hosted server's auth string (``PREFECT_API_AUTH_STRING``, ``user:password``),
    else a Prefect Cloud API key as a bearer token; no header without either."""
    if auth_string:
        token = base64.b64encode(auth_string.encode("utf-8")).decode("ascii")
        return {"Authorization": f"Basic {token}"}
    if api_key:
        return {"Authorization": f"Bearer {api_key}"}
    return {}


class PrefectError(Exception):
    """Base of every error this client raises."""


class PrefectUnavailable(PrefectError):
    """The Prefect API could not be reached or answered with a transient error: retry later."""


class PrefectAuthRefused(PrefectUnavailable):
    """The Prefect API answered 401 or 403: this client's credential is missing or not the
    server's. Transient for the jobs (they wait while an operator fixes it)."""


class PrefectRejected(PrefectError):
    """The Prefect API refused the request itself: retrying the same request cannot help."""

    def __init__(self, status_code: int, detail: str) -> None:
        self.status_code = status_code
        self.detail = detail
        super().__init__(f"Prefect API answered {status_code}: {detail}")


class StateType(StrEnum):
    """Prefect flow-run state types."""

    SCHEDULED = "SCHEDULED"
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    CRASHED = "CRASHED"
    PAUSED = "PAUSED"
    CANCELLING = "CANCELLING"

    @property
    def is_final(self) -> bool:
        """Whether a run in this state will never change again on its own."""
        return self in FINAL_STATES


FINAL_STATES = frozenset(
    {StateType.COMPLETED, StateType.FAILED, StateType.CANCELLED, StateType.CRASHED}
)
CANCEL_TRIES = 4  # proposals of one cancel (``cancel_flow_run``), each after the run moved on


@dataclass(frozen=True)
class FlowRun:
    """The fields of a Prefect flow run the relay reads."""

    id: str
    name: str
    state_type: StateType
    state_name: str
    state_message: str | None
    state_timestamp: datetime | None
    expected_start_time: datetime | None
    start_time: datetime | None
    idempotency_key: str | None
    tags: tuple[str, ...]
    parameters: dict[str, Any]

    @classmethod
    def from_api(cls, data: dict[str, Any]) -> FlowRun:
        """Build from a ``FlowRunResponse`` JSON object."""
        state = data.get("state") or {}
        return cls(
            id=str(data["id"]),
            name=str(data.get("name") or ""),
            state_type=StateType(state.get("type") or data.get("state_type") or "SCHEDULED"),
            state_name=str(state.get("name") or data.get("state_name") or ""),
            state_message=state.get("message"),
            state_timestamp=_parse_time(state.get("timestamp")),
            expected_start_time=_parse_time(data.get("expected_start_time")),
            start_time=_parse_time(data.get("start_time")),
            idempotency_key=data.get("idempotency_key"),
            tags=tuple(data.get("tags") or ()),
            parameters=dict(data.get("parameters") or {}),
        )


@dataclass(frozen=True)
class SetStateResult:
    """Outcome of ``set_state``: Prefect's orchestration status and the run's state after it."""

    status: str  # ACCEPT, REJECT, ABORT or WAIT
    state_type: StateType | None

    @property
    def accepted(self) -> bool:
        """Whether Prefect applied the requested state."""
        return self.status == "ACCEPT"


def _parse_time(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value.replace("Z", "+00:00")) if value else None


def flow_run_body(
    params: FuseFacesParams,
    *,
    job_variables: dict[str, Any] | None = None,
    work_queue_name: str | None = None,
) -> dict[str, Any]:
    """The ``create_flow_run`` body of one job attempt's run (``PrefectAPI.create_flow_run``)."""
    body: dict[str, Any] = {
        "name": params.job_id,
        # Only the options the client set: the flow takes the rest from its settings block.
        "parameters": sent_parameters(params),
        "idempotency_key": idempotency_key(params.job_id, params.attempt),
        "tags": run_tags(params.job_id, params.owner_id),
        "job_variables": job_variables or {},
    }
    if work_queue_name:
        body["work_queue_name"] = work_queue_name
    return body


class PrefectAPI(Closing):
    """Thread-safe synchronous client for the relay's Prefect REST calls.

    ``api_url`` is the API root, e.g. ``http://127.0.0.1:4200/api`` (``PREFECT_API_URL``);
    ``auth_string`` the server's credential (``PREFECT_API_AUTH_STRING``), ``api_key`` a
    Prefect Cloud key (``auth_headers``). Without the credential an authenticated server
    answers 401, which counts as transient: jobs wait until it is set right.
    """

    def __init__(
        self,
        api_url: str,
        *,
        auth_string: str | None = None,
        api_key: str | None = None,
        timeout: float = 10.0,
        flow_name: str = FLOW_NAME,
        deployment_name: str = DEPLOYMENT_NAME,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        headers = auth_headers(auth_string=auth_string, api_key=api_key)
        self.flow_name = flow_name
        self.deployment_name = deployment_name
        self._http = httpx.Client(
            base_url=api_url.rstrip("/") + "/",
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=min(timeout, 3.0)),
            transport=transport,
        )
        self._deployment_ids: dict[tuple[str, str], str] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings: Settings, *, timeout: float = 10.0) -> PrefectAPI:
        """The relay's client: ``settings.prefect_api_url`` with its auth string, or a
        Prefect Cloud key from ``PREFECT_API_KEY``."""
        auth = settings.prefect_api_auth_string
        return cls(
            settings.prefect_api_url,
            auth_string=auth.get_secret_value() if auth else None,
            api_key=os.environ.get("PREFECT_API_KEY"),
            timeout=timeout,
        )

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    # -- transport ---------------------------------------------------------------------

    def _request(self, method: str, path: str, json: Any = None) -> httpx.Response:
        try:
            response = self._http.request(method, path, json=json)
            for pause in BUSY_RETRIES_S:  # a busy server (SQLite locked): again, shortly
                if response.status_code != 503:
                    break
                time.sleep(pause)
                response = self._http.request(method, path, json=json)
        except httpx.TransportError as exc:  # refused, dropped, timed out
            raise PrefectUnavailable(f"{method} {path}: {type(exc).__name__}: {exc}") from exc
        code = response.status_code
        if code in (401, 403):  # an operator's to fix; the jobs wait meanwhile
            raise PrefectAuthRefused(
                f"{method} {path}: HTTP {code}: the Prefect API refused this client's "
                "credential (PREFECT_API_AUTH_STRING missing or not the server's)"
            )
        if code >= 500 or code in TRANSIENT_4XX:
            raise PrefectUnavailable(f"{method} {path}: HTTP {code}")
        if code >= 400:
            raise PrefectRejected(code, _detail(response))
        return response

    # -- calls -------------------------------------------------------------------------

    def health(self) -> bool:
        """Whether the API answers its health check."""
        try:
            self.check(credential=False)
        except PrefectError:
            return False
        return True

    def check(self, *, credential: bool) -> None:
        """Raise ``PrefectUnavailable`` unless the API answers: its health check, which
        asks no credential, or with ``credential`` a route that asks for one (the server's
        version, as Prefect's own client checks it): ``PrefectAuthRefused`` on 401/403."""
        self._request("GET", "admin/version" if credential else "health")

    def deployment_id(
        self, flow_name: str | None = None, deployment_name: str | None = None
    ) -> str:
        """Id of a deployment (default: ``fuse-faces``), cached after the first lookup.

        A deployment that does not exist yet raises ``PrefectUnavailable`` (jobs wait).
        """
        name = (flow_name or self.flow_name, deployment_name or self.deployment_name)
        with self._lock:
            if name not in self._deployment_ids:
                path = f"deployments/name/{name[0]}/{name[1]}"
                self._deployment_ids[name] = str(self._request("GET", path).json()["id"])
            return self._deployment_ids[name]

    def forget_deployment(self) -> None:
        """Drop the cached deployment ids (after a deployment was re-created)."""
        with self._lock:
            self._deployment_ids.clear()

    def create_flow_run(
        self,
        params: FuseFacesParams,
        *,
        job_variables: dict[str, Any] | None = None,
        work_queue_name: str | None = None,
        deployment: tuple[str, str] | None = None,
    ) -> FlowRun:
        """Create (or find, by idempotency key) the flow run of one job attempt, of the
        ``deployment`` (flow name, deployment name; default ``fuse-faces``).

        Name = job id, tags ``job:<id>`` and ``owner:<id>``, idempotency key
        ``job-<id>-attempt-<n>``: a repeat returns the same run (200 instead of 201).
        ``work_queue_name``: a queue of the deployment's pool (its lane; Prefect creates a
        missing one at the lowest priority), else the deployment's queue.
        """
        body = flow_run_body(params, job_variables=job_variables, work_queue_name=work_queue_name)
        return self._create(self.deployment_id(*(deployment or (None, None))), body)

    def create_batch_run(
        self,
        params: FuseBatchParams,
        *,
        key: str,
        job_variables: dict[str, Any] | None = None,
        work_queue_name: str | None = None,
    ) -> FlowRun:
        """Create (or find, by idempotency key ``key``) the ``fuse-batch`` run of several
        job attempts: named after its first job, tagged with every job's and owner's tag
        (``work_queue_name`` as for ``create_flow_run``)."""
        parameters = params.model_dump(mode="json")
        parameters["jobs"] = [sent_parameters(job) for job in params.jobs]
        body = {
            "name": batch_run_name(params.jobs),
            "parameters": parameters,
            "idempotency_key": key,
            "tags": batch_tags(params.jobs),
            "job_variables": job_variables or {},
        }
        if work_queue_name:
            body["work_queue_name"] = work_queue_name
        return self._create(self.deployment_id(BATCH_FLOW_NAME, BATCH_DEPLOYMENT_NAME), body)

    def _create(self, deployment_id: str, body: dict[str, Any]) -> FlowRun:
        """Create a run of ``deployment_id`` without the server's check of its parameters
        against the deployment's schema (``enforce_parameter_schema``, which ``prefect
        deploy`` turns on): ≈ 40 ms of the server's CPU per run on Prefect as shipped, ≈ 4 ms
        on the stack's server (``faceflow.prefect_schema_cache``), for parameters this client builds from
        the flow's own models and signs (``flows.binding``), and the flow validates them
        again before its first line. Runs created in the UI or the CLI keep the check."""
        body = {**body, "enforce_parameter_schema": False}
        try:
            response = self._request(
                "POST", f"deployments/{deployment_id}/create_flow_run", json=body
            )
        except PrefectUnavailable:
            self.forget_deployment()  # a 404 means the deployment was re-created
            raise
        return FlowRun.from_api(response.json())

    def ensure_work_queue(self, pool: str, name: str, *, priority: int = 1) -> None:
        """Create work queue ``name`` in ``pool`` at ``priority`` (1 = taken first), or move
        an existing one there; Prefect renumbers the pool's other queues behind it."""
        body = {"name": name, "priority": priority}
        try:
            self._request("POST", f"work_pools/{pool}/queues", json=body)
        except PrefectRejected as exc:
            if exc.status_code != 409:
                raise
            self._request("PATCH", f"work_pools/{pool}/queues/{name}", json={"priority": priority})

    def limit_work_queue(self, pool: str, name: str, limit: int) -> None:
        """Let work queue ``name`` of ``pool`` run at most ``limit`` runs at once."""
        self._request(
            "PATCH", f"work_pools/{pool}/queues/{name}", json={"concurrency_limit": limit}
        )

    def cancel_tagged(self, tag: str, *, message: str) -> int:
        """Cancel every flow run tagged ``tag`` that is not final (``cancel_flow_run``);
        how many were asked to stop."""
        body = {
            "flow_runs": {
                "tags": {"all_": [tag]},
                "state": {"type": {"not_any_": [t.value for t in StateType if t.is_final]}},
            },
            "limit": 200,
        }
        found = [FlowRun.from_api(item) for item in self._request(
            "POST", "flow_runs/filter", json=body).json()]  # fmt: skip
        for run in found:
            self.cancel_flow_run(run, message=message)
        return len(found)

    def read_flow_runs(self, ids: Iterable[str]) -> dict[str, FlowRun]:
        """The flow runs with these ids (batched); unknown ids are absent from the result."""
        wanted = sorted(set(ids))
        found: dict[str, FlowRun] = {}
        for start in range(0, len(wanted), FILTER_BATCH):
            batch = wanted[start : start + FILTER_BATCH]
            body = {"flow_runs": {"id": {"any_": batch}}, "limit": len(batch)}
            for item in self._request("POST", "flow_runs/filter", json=body).json():
                run = FlowRun.from_api(item)
                found[run.id] = run
        return found

    def read_progress(self, flow_run_ids: Iterable[str]) -> dict[str, str]:
        """The description of each run's newest progress artifact (the fuse-faces flow
        writes ``Stage i/n: <stage> (attempt k).``), by flow-run id."""
        wanted = sorted(set(flow_run_ids))
        found: dict[str, str] = {}
        for start in range(0, len(wanted), FILTER_BATCH):
            batch = wanted[start : start + FILTER_BATCH]
            body = {
                "artifacts": {"flow_run_id": {"any_": batch}, "type": {"any_": ["progress"]}},
                "sort": "UPDATED_DESC",
                "limit": FILTER_BATCH,
            }
            for item in self._request("POST", "artifacts/filter", json=body).json():
                run_id = str(item.get("flow_run_id") or "")
                if run_id and run_id not in found and item.get("description"):
                    found[run_id] = str(item["description"])
        return found

    def read_flow_run(self, flow_run_id: str) -> FlowRun | None:
        """One flow run, or None when Prefect does not know the id."""
        return self.read_flow_runs([flow_run_id]).get(flow_run_id)

    def set_state(
        self,
        flow_run_id: str,
        state_type: StateType,
        *,
        message: str | None = None,
        force: bool = False,
    ) -> SetStateResult:
        """Propose a new state for a flow run (``force`` skips orchestration rules)."""
        body = {"state": {"type": state_type.value, "message": message}, "force": force}
        data = self._request("POST", f"flow_runs/{flow_run_id}/set_state", json=body).json()
        state = data.get("state") or {}
        return SetStateResult(
            status=str(data.get("status")),
            state_type=StateType(state["type"]) if state.get("type") else None,
        )

    def cancel_flow_run(self, run: FlowRun, *, message: str) -> StateType:
        """Cancel a run; returns the state it is in afterwards.

        ``Cancelling`` is proposed (never forced) and Prefect decides by the run's state
        when the proposal arrives, not by ``run``, which may be stale: a run no worker
        holds (Scheduled, suspended) becomes CANCELLED at once
        (``BypassCancellingFlowRunsWithNoInfra``); a claimed or running one (Pending,
        Running) CANCELLING, which Prefect lets end only as Cancelled, so it cannot start
        any more and the worker that holds it stops its process and makes it CANCELLED (a
        Cancelled run would start anyway: Prefect lets it go back to Running); a run that
        ended meanwhile keeps its end (a forced Cancelling would overwrite it, and no
        worker would ever end it). Already final or cancelling → unchanged.
        """
        state = run.state_type
        for _ in range(CANCEL_TRIES):
            if state.is_final or state is StateType.CANCELLING:
                return state
            result = self.set_state(run.id, StateType.CANCELLING, message=message)
            if result.accepted:
                return StateType.CANCELLING
            current = self.read_flow_run(run.id)  # Cancelled instead, or it moved on
            if current is None:
                return state
            state = current.state_type
        return state


def _detail(response: httpx.Response) -> str:
    try:
        detail = response.json().get("detail", response.text)
    except ValueError:
        detail = response.text
    return str(detail)[:500]
