"""Object storage shared with the flow: inputs go in, results come out, by key.

Keys follow ``flows.params`` (``inputs/ab/<sha256>.jpg``, ``results/<job>/attempt-1.png``).
``LocalObjectStore(basepath)`` matches a Prefect ``LocalFileSystem`` block with the same
basepath; ``S3ObjectStore(bucket, prefix)`` matches a prefect-aws ``S3Bucket`` with the
same bucket and ``bucket_folder``. ``open_store(storage_url)`` picks one from
``FACEFLOW_STORAGE_URL`` (``file:///path`` or ``s3://bucket/prefix``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Iterable, Iterator
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, Protocol, cast, runtime_checkable
from urllib.parse import unquote, urlsplit

from tasks.partials import is_partial_name, replacing


class StorageError(Exception):
    """The store failed or a key is invalid."""


class ObjectNotFound(StorageError, KeyError):
    """No object under this key."""


@runtime_checkable
class ObjectStore(Protocol):
    """What the webapi and relay need from storage."""

    def put(self, key: str, data: bytes, *, content_type: str | None = None) -> None:
        """Store ``data`` under ``key`` (replacing any object there)."""
        ...

    def get(self, key: str) -> bytes:
        """The bytes under ``key``; raises ``ObjectNotFound``."""
        ...

    def exists(self, key: str) -> bool:
        """Whether an object is stored under ``key``."""
        ...

    def put_file(self, key: str, path: Path, *, content_type: str | None = None) -> None:
        """Store the file at ``path`` under ``key``, streamed (never whole in memory)."""
        ...

    def size(self, key: str) -> int:
        """The byte size of the object under ``key``; raises ``ObjectNotFound``."""
        ...

    def read_range(self, key: str, start: int, end: int) -> Iterator[bytes]:
        """Bytes ``start``..``end`` (inclusive) of the object under ``key``, in pieces of
        at most ``READ_PIECE`` bytes; raises ``ObjectNotFound`` before the first piece."""
        ...

    def delete(self, keys: Iterable[str]) -> int:
        """Delete the objects under ``keys`` (missing ones are skipped); how many requests
        or unlinks it took is the store's business, the count of keys it handled is returned."""
        ...


#: Keys one S3 DeleteObjects request may name.
S3_DELETE_BATCH = 1000
#: Largest piece ``read_range`` yields (a streamed download holds one at a time).
READ_PIECE = 1 << 20


def check_key(key: str) -> str:
    """``key`` if it is a relative POSIX path without ``..`` (else ``StorageError``)."""
    path = PurePosixPath(key)
    if not key or path.is_absolute() or ".." in path.parts or "\\" in key:
        raise StorageError(f"invalid storage key {key!r}")
    return key


class LocalObjectStore:
    """Objects as files under ``basepath`` (written atomically: temp file + rename)."""

    def __init__(self, basepath: str | Path) -> None:
        self.basepath = Path(basepath).expanduser().resolve()

    def _path(self, key: str) -> Path:
        return self.basepath / check_key(key)

    def put(self, key: str, data: bytes, *, content_type: str | None = None) -> None:
        with replacing(self._path(key)) as tmp:
            tmp.write_bytes(data)

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError) as exc:
            raise ObjectNotFound(key) from exc

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def put_file(self, key: str, path: Path, *, content_type: str | None = None) -> None:
        with replacing(self._path(key)) as tmp:
            shutil.copyfile(path, tmp)

    def size(self, key: str) -> int:
        try:
            return self._path(key).stat().st_size
        except (FileNotFoundError, NotADirectoryError) as exc:
            raise ObjectNotFound(key) from exc

    def read_range(self, key: str, start: int, end: int) -> Iterator[bytes]:
        try:
            handle = self._path(key).open("rb")
        except (FileNotFoundError, IsADirectoryError) as exc:
            raise ObjectNotFound(key) from exc
        return _pieces(handle, start, end)

    def delete(self, keys: Iterable[str]) -> int:
        count = 0
        parents: set[Path] = set()
        for key in keys:
            path = self._path(key)
            path.unlink(missing_ok=True)
            parents.add(path.parent)
            count += 1
        for parent in sorted(parents, reverse=True):  # e.g. results/<job>/ once empty
            if parent != self.basepath:
                try:
                    parent.rmdir()
                except OSError:
                    pass
        return count

    def sweep_partials(self, older_than: float, *, now: float | None = None) -> int:
        """Delete the temporary files of writes that never finished (a writer killed
        between its write and its rename: ``.<name>.<random>.partial``, by this store and
        by the flows' storage block alike) last modified more than ``older_than`` seconds
        ago; how many were deleted."""
        cutoff = (time.time() if now is None else now) - older_than
        removed = 0
        for root, _dirs, files in os.walk(self.basepath):
            for name in files:
                if not is_partial_name(name):
                    continue
                path = Path(root, name)
                with contextlib.suppress(FileNotFoundError):  # renamed or swept meanwhile
                    if path.stat().st_mtime < cutoff:
                        path.unlink()
                        removed += 1
        return removed

    def __repr__(self) -> str:
        return f"LocalObjectStore({str(self.basepath)!r})"


class S3ObjectStore:
    """Objects in ``bucket`` under ``prefix`` (boto3, imported on first use)."""

    def __init__(self, bucket: str, prefix: str = "", *, endpoint_url: str | None = None) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.endpoint_url = endpoint_url
        self._client: Any = None

    @property
    def client(self) -> Any:
        """The boto3 S3 client (created lazily)."""
        if self._client is None:
            import boto3

            self._client = boto3.client("s3", endpoint_url=self.endpoint_url)
        return self._client

    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def put(self, key: str, data: bytes, *, content_type: str | None = None) -> None:
        extra = {"ContentType": content_type} if content_type else {}
        self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, **extra)

    def get(self, key: str) -> bytes:
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
        except self.client.exceptions.NoSuchKey as exc:
            raise ObjectNotFound(key) from exc
        return bytes(response["Body"].read())

    def exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(key))
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise
        return True

    def put_file(self, key: str, path: Path, *, content_type: str | None = None) -> None:
        extra = {"ExtraArgs": {"ContentType": content_type}} if content_type else {}
        self.client.upload_file(str(path), self.bucket, self._key(key), **extra)

    def size(self, key: str) -> int:
        from botocore.exceptions import ClientError

        try:
            head = self.client.head_object(Bucket=self.bucket, Key=self._key(key))
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                raise ObjectNotFound(key) from exc
            raise
        return int(head["ContentLength"])

    def read_range(self, key: str, start: int, end: int) -> Iterator[bytes]:
        try:
            response = self.client.get_object(
                Bucket=self.bucket, Key=self._key(key), Range=f"bytes={start}-{end}"
            )
        except self.client.exceptions.NoSuchKey as exc:
            raise ObjectNotFound(key) from exc
        body = response["Body"]
        return cast(Iterator[bytes], body.iter_chunks(READ_PIECE))

    def delete(self, keys: Iterable[str]) -> int:
        names = [self._key(key) for key in keys]
        for start in range(0, len(names), S3_DELETE_BATCH):
            batch = names[start : start + S3_DELETE_BATCH]
            response = self.client.delete_objects(
                Bucket=self.bucket,
                Delete={"Objects": [{"Key": name} for name in batch], "Quiet": True},
            )
            errors = response.get("Errors") or []
            if errors:
                first = errors[0]
                raise StorageError(
                    f"S3 refused to delete {len(errors)} objects, e.g. {first.get('Key')}: "
                    f"{first.get('Code')} {first.get('Message')}"
                )
        return len(names)

    def __repr__(self) -> str:
        return f"S3ObjectStore({self.bucket!r}, {self.prefix!r})"


def _pieces(handle: BinaryIO, start: int, end: int) -> Iterator[bytes]:
    """Bytes ``start``..``end`` (inclusive) of an open file, ``READ_PIECE`` at a time;
    closes it."""
    with handle:
        handle.seek(start)
        left = end - start + 1
        while left > 0:
            piece = handle.read(min(READ_PIECE, left))
            if not piece:
                return
            left -= len(piece)
            yield piece


def open_store(storage_url: str, *, s3_endpoint_url: str | None = None) -> ObjectStore:
    """The store named by ``storage_url`` (``file:///path`` or ``s3://bucket/prefix``)."""
    parts = urlsplit(storage_url)
    if parts.scheme == "file":
        return LocalObjectStore(unquote(parts.path))
    if parts.scheme == "s3" and parts.netloc:
        return S3ObjectStore(parts.netloc, parts.path, endpoint_url=s3_endpoint_url)
    if not parts.scheme:
        return LocalObjectStore(storage_url)
    raise StorageError(f"unsupported storage URL {storage_url!r}: use file:// or s3://")
