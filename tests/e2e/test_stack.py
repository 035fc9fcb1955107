"""End to end: ``faceflow up`` as a subprocess, real HTTP, real Prefect, real worker.

One stack for the module (free loopback ports, a temporary home); each test drives it the
way an app would. Stopping the stack must leave no process behind.
"""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import stat
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image
from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

from blocks.settings import FusionSettings
from faceflow.faults.observe import inline_stages
from faceflow.testing.jobs import data_uri
from faceflow.testing.relay import Receiver, receiver
from faceflow.testing.wait import poll
from faceflow.testing.webhooks import independent_verify
from tests import samples
from tests.e2e.harness import (
    StackClient,
    create_user,
    local_stack,
    pid_of,
    pids_with_home,
    prefect_auth,
    watch,
)
from tests.onnx_builders import build_tiny_gfpgan

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@dataclass
class RunningStack(StackClient):
    home: Path
    api: str
    prefect_api: str
    api_key: str
    webhook_secret: str
    process: subprocess.Popen[bytes]
    receiver: Receiver
    prefect: httpx.Client
    """The stack's Prefect API, with its credential."""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    home = tmp_path_factory.mktemp("stack") / "home"
    with local_stack(home, FACEFLOW_ALLOW_PRIVATE_URLS="true") as local:
        fields = create_user(local.env, "e2e")
        with receiver() as hooks:
            yield RunningStack(
                home=home,
                api=local.api,
                prefect_api=local.prefect_api,
                api_key=fields["api key"],
                webhook_secret=fields["webhook secret"],
                process=local.process,
                receiver=hooks,
                prefect=local.prefect,
            )


def _onto(target: str, **fields: object) -> dict[str, object]:
    """A submit body: the astronaut's face onto ``target`` (a data URI), with ``fields``."""
    return {"source": data_uri(samples.astronaut_jpeg_bytes()), "target": target, **fields}


def _post(client: httpx.Client, body: dict[str, object]) -> str:
    """Submit ``body`` (answered 202, with the job's ``Location``); the new job's id."""
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 202, response.text
    assert response.headers["Location"].endswith(response.json()["id"])
    return str(response.json()["id"])


def test_submit_runs_to_success_with_webhook_result_and_prefect_run(stack: RunningStack) -> None:
    with stack.client() as client:
        job_id = _post(
            client,
            _onto(
                data_uri(samples.grace_hopper_jpeg_bytes()),
                options={"min_identity": 0.99},  # out of reach: the floor retries once
                callback_url=f"{stack.receiver.url}/hook",
                callback_events=["job.running", "job.succeeded", "job.failed"],
            ),
        )
        job, seen = watch(client, job_id)
        assert job["status"] == "succeeded", job
        assert seen[0] == "queued" and "running" in seen and seen[-1] == "succeeded", seen
        result = client.get(f"/v1/jobs/{job_id}/result")
        assert result.status_code == 200
        image = Image.open(io.BytesIO(result.content))
        assert image.size == (512, 600)
        # Marked: the stack's development chain signed it, its root is the API's anchor.
        octets = {"Content-Type": "application/octet-stream"}
        marks = client.post("/v1/verify", content=result.content, headers=octets).json()
        assert marks.get("made_by_this_service") and marks["manifest"]["trusted"], marks
        assert marks["watermark"] == {"checked": True, "present": True, "job_id": job_id}
    assert "c2pa: created a development signing chain" in (stack.home.parent / "up.log").read_text()
    quality = job["quality"]
    assert quality["marks"] == ["c2pa", "watermark"]
    assert quality["identity_model"] == "dlib-resnet-v1" and quality["faces_lost"] == 0
    assert quality["faces"][0]["found"] and quality["source_similarity"] > 0.5
    assert quality["min_identity"] == 0.99 and quality["below_floor"]
    assert [a["settings"]["identity_weight"] for a in quality["attempts"]] == [0.85, 1.0]
    assert quality["settings"] in [a["settings"] for a in quality["attempts"]]

    poll(
        lambda: "job.succeeded" in {json.loads(p.body)["type"] for p in stack.receiver.posts()},
        30,
        step_s=0.5,
    )
    mine = [(p.headers, p.body) for p in stack.receiver.posts() if job_id in p.body.decode()]
    succeeded = [json.loads(b) for _, b in mine if json.loads(b)["type"] == "job.succeeded"]
    assert succeeded, mine
    assert succeeded[0]["data"]["quality"] == quality  # the webhook carries the report
    for headers, body in mine:
        assert independent_verify(stack.webhook_secret, headers, body, tolerance_s=None)
        wrong = "whsec_" + base64.b64encode(b"x" * 32).decode()
        assert not independent_verify(wrong, headers, body, tolerance_s=None)

    runs = stack.prefect.post(
        "/flow_runs/filter", json={"flow_runs": {"name": {"any_": [job_id]}}}
    ).json()
    assert len(runs) == 1 and runs[0]["state_type"] == "COMPLETED"
    artifacts = stack.prefect.post(
        "/artifacts/filter",
        json={"artifacts": {"flow_run_id": {"any_": [runs[0]["id"]]}}},
    ).json()
    assert {a["type"] for a in artifacts} >= {"table", "markdown"}, artifacts
    # The per-stage view: a single job's stages run inline (FusionSettings.stage_task_runs),
    # each named with its attempt and time in the run's log, which the server writes in
    # batches (faceflow.prefect_server.SERVICE_WRITE_BATCHING), within seconds.
    stages = {"moderate_inputs", "detect", "align", "fuse", "postprocess", "quality", "store"}
    auth = {"Authorization": stack.prefect.headers["Authorization"]}
    poll(
        lambda: stages <= inline_stages(stack.prefect_api, [runs[0]["id"]], auth)[runs[0]["id"]],
        15,
        step_s=0.25,
    )
    done = inline_stages(stack.prefect_api, [runs[0]["id"]], auth)
    assert stages <= done[runs[0]["id"]], done


def test_no_face_fails_without_retry(stack: RunningStack) -> None:
    with stack.client() as client:
        job, _ = watch(client, _post(client, _onto(data_uri(samples.no_face_jpeg_bytes()))))
    assert job["status"] == "failed"
    assert job["error"]["code"] == "no_face_found"
    assert job["attempts"] == 1


def test_moderation_blocks_a_flagged_target_without_retry(stack: RunningStack) -> None:
    with stack.client() as client:
        flagged = data_uri(samples.encode(samples.colorwheel_rgb(), "PNG"), "image/png")
        job, _ = watch(client, _post(client, _onto(flagged)))
    assert job["status"] == "failed"
    assert job["error"] == {
        "code": "content_blocked",
        "message": "The images were refused by content moderation.",
    }
    assert job["attempts"] == 1


def _submit(client: httpx.Client, body: dict[str, object]) -> str:
    """Submit (waiting out a 503 for the backlog on a busy machine); the new job's id."""
    body = {"deadline_seconds": 600, "queue_timeout_seconds": 300, **body}
    deadline = time.monotonic() + 120
    while True:
        response = client.post("/v1/jobs", json=body)
        if response.status_code != 503 or time.monotonic() > deadline:
            break
        time.sleep(float(response.headers.get("Retry-After", "2")))
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


@contextmanager
def _operator_settings(stack: RunningStack, settings: FusionSettings) -> Iterator[None]:
    """Save ``settings`` as the stack's ``fusion-settings/default``; the defaults after."""
    with temporary_settings(
        {PREFECT_API_URL: stack.prefect_api, PREFECT_API_AUTH_STRING: prefect_auth(stack.home)}
    ):
        settings.save("default", overwrite=True)
        try:
            yield
        finally:
            FusionSettings().save("default", overwrite=True)


def test_enhancer_is_refused_until_pinned_then_restores_the_face(
    stack: RunningStack, tmp_path: Path
) -> None:
    """An operator's GFPGAN-shaped model (a tiny one: red and green kept, blue at half
    contrast): unpinned it fails the job for good; pinned, it is applied to the face."""
    tiny = build_tiny_gfpgan(tmp_path / "models")
    options = {"color_transfer": False, "blend": "feather"}
    enhanced = {**options, "enhancer": "gfpgan", "enhancer_blend": 1.0}
    body = _onto(data_uri(samples.grace_hopper_jpeg_bytes()))
    with stack.client() as client:
        with _operator_settings(stack, FusionSettings(model_dir=str(tiny.path.parent))):
            job, _ = watch(client, _submit(client, {**body, "options": enhanced}), timeout=600)
        assert job["status"] == "failed" and job["error"]["code"] == "model_unavailable", job
        assert job["attempts"] == 1

        # Unmarked: each job's watermark carries its own id, and the pixels are compared.
        pinned = FusionSettings(
            model_dir=str(tiny.path.parent), model_pins=tiny.pins, marking="off"
        )
        with _operator_settings(stack, pinned):
            ids = [_submit(client, {**body, "options": o}) for o in (options, enhanced)]
            jobs = [watch(client, job_id, timeout=600)[0] for job_id in ids]
        assert [j["status"] for j in jobs] == ["succeeded", "succeeded"], jobs
        assert "enhance" in jobs[1]["timings"] and "enhance" not in jobs[0]["timings"]
        plain, restored = (
            np.asarray(Image.open(io.BytesIO(client.get(f"/v1/jobs/{i}/result").content))).astype(
                int
            )
            for i in ids
        )
    cy, cx = 221, 264  # the centre of grace_hopper's face box
    window = np.s_[cy - 30 : cy + 30, cx - 30 : cx + 30]
    assert np.abs(restored[window][..., :2] - plain[window][..., :2]).mean() < 4.0
    assert 0.4 < restored[window][..., 2].std() / plain[window][..., 2].std() < 0.65
    assert np.array_equal(restored[:40, :40], plain[:40, :40])


def test_per_face_mapping_through_the_client(stack: RunningStack, tmp_path: Path) -> None:
    """Two sources onto t1 (one by reading-order number, one by a reference photo), sent by
    the Python client; the quality report compares each face with its own source."""
    from faceflow.client import FaceFlowClient
    from tasks.detect import detect_faces
    from tasks.mapping import reading_order

    t1 = samples.t1_rgb()
    faces = detect_faces(t1)
    order = reading_order(faces)
    box = faces[order[3]].box
    reference = tmp_path / "reference.png"
    reference.write_bytes(
        samples.encode(
            t1[int(box.y1) - 40 : int(box.y2) + 40, int(box.x1) - 40 : int(box.x2) + 40], "PNG"
        )
    )
    astronaut = tmp_path / "astronaut.jpg"
    astronaut.write_bytes(samples.astronaut_jpeg_bytes())
    mapping = [{"source": 0, "target": 0}, {"source": 1, "reference": 0}]
    with FaceFlowClient(stack.api, stack.api_key) as client:
        job = client.submit(
            astronaut,
            samples.t1_path(),
            options={"mapping": mapping},
            extra_sources=[samples.grace_hopper_path()],
            references=[reference],
            deadline_seconds=600,
            queue_timeout_seconds=300,
        )
        job = client.wait(job["id"], timeout=600)
        assert job["status"] == "succeeded", job
        result = np.asarray(Image.open(io.BytesIO(client.result(job["id"]))).convert("RGB"))
    assert [f["index"] for f in job["quality"]["faces"]] == [order[0], order[3]]
    assert job["quality"]["faces_lost"] == 0
    for i, face in enumerate(faces):
        region = np.s_[int(face.box.y1) : int(face.box.y2), int(face.box.x1) : int(face.box.x2)]
        changed = np.abs(result[region].astype(int) - t1[region].astype(int)).mean() > 2.0
        assert changed == (i in (order[0], order[3])), i


def test_cancel_of_a_queued_job(stack: RunningStack) -> None:
    with stack.client() as client:
        job_id = _post(client, _onto(data_uri(samples.grace_hopper_jpeg_bytes())))
        cancel = client.post(f"/v1/jobs/{job_id}/cancel")
        assert cancel.status_code in (200, 202), cancel.text
        job, _ = watch(client, job_id, timeout=90)
    assert job["status"] == "cancelled"


def test_the_stack_restarts_a_part_that_dies_and_counts_it(stack: RunningStack) -> None:
    # The priority lane and the retention schedule are set up by `faceflow up`.
    queue = stack.prefect.get("/work_pools/gpu/queues/priority").json()
    retention = stack.prefect.get("/deployments/name/retention/retention")
    assert queue["priority"] == 1
    assert retention.status_code == 200
    os.kill(pid_of(stack.home, b"local-control"), signal.SIGKILL)
    log = stack.home.parent / "up.log"
    restarted = poll(lambda: b"restarted worker-control" in log.read_bytes(), 30, step_s=0.2)
    assert restarted, log.read_text()[-2000:]
    assert b"killed by SIGKILL (restart 1" in log.read_bytes()
    assert pid_of(stack.home, b"local-control") > 0  # running again
    metrics = httpx.get(f"{stack.api}/metrics", timeout=10).text
    assert 'faceflow_service_restarts_total{service="worker-control"} 1.0' in metrics
    assert 'faceflow_service_restarts_total{service="webapi"} 0.0' in metrics
    assert 'faceflow_lane_queued_jobs{lane="high"}' in metrics


def test_the_prefect_api_asks_for_the_credential_that_no_log_shows(
    stack: RunningStack,
) -> None:
    """Issue 22: whoever reaches the Prefect API without the stack's credential can neither
    read runs' parameters and blocks nor change a run; the credential file is 0600 and the
    console names it without showing it."""
    credential = stack.home / "prefect-api-auth"
    assert stat.S_IMODE(credential.stat().st_mode) == 0o600
    secret = prefect_auth(stack.home)
    for method, path, body in (
        ("POST", "/flow_runs/filter", {}),
        ("POST", "/block_documents/filter", {}),
        ("POST", "/deployments/", {"name": "x", "flow_id": str(uuid.uuid4())}),
    ):
        anonymous = httpx.request(method, f"{stack.prefect_api}{path}", json=body, timeout=10)
        assert anonymous.status_code == 401, (path, anonymous.text)
    assert stack.prefect.post("/flow_runs/filter", json={"limit": 1}).status_code == 200
    up = (stack.home.parent / "up.log").read_text()
    assert str(credential) in up
    for log in [stack.home.parent / "up.log", *(stack.home / "logs").glob("*.log")]:
        assert secret.split(":", 1)[1] not in log.read_text(errors="replace"), log


def test_stopping_the_stack_leaves_no_process(stack: RunningStack) -> None:
    assert pids_with_home(stack.home), "the stack's processes should be visible while it runs"
    stack.process.send_signal(signal.SIGTERM)
    stack.process.wait(timeout=90)
    poll(lambda: not pids_with_home(stack.home), 15, step_s=0.5)
    assert pids_with_home(stack.home) == []
