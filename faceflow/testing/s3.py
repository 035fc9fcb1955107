"""An S3 protocol server (moto) on loopback for tests and benchmarks, and a client of it."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from faceflow.supervisor import Service
from faceflow.testing.net import free_port

#: moto accepts any keys; these are the ones tests and benchmarks give it.
ACCESS_KEY = SECRET_KEY = "testing"
REGION = "us-east-1"


def s3_client(endpoint: str) -> Any:
    """A boto3 S3 client of the server at ``endpoint``."""
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name=REGION,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
    )


@contextmanager
def moto_server(directory: Path, bucket: str | None = None) -> Iterator[str]:
    """``moto_server`` in its own process on 127.0.0.1 and a free port (its log in
    ``directory``), waited for, with ``bucket`` created when named; stopped by PID on
    leaving. Yields its endpoint URL."""
    port = free_port()
    argv = [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)]
    server = Service("moto", argv, directory / "moto.log")
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    try:
        server.wait_ready(lambda: httpx.get(endpoint, timeout=2).status_code < 500, timeout=60)
        if bucket is not None:
            s3_client(endpoint).create_bucket(Bucket=bucket)
        yield endpoint
    finally:
        server.stop(grace=5)
