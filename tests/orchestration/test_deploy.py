"""prefect.yaml, work pools and a process worker against a real ``prefect server start``."""

from __future__ import annotations

import io
import json
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from PIL import Image

from faceflow.supervisor import Service
from faceflow.testing.prefect import PrefectServer
from faceflow.testing.wait import poll
from flows.binding import sign, worker_keys
from flows.params import (
    BATCH_DEPLOYMENT_NAME,
    BATCH_FLOW_NAME,
    DEPLOYMENT_NAME,
    FLOW_NAME,
    VIDEO_ANALYSE_DEPLOYMENT,
    VIDEO_DEPLOYMENT_NAME,
    VIDEO_FLOW_NAME,
    VIDEO_PART_FLOW_NAME,
    VIDEO_RENDER_DEPLOYMENT,
    FuseBatchParams,
    FuseFacesParams,
    JobAttempt,
    ResultRef,
    idempotency_key,
    result_meta_key,
)
from tasks.options import FusionOptions
from tests.orchestration.conftest import BIN, REPO_ROOT, Home
from tests.orchestration.helpers import api, prefect_cli_concurrently
from tests.samples import astronaut_jpeg_bytes, grace_hopper_jpeg_bytes, grace_hopper_rgb
from webapi.prefect_api import PrefectAPI

POOLS = REPO_ROOT / "work_pools"


@pytest.fixture(scope="module")
def deployed(prefect_server: PrefectServer) -> dict[str, dict[str, Any]]:
    """Pools created from work_pools/, then ``prefect --no-prompt deploy --all``."""
    prefect_cli_concurrently(
        prefect_server,
        [
            "work-pool",
            "create",
            "gpu",
            "--type",
            "process",
            "--base-job-template",
            str(POOLS / "gpu-process.json"),
        ],
        ["work-pool", "create", "control", "--type", "process"],
    )
    prefect_cli_concurrently(
        prefect_server,
        ["work-pool", "set-concurrency-limit", "gpu", "1"],
        ["--no-prompt", "deploy", "--all"],
    )
    return {
        name: api(prefect_server, "GET", f"/deployments/name/{name}").json()
        for name in (
            f"{FLOW_NAME}/{DEPLOYMENT_NAME}",
            f"{BATCH_FLOW_NAME}/{BATCH_DEPLOYMENT_NAME}",
            f"{VIDEO_FLOW_NAME}/{VIDEO_DEPLOYMENT_NAME}",
            f"{VIDEO_PART_FLOW_NAME}/{VIDEO_ANALYSE_DEPLOYMENT}",
            f"{VIDEO_PART_FLOW_NAME}/{VIDEO_RENDER_DEPLOYMENT}",
            "reconcile/reconcile",
            "retention/retention",
        )
    }


def webapi_parameters(job_id: str, source_key: str, target_key: str) -> dict[str, Any]:
    """What the relay sends: a ``FuseFacesParams`` dump, options as the caller set them."""
    params = FuseFacesParams(
        job_id=job_id,
        owner_id="owner-7",
        source_key=source_key,
        target_key=target_key,
        options=FusionOptions.model_validate({"output_format": "jpeg", "face": "largest"}),
        deadline_at=datetime.now(UTC) + timedelta(minutes=5),
        attempt=1,
    )
    # Bound to the job as the relay binds it (flows.binding).
    params = params.model_copy(update={"binding": sign(params, worker_keys()[0])})
    dumped = params.model_dump(mode="json")
    dumped["options"] = params.options.model_dump(mode="json", exclude_unset=True)
    return dumped


def create_run(
    server: PrefectServer, deployment: dict[str, Any], body: dict[str, Any]
) -> httpx.Response:
    """POST ``body`` to ``deployment``'s ``create_flow_run`` (through ``api``'s retries)."""
    return api(server, "POST", f"/deployments/{deployment['id']}/create_flow_run", json=body)


def test_deploy_all_creates_the_deployments(deployed: dict[str, dict[str, Any]]) -> None:
    fuse = deployed[f"{FLOW_NAME}/{DEPLOYMENT_NAME}"]
    reconcile = deployed["reconcile/reconcile"]
    assert fuse["work_pool_name"] == "gpu" and reconcile["work_pool_name"] == "control"
    assert fuse["entrypoint"] == "flows/fuse.py:fuse_faces"
    assert reconcile["entrypoint"] == "flows/reconcile.py:reconcile"
    assert fuse["pull_steps"] == [
        {"prefect.deployments.steps.set_working_directory": {"directory": str(REPO_ROOT)}}
    ]
    assert fuse["parameters"]["storage_block"] == "local-file-system/faceflow-storage"
    assert fuse["global_concurrency_limit"] is None  # sized per GPU on the pool instead
    assert [s["schedule"]["interval"] for s in reconcile["schedules"]] == [60.0]
    assert reconcile["global_concurrency_limit"]["limit"] == 1
    assert reconcile["concurrency_options"]["collision_strategy"] == "CANCEL_NEW"
    assert fuse["schedules"] == []
    video = deployed[f"{VIDEO_FLOW_NAME}/{VIDEO_DEPLOYMENT_NAME}"]
    assert video["entrypoint"] == "flows/video.py:fuse_video_flow"
    # the coordinator waits on the control pool; its parts run on the GPU pool's queue
    assert (video["work_pool_name"], video["work_queue_name"]) == ("control", "video")
    assert video["parameters"] == fuse["parameters"]
    for name in (VIDEO_ANALYSE_DEPLOYMENT, VIDEO_RENDER_DEPLOYMENT):
        part = deployed[f"{VIDEO_PART_FLOW_NAME}/{name}"]
        assert part["entrypoint"] == "flows/video_parts.py:fuse_video_part"
        assert (part["work_pool_name"], part["work_queue_name"]) == ("gpu", "video")
        assert part["parameters"]["storage_block"] == fuse["parameters"]["storage_block"]


def test_the_batch_deployment_takes_what_the_relay_sends(
    deployed: dict[str, dict[str, Any]],
) -> None:
    batch = deployed[f"{BATCH_FLOW_NAME}/{BATCH_DEPLOYMENT_NAME}"]
    assert batch["work_pool_name"] == "gpu" and batch["entrypoint"] == "flows/batch.py:fuse_batch"
    assert batch["parameters"]["storage_block"] == "local-file-system/faceflow-storage"
    jobs = [
        JobAttempt.model_validate(
            {
                k: v
                for k, v in webapi_parameters(str(uuid.uuid4()), "a", "b").items()
                if k not in ("storage_block", "settings_block", "signing_block")
            }
        )
        for _ in range(2)
    ]
    params = FuseBatchParams(jobs=jobs, deadline_at=max(j.deadline_at for j in jobs))
    sent = params.model_dump(mode="json")
    for job, dumped in zip(params.jobs, sent["jobs"], strict=True):
        dumped["options"] = job.options.as_sent()
    jsonschema.validate(sent, batch["parameter_openapi_schema"])


def test_parameter_schema_accepts_what_the_webapi_sends(
    prefect_server: PrefectServer, deployed: dict[str, dict[str, Any]]
) -> None:
    fuse = deployed[f"{FLOW_NAME}/{DEPLOYMENT_NAME}"]
    schema = fuse["parameter_openapi_schema"]
    sent = webapi_parameters(str(uuid.uuid4()), "inputs/aa/a.jpg", "inputs/bb/b.jpg")
    jsonschema.validate(sent, schema)
    full = {**sent, "options": FusionOptions().model_dump(mode="json")}
    jsonschema.validate(full, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**sent, "options": {"identity_weight": 5}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({k: v for k, v in sent.items() if k != "job_id"}, schema)

    # The server agrees: it creates the run (then we delete it before a worker sees it).
    created = create_run(
        prefect_server,
        fuse,
        {
            "parameters": sent,
            "idempotency_key": f"schema-check-{uuid.uuid4()}",
            "state": {
                "type": "SCHEDULED",
                "name": "Scheduled",
                "state_details": {"scheduled_time": "2999-01-01T00:00:00Z"},
            },
        },
    )
    assert created.status_code in (200, 201), created.text  # 200: a retried repeat
    assert api(prefect_server, "DELETE", f"/flow_runs/{created.json()['id']}").status_code == 204
    refused = create_run(prefect_server, fuse, {"parameters": {**sent, "attempt": "first"}})
    assert refused.status_code == 409


def test_the_relay_s_runs_skip_the_server_s_schema_check_the_deployment_keeps_it(
    prefect_server: PrefectServer, deployed: dict[str, dict[str, Any]]
) -> None:
    """The relay's client asks the server not to check its (typed, signed) parameters
    against the schema: ≈ 40 ms of server CPU a run on Prefect as shipped. The deployment keeps the check for
    every other client (the UI's and the CLI's runs: refused above with 409)."""
    fuse = deployed[f"{FLOW_NAME}/{DEPLOYMENT_NAME}"]
    assert fuse["enforce_parameter_schema"] is True
    sent = webapi_parameters(str(uuid.uuid4()), "inputs/aa/a.jpg", "inputs/bb/b.jpg")
    never = {"type": "SCHEDULED", "name": "Scheduled",
             "state_details": {"scheduled_time": "2999-01-01T00:00:00Z"}}  # fmt: skip
    with PrefectAPI(prefect_server.api_url) as client:
        # what only the skipped check would refuse: the relay's own client builds none such
        run = client._create(fuse["id"], {"parameters": {**sent, "attempt": "first"},
                                          "state": never})  # fmt: skip
    assert api(prefect_server, "DELETE", f"/flow_runs/{run.id}").status_code == 204


def test_the_stack_s_server_caches_its_schema_checks_and_refuses_as_before(
    prefect_server: PrefectServer, deployed: dict[str, dict[str, Any]]
) -> None:
    """The server runs through ``faceflow.prefect_main`` (each schema checked against the
    meta-schema once: ``faceflow.prefect_schema_cache``); bad job variables and parameters
    are refused on every run, the first and the ones after."""
    (api_pid,) = prefect_server.pids
    assert b"faceflow.prefect_main" in Path(f"/proc/{api_pid}/cmdline").read_bytes().split(b"\0")
    fuse = deployed[f"{FLOW_NAME}/{DEPLOYMENT_NAME}"]
    sent = webapi_parameters(str(uuid.uuid4()), "inputs/aa/a.jpg", "inputs/bb/b.jpg")
    for _ in range(2):
        bad_variables = {"parameters": sent, "job_variables": {"stream_output": "maybe"}}
        assert create_run(prefect_server, fuse, bad_variables).status_code == 422
        bad_parameters = {"parameters": {**sent, "attempt": "first"}}
        assert create_run(prefect_server, fuse, bad_parameters).status_code == 409


def test_retention_is_scheduled_and_priority_runs_go_to_the_priority_queue(
    prefect_server: PrefectServer, deployed: dict[str, dict[str, Any]]
) -> None:
    retention = deployed["retention/retention"]
    assert retention["work_pool_name"] == "control"
    assert retention["entrypoint"] == "flows/retention.py:retention"
    assert [s["schedule"]["interval"] for s in retention["schedules"]] == [300.0]
    assert retention["global_concurrency_limit"]["limit"] == 1

    params = FuseFacesParams(
        job_id=str(uuid.uuid4()),
        owner_id="owner-7",
        source_key="inputs/aa/a.jpg",
        target_key="inputs/bb/b.jpg",
        deadline_at=datetime.now(UTC) + timedelta(minutes=5),
    )
    with PrefectAPI(prefect_server.api_url) as client:
        client.ensure_work_queue("gpu", "priority", priority=1)
        client.ensure_work_queue("gpu", "priority", priority=1)  # idempotent
        run = client.create_flow_run(params, work_queue_name="priority")
    try:
        queues = api(prefect_server, "POST", "/work_pools/gpu/queues/filter", json={}).json()
        priorities = {queue["name"]: queue["priority"] for queue in queues}
        assert priorities["priority"] == 1 and priorities["default"] > 1  # taken first
        stored = api(prefect_server, "GET", f"/flow_runs/{run.id}").json()
        assert stored["work_queue_name"] == "priority"
    finally:
        api(prefect_server, "DELETE", f"/flow_runs/{run.id}")


def test_work_pool_templates_are_accepted(
    prefect_server: PrefectServer, deployed: dict[str, dict[str, Any]]
) -> None:
    """gpu-process was created by ``deployed``; the image-based types are created here."""
    kinds = {
        "gpu-process": "process",
        "gpu-ecs": "ecs",
        "gpu-docker": "docker",
        "gpu-kubernetes": "kubernetes",
    }
    prefect_cli_concurrently(
        prefect_server,
        *[
            [
                "work-pool",
                "create",
                f"check-{name}",
                "--type",
                kind,
                "--base-job-template",
                str(POOLS / f"{name}.json"),
            ]
            for name, kind in kinds.items()
            if kind != "process"
        ],
    )
    for name, kind in kinds.items():
        pool = "gpu" if kind == "process" else f"check-{name}"
        stored = api(prefect_server, "GET", f"/work_pools/{pool}").json()
        assert stored["type"] == kind
        assert stored["base_job_template"] == json.loads((POOLS / f"{name}.json").read_text())


@pytest.mark.slow
def test_process_worker_runs_a_triggered_deployment(
    prefect_server: PrefectServer, deployed: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from blocks import init_default_blocks

    with temporary_settings(updates={PREFECT_API_URL: prefect_server.api_url}):
        init_default_blocks(prefect_server.home)
    home = Home(prefect_server.home)
    job_id = str(uuid.uuid4())
    sent = webapi_parameters(
        job_id,
        home.put_input(astronaut_jpeg_bytes()),
        home.put_input(grace_hopper_jpeg_bytes()),
    )
    worker = Service(
        "worker",
        [
            str(BIN / "prefect"),
            "worker",
            "start",
            "--pool",
            "gpu",
            "--type",
            "process",
            "--limit",
            "1",
            "--name",
            "test-worker",
        ],
        log=tmp_path / "worker.log",
        env=prefect_server.env,
        cwd=REPO_ROOT,
    )
    worker.start()
    try:
        fuse = deployed[f"{FLOW_NAME}/{DEPLOYMENT_NAME}"]
        created = create_run(
            prefect_server,
            fuse,
            {
                "parameters": sent,
                "idempotency_key": idempotency_key(job_id, 1),
                "name": job_id,
                "tags": [f"job:{job_id}", "owner:owner-7"],
            },
        )
        assert created.status_code in (200, 201), created.text  # 200: a retried repeat
        run_id = created.json()["id"]

        def final() -> bool:
            state = api(prefect_server, "GET", f"/flow_runs/{run_id}").json()["state"]
            if state["type"] in {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}:
                return True
            assert worker.alive(), worker.log.read_text()[-3000:]
            return False

        poll(final, 240, step_s=1.0)
        state = api(prefect_server, "GET", f"/flow_runs/{run_id}").json()["state"]
        assert state.get("type") == "COMPLETED", f"{state}\n{worker.log.read_text()[-4000:]}"
    finally:
        worker.stop(grace=10)
    ref = ResultRef.model_validate_json((home.storage / result_meta_key(job_id, 1)).read_bytes())
    assert ref.content_type == "image/jpeg" and ref.key.endswith(".jpeg")
    image = Image.open(io.BytesIO((home.storage / ref.key).read_bytes()))
    assert image.format == "JPEG"
    assert (image.height, image.width) == grace_hopper_rgb().shape[:2]
