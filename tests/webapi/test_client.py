"""The Python clients (``faceflow.client``) against the real app over loopback: the async
client submits, reads, cancels and maps errors as the sync one does."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy.engine import Engine

from faceflow.client import AsyncFaceFlowClient, FaceFlowAPIError, FaceFlowClient
from tests import samples
from tests.webapi.utils import make_user
from webapi.config import Settings


def test_the_async_client_does_what_the_sync_one_does(
    live_url: str, engine: Engine, settings: Settings
) -> None:
    user = make_user(engine, settings, quota=5)
    source, target = samples.astronaut_jpeg_bytes(), samples.grace_hopper_jpeg_bytes()

    async def use() -> tuple[dict[str, object], dict[str, object], int]:
        async with AsyncFaceFlowClient(live_url, user.api_key) as client:
            job = await client.submit(source, target, idempotency_key="async-1")
            again = await client.submit(source, target, idempotency_key="async-1")
            assert again["id"] == job["id"]
            read = await client.status(str(job["id"]))
            cancelled = await client.cancel(str(job["id"]))
            with pytest.raises(FaceFlowAPIError) as missing:
                await client.status("00000000-0000-0000-0000-000000000000")
            return read, cancelled, missing.value.status

    read, cancelled, status = asyncio.run(use())
    assert read["status"] == "queued" and status == 404
    assert cancelled["status"] in ("cancel_requested", "cancelled")
    with FaceFlowClient(live_url, user.api_key) as sync_client:
        assert sync_client.status(str(read["id"]))["status"] == cancelled["status"]
