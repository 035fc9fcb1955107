"""A job attempt's parameters bound to the job: the relay signs them, the flow checks them.

The relay signs what a run may do for its job (job id, attempt, owner, input keys, options,
deadline, the storage and settings blocks it reads and the signing block whose certificate
marks its result) with HMAC-SHA256 under a key that
the relay and the workers hold in their environment, never in Prefect
(``FACEFLOW_RUN_SIGNING_KEY``). The signature travels in the run's parameters
(``JobAttempt.binding``); ``fuse-faces`` and ``fuse-batch`` refuse a job whose parameters
no longer match it (``tasks.errors.RunBindingInvalid``), so a client of the Prefect API
that changes a scheduled run's parameters, or creates a run of its own, gets no work done
on anyone's inputs.

Versions: ``v2=`` bindings sign the signing block too, so a run cannot be made to mark its
result with another certificate than the job's. A ``v1=`` binding (signed before the
signing block was bound: runs scheduled by a relay of the previous release) is still
accepted, for the default signing block only.

Rotation: a worker accepts the current key and every key of
``FACEFLOW_RUN_SIGNING_PREVIOUS_KEYS`` (comma-separated); the relay signs with the
current one. Torch-free and Prefect-free: the webapi signs without importing the pipeline.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any, TypedDict, Unpack

from flows.params import (
    DEFAULT_SETTINGS_BLOCK,
    DEFAULT_SIGNING_BLOCK,
    DEFAULT_STORAGE_BLOCK,
    JobAttempt,
)

SIGNING_KEY_ENV = "FACEFLOW_RUN_SIGNING_KEY"
PREVIOUS_KEYS_ENV = "FACEFLOW_RUN_SIGNING_PREVIOUS_KEYS"
DEV_RUN_SIGNING_KEY = "faceflow-development-run-signing-key"
"""The key both sides use when none is set, outside production (the local stack generates
a real one; ``environment=production`` refuses this one on the relay and the workers)."""
VERSION = "v2"
LEGACY_VERSION = "v1"
"""Bindings without the signing block: accepted only for ``DEFAULT_SIGNING_BLOCK``."""


def canonical(
    job: JobAttempt,
    *,
    storage_block: str = DEFAULT_STORAGE_BLOCK,
    settings_block: str = DEFAULT_SETTINGS_BLOCK,
    signing_block: str = DEFAULT_SIGNING_BLOCK,
    version: str = VERSION,
) -> bytes:
    """The bytes a binding signs: the bound fields as compact JSON with sorted keys (the
    options as the client set them, the deadline in UTC to the microsecond; ``v1`` leaves
    the signing block out)."""
    fields: dict[str, Any] = {
        "v": version,
        "job_id": job.job_id,
        "attempt": job.attempt,
        "owner_id": job.owner_id,
        "source_key": job.source_key,
        "target_key": job.target_key,
        "extra_source_keys": list(job.extra_source_keys),
        "reference_keys": list(job.reference_keys),
        "options": job.options.as_sent(),
        "deadline_at": _instant(job.deadline_at),
        "storage_block": storage_block,
        "settings_block": settings_block,
    }
    if version != LEGACY_VERSION:
        fields["signing_block"] = signing_block
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return text.encode()


class BlockNames(TypedDict, total=False):
    """The blocks a binding names, as ``canonical`` takes them (its defaults when left out)."""

    storage_block: str
    settings_block: str
    signing_block: str


def sign(job: JobAttempt, key: str, *, version: str = VERSION, **blocks: Unpack[BlockNames]) -> str:
    """The binding of ``job`` and ``blocks`` under ``key``: ``v2=<hex HMAC-SHA256>``
    (``version="v1"``: the previous format, for tests of its acceptance)."""
    body = canonical(job, version=version, **blocks)
    return f"{version}={hmac.new(key.encode(), body, hashlib.sha256).hexdigest()}"


def verify(
    job: JobAttempt,
    keys: Iterable[str],
    *,
    storage_block: str = DEFAULT_STORAGE_BLOCK,
    settings_block: str = DEFAULT_SETTINGS_BLOCK,
    signing_block: str = DEFAULT_SIGNING_BLOCK,
) -> bool:
    """Whether ``job.binding`` is the binding of ``job`` and these blocks under one of
    ``keys`` (a ``v1=`` binding: only with the default signing block)."""
    offered = job.binding or ""
    version = offered.partition("=")[0]
    if version == LEGACY_VERSION and signing_block != DEFAULT_SIGNING_BLOCK:
        return False
    if version not in (VERSION, LEGACY_VERSION):
        return False
    blocks: BlockNames = {
        "storage_block": storage_block,
        "settings_block": settings_block,
        "signing_block": signing_block,
    }
    return any(
        hmac.compare_digest(offered, sign(job, key, version=version, **blocks)) for key in keys
    )


def signed_parameters(
    parameters: Mapping[str, Any],
    key: str,
    *,
    storage_block: str | None = None,
    settings_block: str | None = None,
    signing_block: str | None = None,
) -> dict[str, Any]:
    """A ``fuse-faces`` run's parameters (``FuseFacesParams`` fields), or one ``fuse-batch``
    job's (``JobAttempt`` fields), with their binding under ``key``: for runs created
    without the relay (benches, tests, an operator's replay). The blocks default to the
    parameters' own, else the defaults; a batch job is bound to its run's blocks."""
    blocks = {"binding", "storage_block", "settings_block", "signing_block"}
    job = JobAttempt.model_validate({k: v for k, v in parameters.items() if k not in blocks})
    binding = sign(
        job,
        key,
        storage_block=storage_block or parameters.get("storage_block", DEFAULT_STORAGE_BLOCK),
        settings_block=settings_block or parameters.get("settings_block", DEFAULT_SETTINGS_BLOCK),
        signing_block=signing_block or parameters.get("signing_block", DEFAULT_SIGNING_BLOCK),
    )
    return {**parameters, "binding": binding}


def worker_keys(environ: Mapping[str, str] | None = None) -> list[str]:
    """The keys a worker accepts: ``FACEFLOW_RUN_SIGNING_KEY`` (the development key when
    unset, except with ``FACEFLOW_ENVIRONMENT=production``: then none) and the previous
    keys still accepted during a rotation."""
    env = os.environ if environ is None else environ
    production = env.get("FACEFLOW_ENVIRONMENT", "development") == "production"
    current = env.get(SIGNING_KEY_ENV, "").strip() or DEV_RUN_SIGNING_KEY
    previous = [key.strip() for key in env.get(PREVIOUS_KEYS_ENV, "").split(",")]
    return [
        key
        for key in (current, *previous)
        if key and not (production and key == DEV_RUN_SIGNING_KEY)
    ]


def _instant(value: datetime) -> str:
    aware = value if value.tzinfo is not None else value.replace(tzinfo=UTC)
    return aware.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
