"""Result storage: where inputs and results live, as a Prefect filesystem block.

Local stack: a ``LocalFileSystem`` block named ``faceflow-storage`` rooted at
``$FACEFLOW_HOME/storage``. Production: a prefect-aws ``S3Bucket`` block (any name; the
flow receives the block document name as a parameter). Both expose ``read_path`` and
``write_path``; the helpers below add typed errors: a missing key is a permanent
``InvalidInput``, any other storage failure a ``TransientError`` (retried by the stage).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol, cast

from prefect.blocks.core import Block
from prefect.filesystems import LocalFileSystem
from pydantic import SecretStr

from blocks.cache import load_block
from blocks.ranged import BLOCK_SIZE, MAX_BLOCKS, RangedSource
from tasks.errors import InvalidInput, TransientError
from tasks.partials import replacing

HOME_ENV = "FACEFLOW_HOME"
DEFAULT_HOME = Path(".faceflow")
LOCAL_STORAGE_NAME = "faceflow-storage"


class ByteStore(Protocol):
    """What the flow needs from a storage block (``LocalFileSystem``, ``S3Bucket``)."""

    def read_path(self, path: str) -> bytes: ...

    def write_path(self, path: str, content: bytes) -> object: ...


def faceflow_home(home: str | Path | None = None) -> Path:
    """``home``, else ``$FACEFLOW_HOME``, else ``.faceflow``; absolute."""
    chosen = Path(home) if home is not None else Path(os.environ.get(HOME_ENV, DEFAULT_HOME))
    return chosen.expanduser().resolve()


def local_storage(home: str | Path | None = None) -> LocalFileSystem:
    """An (unsaved) ``LocalFileSystem`` block rooted at ``<home>/storage``."""
    return LocalFileSystem(basepath=str(faceflow_home(home) / "storage"))


def s3_storage(
    bucket_name: str,
    *,
    bucket_folder: str = "",
    endpoint_url: str | None = None,
    region_name: str | None = None,
    aws_access_key_id: str | None = None,
    aws_secret_access_key: str | None = None,
) -> Block:
    """An (unsaved) prefect-aws ``S3Bucket`` block; ``endpoint_url`` for MinIO or moto.

    Without keys, boto3's default chain applies (instance role, environment, profile).
    """
    from prefect_aws import AwsClientParameters, AwsCredentials
    from prefect_aws.s3 import S3Bucket

    credentials = AwsCredentials(
        aws_access_key_id=aws_access_key_id,
        aws_secret_access_key=SecretStr(aws_secret_access_key) if aws_secret_access_key else None,
        region_name=region_name,
        aws_client_parameters=AwsClientParameters(endpoint_url=endpoint_url),
    )
    return cast(
        Block,
        S3Bucket(bucket_name=bucket_name, bucket_folder=bucket_folder, credentials=credentials),
    )


def load_storage(block_name: str) -> ByteStore:
    """The storage block document ``block_name`` (``"<block-type-slug>/<name>"``), from the
    per-process block cache (``blocks.cache``: a change is seen within its TTL)."""
    if block_name.startswith("s3-bucket/"):
        import prefect_aws.s3  # noqa: F401 - registers the S3Bucket block class
    block = load_block(block_name)
    if not (hasattr(block, "read_path") and hasattr(block, "write_path")):
        raise TypeError(f"Block {block_name!r} is not a readable and writable filesystem.")
    return cast(ByteStore, block)


def read_from(store: ByteStore, key: str) -> bytes:
    """The bytes stored under ``key``; ``InvalidInput`` when absent."""
    with _reading(key, missing="An input image was not found in storage."):
        return store.read_path(key)


def write_to(store: ByteStore, key: str, data: bytes) -> None:
    """Store ``data`` under ``key`` (overwrites) as one whole: a reader sees the old
    object or the new one, never part of it (``LocalFileSystem``: written under a
    temporary name and renamed; an S3 object appears only when its upload completes)."""
    with _writing():
        if isinstance(store, LocalFileSystem):
            with replacing(store._resolve_path(key)) as partial:
                partial.write_bytes(data)
        else:
            store.write_path(key, data)


def exists(store: ByteStore, key: str) -> bool:
    """Whether an object is stored under ``key`` (a small object: it is read whole).
    A storage failure other than "no such key" is a ``TransientError``."""
    try:
        store.read_path(key)
    except Exception as exc:
        if _is_missing(exc):
            return False
        raise _unreadable(exc) from exc
    return True


def fetch_to(store: ByteStore, key: str, path: Path) -> Path:
    """Copy the object under ``key`` to the file ``path`` without holding it in memory
    (``LocalFileSystem``: a file copy under its basepath; ``S3Bucket``: a streamed
    download); ``InvalidInput`` when absent, ``TransientError`` for other failures."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with _reading(key):
        if isinstance(store, LocalFileSystem):
            shutil.copyfile(store._resolve_path(key), path)
        elif hasattr(store, "download_object_to_path"):
            store.download_object_to_path(key, path)
        else:  # any other filesystem block: whole, through memory
            path.write_bytes(store.read_path(key))
    return path


def read_locally(store: ByteStore, key: str, path: Path) -> Path:
    """``path``, at which the object under ``key`` can be read (never written): with
    ``LocalFileSystem`` a symbolic link to the stored file, so no byte is copied (a video
    part reads its frames from the stored upload in place); with other blocks a copy
    (``fetch_to``). ``InvalidInput`` when absent, ``TransientError`` for other failures."""
    if not isinstance(store, LocalFileSystem):
        return fetch_to(store, key, path)
    with _reading(key):
        stored = store._resolve_path(key)
        if not stored.is_file():
            raise FileNotFoundError(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        path.symlink_to(stored)
    return path


def read_in_place(
    store: ByteStore,
    key: str,
    path: Path,
    *,
    block_size: int = BLOCK_SIZE,
    max_blocks: int = MAX_BLOCKS,
) -> Path | RangedSource:
    """The object under ``key`` to read without copying it whole: with an ``S3Bucket`` a
    ``RangedSource`` (``blocks.ranged``) whose reads are ranged GETs of ``block_size``
    bytes through the block's own client, the last ``max_blocks`` kept (a video part
    fetches the index and its frames, not the upload); otherwise ``read_locally``'s
    ``path``. The object is looked up now: ``InvalidInput`` when absent,
    ``TransientError`` for other failures (of later reads too)."""
    if isinstance(store, LocalFileSystem):
        return read_locally(store, key, path)
    from prefect_aws.s3 import S3Bucket

    if not isinstance(store, S3Bucket):
        return read_locally(store, key, path)
    bucket, name = store.bucket_name, store._resolve_path(key)
    with _reading(key):
        client = store._get_s3_client()
        size = int(client.head_object(Bucket=bucket, Key=name)["ContentLength"])

    def fetch(start: int, stop: int) -> bytes:
        with _reading(key):
            got = client.get_object(Bucket=bucket, Key=name, Range=f"bytes={start}-{stop - 1}")
            return bytes(got["Body"].read())

    return RangedSource(
        key.rsplit("/", 1)[-1], size, fetch, block_size=block_size, max_blocks=max_blocks
    )


def put_from(store: ByteStore, key: str, path: Path) -> None:
    """Store the file ``path`` under ``key`` (overwrites) without reading it whole: a
    copy to a temporary name renamed when complete (``LocalFileSystem``), a streamed
    upload (``S3Bucket``: an object appears only when its upload completes)."""
    with _writing():
        if isinstance(store, LocalFileSystem):
            with replacing(store._resolve_path(key)) as partial:
                shutil.copyfile(path, partial)
        elif hasattr(store, "upload_from_path"):
            store.upload_from_path(path, key)
        else:
            store.write_path(key, path.read_bytes())


def is_stored(store: ByteStore, key: str) -> bool:
    """Whether ``key`` is stored, without reading a large object whole where the block
    can tell (``LocalFileSystem``: the file; ``S3Bucket``: a listing of the key)."""
    if isinstance(store, LocalFileSystem):
        return store._resolve_path(key).is_file()
    listing = getattr(store, "list_objects", None)
    if callable(listing):
        with _reading(key, missing=None):
            return any(str(o.get("Key", "")).endswith(key) for o in listing(folder=key))
    return exists(store, key)


def read_bytes(block_name: str, key: str) -> bytes:
    """Read ``key`` from the storage block ``block_name``."""
    return read_from(load_storage(block_name), key)


def write_bytes(block_name: str, key: str, data: bytes) -> None:
    """Write ``data`` under ``key`` in the storage block ``block_name``."""
    write_to(load_storage(block_name), key, data)


@contextmanager
def _reading(
    key: str, *, missing: str | None = "An input was not found in storage."
) -> Iterator[None]:
    """A read's storage failure as a typed error: "no such ``key``" an ``InvalidInput``
    saying ``missing`` (with ``None``, a failure like any other), any other failure a
    ``TransientError``."""
    try:
        yield
    except Exception as exc:
        if missing is not None and _is_missing(exc):
            raise InvalidInput(missing, detail=key) from exc
        raise _unreadable(exc) from exc


@contextmanager
def _writing() -> Iterator[None]:
    """A write's storage failure as a ``TransientError``."""
    try:
        yield
    except Exception as exc:
        raise TransientError("Storage could not be written.", detail=type(exc).__name__) from exc


def _unreadable(exc: BaseException) -> TransientError:
    return TransientError("Storage could not be read.", detail=type(exc).__name__)


def _is_missing(exc: BaseException) -> bool:
    """Whether a storage exception means "no such key" (LocalFileSystem or S3)."""
    if isinstance(exc, FileNotFoundError):
        return True
    if isinstance(exc, ValueError) and "does not exist" in str(exc):
        return True
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        code = str(response.get("Error", {}).get("Code", ""))
        return code in {"404", "NoSuchKey", "NotFound"}
    return False


def location_of(store: ByteStore, key: str) -> str:
    """A URI an operator can open for ``key``: ``file://…`` locally, ``s3://…`` on S3."""
    bucket = getattr(store, "bucket_name", None)
    if bucket is not None:
        folder = str(getattr(store, "bucket_folder", "") or "").strip("/")
        return f"s3://{bucket}/{folder + '/' if folder else ''}{key}"
    basepath = getattr(store, "basepath", None)
    if basepath:
        return (Path(str(basepath)).expanduser().resolve() / key).as_uri()
    return key
