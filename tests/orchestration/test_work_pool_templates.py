"""Shape of the work pool templates (no server): placeholders, variables, defaults, GPU bits.

Process and ECS templates are rendered by their installed worker classes (which talk to a
Prefect API to resolve block references: the test harness). The docker and
kubernetes worker packages are not installed: their templates are checked against the
defaults Prefect ships for those types, the documented job fields and JSON Schema only.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any, cast

import jsonschema
import prefect
import pytest
from prefect.utilities.templating import apply_values, find_placeholders

from tests.orchestration.conftest import REPO_ROOT, Home

POOLS = REPO_ROOT / "work_pools"
SHIPPED = Path(prefect.__file__).parent / (
    "server/api/collections_data/views/aggregate-worker-metadata.json"
)
DOCKER_DOCUMENTED_EXTRA = {"container_create_kwargs"}
"""DockerWorkerJobConfiguration fields missing from the shipped default template."""


def load(name: str) -> dict[str, Any]:
    return json.loads((POOLS / f"{name}.json").read_text())


def defaults(template: dict[str, Any]) -> dict[str, Any]:
    props = template["variables"]["properties"]
    return {k: v["default"] for k, v in props.items() if "default" in v}


def rendered(template: dict[str, Any]) -> dict[str, Any]:
    """The job configuration with every variable at its default (unset ones removed)."""
    return apply_values(template["job_configuration"], defaults(template), remove_notset=True)


@pytest.mark.parametrize("name", ["gpu-process", "gpu-docker", "gpu-kubernetes", "gpu-ecs"])
def test_template_shape(name: str) -> None:
    template = load(name)
    assert set(template) == {"job_configuration", "variables"}
    variables = template["variables"]
    jsonschema.Draft202012Validator.check_schema(variables)
    names = {p.name for p in find_placeholders(template["job_configuration"])}
    assert names <= set(variables["properties"]), names - set(variables["properties"])
    jsonschema.validate(defaults(template), variables)
    assert "CUDA_VISIBLE_DEVICES" not in json.dumps(defaults(template))


def test_process_template_renders_with_the_process_worker(prefect_harness: Home) -> None:
    from prefect.workers.process import ProcessJobConfiguration

    template = load("gpu-process")
    config = cast(
        ProcessJobConfiguration,
        asyncio.run(ProcessJobConfiguration.from_template_and_values(template, {})),
    )
    assert config.env["FACEFLOW_DEVICE"] == "auto"
    assert config.stream_output is True


def test_ecs_template_renders_with_the_ecs_worker(prefect_harness: Home) -> None:
    from prefect_aws.workers.ecs_worker import ECSJobConfiguration

    template = load("gpu-ecs")
    config = cast(
        ECSJobConfiguration,
        asyncio.run(ECSJobConfiguration.from_template_and_values(template, {})),
    )
    container = config.task_definition["containerDefinitions"][0]
    assert container["resourceRequirements"] == [{"type": "GPU", "value": "1"}]
    assert config.task_definition["requiresCompatibilities"] == ["EC2"]
    assert config.task_run_request["launchType"] == "EC2"


@pytest.mark.parametrize(
    ("name", "kind"), [("gpu-docker", "docker"), ("gpu-kubernetes", "kubernetes")]
)
def test_template_keeps_the_shipped_fields(name: str, kind: str) -> None:
    shipped = json.loads(SHIPPED.read_text())[f"prefect-{kind}"][kind]
    default = shipped["default_base_job_configuration"]
    template = load(name)
    extra = DOCKER_DOCUMENTED_EXTRA if kind == "docker" else set()
    assert set(template["job_configuration"]) == set(default["job_configuration"]) | extra
    assert set(default["variables"]["properties"]) <= set(template["variables"]["properties"])


def test_docker_template_requests_a_gpu() -> None:
    config = rendered(load("gpu-docker"))
    (request,) = config["container_create_kwargs"]["device_requests"]
    assert request["capabilities"] == [["gpu"]] and request["count"] == 1


def test_kubernetes_template_requests_a_gpu_node() -> None:
    manifest = rendered(load("gpu-kubernetes"))["job_manifest"]
    pod = manifest["spec"]["template"]["spec"]
    resources = pod["containers"][0]["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 1
    assert resources["requests"]["nvidia.com/gpu"] == 1
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"


@pytest.mark.parametrize("name", ["gpu-process", "gpu-docker", "gpu-kubernetes", "gpu-ecs"])
def test_the_prefect_credential_comes_from_the_worker_never_the_template(
    name: str, prefect_harness: Home
) -> None:
    """Issue 22: each flow run gets the Prefect API's credential from its worker's own
    PREFECT_API_AUTH_STRING (Prefect's base job configuration passes the worker's settings
    on); no template carries one."""
    from prefect.client.schemas.objects import FlowRun
    from prefect.settings import PREFECT_API_AUTH_STRING, temporary_settings
    from prefect.workers.base import BaseJobConfiguration

    template = load(name)
    assert "AUTH_STRING=" not in json.dumps(template)
    assert not any("AUTH" in key for key in defaults(template).get("env", {}))
    config = cast(
        BaseJobConfiguration,
        asyncio.run(BaseJobConfiguration.from_template_and_values(template, {})),
    )
    with temporary_settings({PREFECT_API_AUTH_STRING: "faceflow:from-the-worker"}):
        config.prepare_for_flow_run(FlowRun(flow_id=uuid.uuid4(), name="job"))
    assert config.env["PREFECT_API_AUTH_STRING"] == "faceflow:from-the-worker"


def test_the_ecs_template_can_take_the_credential_from_secrets_manager(
    prefect_harness: Home,
) -> None:
    """With ``prefect_api_auth_string_secret_arn`` the ECS task reads the credential from
    AWS Secrets Manager: the worker's own value is left out of the task's environment."""
    from prefect.client.schemas.objects import FlowRun
    from prefect.settings import PREFECT_API_AUTH_STRING, temporary_settings
    from prefect_aws.workers.ecs_worker import ECSJobConfiguration

    arn = "arn:aws:secretsmanager:eu-west-1:123456789012:secret:prefect-auth"
    values = {"prefect_api_auth_string_secret_arn": arn}
    config = cast(
        ECSJobConfiguration,
        asyncio.run(ECSJobConfiguration.from_template_and_values(load("gpu-ecs"), values)),
    )
    with temporary_settings({PREFECT_API_AUTH_STRING: "faceflow:from-the-worker"}):
        config.prepare_for_flow_run(FlowRun(flow_id=uuid.uuid4(), name="job"))
    assert "PREFECT_API_AUTH_STRING" not in config.env
    assert config.prefect_api_auth_string_secret_arn == arn
