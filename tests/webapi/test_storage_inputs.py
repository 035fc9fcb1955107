"""Object stores (local files and S3 via a real moto server on loopback) and input handling."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from faceflow.testing.jobs import data_uri, image_bytes, source_jpeg
from flows.params import input_key
from tasks.errors import ImageTooLarge, ImageTooSmall, InvalidInput, UnsupportedFormat
from tasks.options import ImageLimits
from webapi.errors import BlockedUrl, InvalidRequest, PayloadTooLarge, UnsupportedMediaType
from webapi.inputs import InputRef, accept_input, decode_data_uri, store_image
from webapi.storage import (
    READ_PIECE,
    LocalObjectStore,
    ObjectNotFound,
    ObjectStore,
    S3ObjectStore,
    StorageError,
    open_store,
)
from webapi.urls import DEVELOPMENT, UrlPolicy

LIMITS = ImageLimits.model_validate({})


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    if request.param == "local":
        return open_store(tmp_path.as_uri())
    endpoint = request.getfixturevalue("s3_endpoint")
    return open_store(f"s3://faceflow/{tmp_path.name}", s3_endpoint_url=endpoint)


def test_put_get_exists(store: ObjectStore) -> None:
    key = "results/job/attempt-1.png"
    assert not store.exists(key)
    with pytest.raises(ObjectNotFound):
        store.get(key)
    store.put(key, b"first", content_type="image/png")
    store.put(key, b"second")
    assert store.exists(key) and store.get(key) == b"second"


@pytest.mark.parametrize("key", ["", "/etc/passwd", "../up", "a/../../b", "a\\b"])
def test_bad_keys_are_refused(store: ObjectStore, key: str) -> None:
    with pytest.raises(StorageError):
        store.put(key, b"x")


def test_open_store_kinds(tmp_path: Path) -> None:
    local = open_store((tmp_path / "st").as_uri())
    assert isinstance(local, LocalObjectStore) and local.basepath == (tmp_path / "st").resolve()
    s3 = open_store("s3://bucket/some/prefix/")
    assert isinstance(s3, S3ObjectStore) and (s3.bucket, s3.prefix) == ("bucket", "some/prefix")
    with pytest.raises(StorageError):
        open_store("ftp://x/y")


def test_local_layout_matches_a_prefect_local_file_system_basepath(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path)
    store.put("inputs/ab/abc.jpeg", b"data")
    assert (tmp_path / "inputs" / "ab" / "abc.jpeg").read_bytes() == b"data"
    assert [p.name for p in (tmp_path / "inputs" / "ab").iterdir()] == ["abc.jpeg"]  # no temp left


# --------------------------------------------------------------------------- inputs


def test_store_image_by_content_hash(store: ObjectStore) -> None:
    ref = store_image(source_jpeg(), name="source", limits=LIMITS, store=store)
    digest = hashlib.sha256(source_jpeg()).hexdigest()
    assert ref.digest == digest and ref.key == input_key(digest, "jpeg") and ref.url is None
    assert ref.width and ref.height and store.get(ref.key) == source_jpeg()
    again = store_image(source_jpeg(), name="source", limits=LIMITS, store=store)
    assert again == ref


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (image_bytes(64, 64, "GIF"), UnsupportedFormat),
        (b"\x89PNG\r\n\x1a\n" + b"\x00" * 64, InvalidInput),
        (image_bytes(10, 64), ImageTooSmall),
        (image_bytes(300, 300), ImageTooLarge),
        (b"x" * 5000, PayloadTooLarge),
    ],
)
def test_store_image_rejects(tmp_path: Path, data: bytes, error: type[Exception]) -> None:
    limits = ImageLimits(max_bytes=4096, max_pixels=50_000, min_side=16)
    store = LocalObjectStore(tmp_path)
    with pytest.raises(error):
        store_image(data, name="source", limits=limits, store=store)
    assert not any(tmp_path.iterdir())


def test_decode_data_uri() -> None:
    png = image_bytes(20, 20)
    assert decode_data_uri(data_uri(png, "image/png"), name="s", max_bytes=10_000) == png
    assert decode_data_uri(data_uri(png, ""), name="s", max_bytes=10_000) == png
    with pytest.raises(UnsupportedMediaType):
        decode_data_uri(data_uri(png, "text/html"), name="s", max_bytes=10_000)
    with pytest.raises(PayloadTooLarge):
        decode_data_uri(data_uri(b"x" * 20_000, "image/png"), name="s", max_bytes=10_000)
    for bad in ("data:image/png;base64", "data:image/png,abc", "data:image/png;base64,a=b"):
        with pytest.raises(InvalidRequest):
            decode_data_uri(bad, name="s", max_bytes=10_000)


def test_accept_input_kinds(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path)

    def accept(value: str | bytes, private: bool = False) -> InputRef:
        urls = DEVELOPMENT if private else UrlPolicy()
        return accept_input(value, name="s", limits=LIMITS, store=store, urls=urls)

    assert accept(source_jpeg()) == accept(data_uri(source_jpeg()))
    url = accept("https://93.184.216.34/a.jpg")
    assert url.url == "https://93.184.216.34/a.jpg" and url.key is None
    with pytest.raises(BlockedUrl, match=r"^s: "):
        accept("https://10.0.0.1/a.jpg")
    with pytest.raises(InvalidRequest):
        accept("http://93.184.216.34/a.jpg")
    assert accept("http://127.0.0.1:8000/a.jpg", private=True).url == "http://127.0.0.1:8000/a.jpg"


def test_files_go_in_streamed_and_come_out_by_ranges(store: ObjectStore, tmp_path: Path) -> None:
    """``put_file``, ``size`` and ``read_range`` (a video upload and a result download with
    Range) on the local store and on S3, in pieces of at most ``READ_PIECE`` bytes."""
    data = bytes(range(256)) * (READ_PIECE // 256 * 2 + 3)  # two pieces and a bit
    path = tmp_path / "video.bin"
    path.write_bytes(data)
    store.put_file("inputs/vi/video.mp4", path, content_type="video/mp4")
    assert store.size("inputs/vi/video.mp4") == len(data)
    pieces = list(store.read_range("inputs/vi/video.mp4", 0, len(data) - 1))
    assert b"".join(pieces) == data and max(map(len, pieces)) <= READ_PIECE
    middle = b"".join(store.read_range("inputs/vi/video.mp4", 1000, READ_PIECE + 999))
    assert middle == data[1000 : READ_PIECE + 1000]
    with pytest.raises(ObjectNotFound):
        store.size("inputs/vi/missing.mp4")
    with pytest.raises(ObjectNotFound):
        store.read_range("inputs/vi/missing.mp4", 0, 10)
