"""A video part reads the upload in place on S3 (``read_in_place``: ranged GETs against a
moto server on 127.0.0.1): one range of a multi-chunk video fetches a fraction of the
object and decodes the frames the downloaded file gives. Run with ``-s`` for figures."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from blocks.ranged import RangedSource
from blocks.storage import ByteStore, fetch_to, put_from, read_from, read_in_place, s3_storage
from faceflow.testing.s3 import moto_server, s3_client
from flows.video_steps import VideoJob, analyse_task
from tasks import video_analysis
from tasks.errors import InvalidInput, TransientError
from tasks.options import FusionOptions
from tasks.pipeline import PipelineContext
from tasks.video import analyse_range
from tasks.video_io import VideoFrame, probe_frames, read_frames
from tasks.video_records import Probed
from tests.orchestration.conftest import S3_BUCKET
from tests.stores import local_store
from tests.videos import Videos

FOLDER = "ranged"
KEY = "inputs/long.mp4"
BLOCK = 64 << 10  # the test video is 1.3 MB: blocks in proportion to a 500 MB upload's


def bucket(endpoint: str) -> ByteStore:
    store = s3_storage(
        S3_BUCKET,
        bucket_folder=FOLDER,
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    return store  # type: ignore[return-value]


@pytest.fixture(scope="module")
def uploaded(moto: str, videos: Videos) -> ByteStore:
    """The S3 bucket block with the long test video stored under ``KEY``."""
    store = bucket(moto)
    put_from(store, KEY, videos.long)
    return store


def probed(video: Path) -> Probed:
    info, (pts, keyframes) = probe_frames(video)
    return Probed(info, pts, images=[], samples=[], flags=[], keyframes=keyframes)


def in_place(store: ByteStore, tmp_path: Path, block_size: int = BLOCK) -> RangedSource:
    source = read_in_place(store, KEY, tmp_path / "input", block_size=block_size)
    assert isinstance(source, RangedSource)
    assert not (tmp_path / "input").exists()  # nothing downloaded
    return source


def figures(what: str, source: RangedSource, seconds: float) -> None:
    share = source.fetched_bytes / source.size
    print(
        f"\n{what}: fetched {source.fetched_bytes} of {source.size} bytes ({share:.1%}) "
        f"in {source.requests} requests of <= {source.block_size} bytes, {seconds:.3f} s"
    )


def same_frames(got: list[VideoFrame], want: list[VideoFrame]) -> bool:
    return [(f.index, f.pts) for f in got] == [(f.index, f.pts) for f in want] and all(
        np.array_equal(a.image, b.image) for a, b in zip(got, want, strict=True)
    )


def test_an_analysis_part_on_s3_fetches_its_range_not_the_upload(
    uploaded: ByteStore, videos: Videos, tmp_path: Path
) -> None:
    ctx, options = PipelineContext(), FusionOptions()
    job = VideoJob(uploaded, tmp_path, tmp_path / "input", [], options, ctx, chunk_s=1.0)
    job.probed, job.digest = probed(videos.long), "long"
    ranges = job.ranges()
    assert len(ranges) >= 5
    start, stop = ranges[len(ranges) // 2]
    job.video = source = in_place(uploaded, tmp_path)
    began = time.perf_counter()
    assert analyse_task.fn(job, start, stop)  # the part's step, as ``analyse-<a>-<b>`` runs it
    figures(f"analysis part, frames {start}-{stop}", source, time.perf_counter() - began)
    assert source.fetched_bytes < source.size / 2
    reads = job.input_reads()  # what the part logs when it ends
    assert (
        reads is not None and f"read {source.fetched_bytes} of the input's {source.size}" in reads
    )
    assert f"in {source.requests} ranged requests" in reads and source.requests > 0
    stored = read_from(uploaded, job.analysis_key(start, stop))
    local = analyse_range(videos.long, job.probed, start, stop, options, ctx)
    assert stored == video_analysis.encode(local)


def test_a_chunk_decoded_in_place_is_the_downloaded_files_chunk(
    uploaded: ByteStore, videos: Videos, tmp_path: Path
) -> None:
    pts = probed(videos.long).pts
    start, stop = 5 * 15 + 7, 8 * 15 + 3  # ~3 s from the middle of a keyframe interval
    began = time.perf_counter()
    downloaded = fetch_to(uploaded, KEY, tmp_path / "downloaded.mp4")
    want = list(read_frames(downloaded, start, stop, timestamps=pts))
    whole = time.perf_counter() - began
    print(f"\ndownload + decode frames {start}-{stop}: {whole:.3f} s")
    for block_size in (BLOCK, 1 << 20):
        source = in_place(uploaded, tmp_path, block_size)
        began = time.perf_counter()
        got = list(read_frames(source, start, stop, timestamps=pts))
        figures(f"in place, frames {start}-{stop}", source, time.perf_counter() - began)
        assert same_frames(got, want)
    small = in_place(uploaded, tmp_path)
    assert same_frames(list(read_frames(small, start, stop, timestamps=pts)), want)
    assert small.fetched_bytes < small.size / 2


def test_a_local_store_still_links_the_stored_file(videos: Videos, tmp_path: Path) -> None:
    store = local_store(tmp_path / "storage")
    put_from(store, KEY, videos.silent)
    linked = read_in_place(store, KEY, tmp_path / "input")
    assert isinstance(linked, Path) and linked.is_symlink()
    job = VideoJob(store, tmp_path, linked, [], FusionOptions(), PipelineContext(), chunk_s=1.0)
    assert job.input_reads() is None  # nothing ranged to log
    assert len(list(read_frames(linked, 3, 9))) == 6


def test_a_missing_object_is_invalid_input_and_a_dead_server_transient(
    uploaded: ByteStore, tmp_path: Path
) -> None:
    with pytest.raises(InvalidInput):
        read_in_place(uploaded, "inputs/none.mp4", tmp_path / "input")
    with pytest.raises(TransientError) as raised:
        read_in_place(bucket("http://127.0.0.1:9"), KEY, tmp_path / "input")
    assert "127.0.0.1" not in str(raised.value) and "testing" not in str(raised.value)


def test_a_read_that_fails_in_ffmpeg_raises_the_storage_error(
    moto: str, videos: Videos, tmp_path: Path
) -> None:
    store = bucket(moto)
    key = "inputs/deleted.mp4"
    put_from(store, key, videos.long)
    pts = probed(videos.long).pts
    source = read_in_place(store, key, tmp_path / "input", block_size=BLOCK)
    assert len(list(read_frames(source, 0, 2, timestamps=pts))) == 2  # index and head cached
    s3_client(moto).delete_object(Bucket=S3_BUCKET, Key=f"{FOLDER}/{key}")
    with pytest.raises(InvalidInput):  # the object went: not a broken video
        list(read_frames(source, 200, 210, timestamps=pts))


def test_a_server_gone_mid_read_is_transient_not_a_broken_video(
    videos: Videos, tmp_path: Path
) -> None:
    pts = probed(videos.long).pts
    with moto_server(tmp_path, S3_BUCKET) as endpoint:  # this test's own, to stop
        store = bucket(endpoint)
        put_from(store, KEY, videos.long)
        source = read_in_place(store, KEY, tmp_path / "input", block_size=BLOCK)
        assert len(list(read_frames(source, 0, 2, timestamps=pts))) == 2
    with pytest.raises(TransientError) as raised:
        list(read_frames(source, 200, 210, timestamps=pts))
    assert raised.value.detail == "EndpointConnectionError"
