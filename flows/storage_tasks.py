"""The flow's storage stages: load (read + decode inputs) and store (result + sidecar).

Load bounds what a run decodes: a job's images together within ``max_job_pixels``, a batch
run's within ``max_batch_pixels`` (``tasks.options.ImageLimits``), both from the headers.

The storage block is named by a flow parameter and loaded here, never hard-coded.
"""

from __future__ import annotations

from collections.abc import Sequence

from prefect import task
from prefect.cache_policies import NO_CACHE

from blocks.storage import ByteStore, load_storage, location_of, read_from, write_to
from flows.params import ResultRef, result_meta_key
from tasks.batch import Each, each
from tasks.errors import OverBatchBudget
from tasks.images import probe_image
from tasks.options import ImageLimits
from tasks.pipeline import PipelineContext, decode_stage
from tasks.types import RGBImage


@task(name="load", task_run_name="load", persist_result=False, cache_policy=NO_CACHE)
def load_task(storage_block: str, keys: list[str], ctx: PipelineContext) -> list[RGBImage]:
    """Read a job's inputs (source, target, then a per-face mapping's other sources and
    references) and decode them, in that order; their pixels together are checked against
    the job's budget from the headers first (``JobTooLarge``, bounded by ``ctx.limits``)."""
    data, _ = read_job(load_storage(storage_block), keys, ctx.limits)
    return decode_all(data, ctx)


def read_job(store: ByteStore, keys: Sequence[str], limits: ImageLimits) -> tuple[list[bytes], int]:
    """A job's encoded inputs and the pixels they decode to together, checked from the
    headers, before any pixel is decoded, against the per-image limits and the job's
    budget (``JobTooLarge``: a job past it never reaches a decode)."""
    data = [read_from(store, key) for key in keys]
    pixels = sum(probe_image(one, limits).pixels for one in data)
    limits.check_job_pixels(pixels)
    return data, pixels


def decode_all(data: list[bytes], ctx: PipelineContext) -> list[RGBImage]:
    """Decode ``data`` in order; each encoded input is dropped from the list once decoded."""
    images: list[RGBImage] = []
    while data:
        images.append(decode_stage(data.pop(0), ctx))
    return images


@task(name="store", task_run_name="store", persist_result=False, cache_policy=NO_CACHE)
def store_task(storage_block: str, job_id: str, attempt: int, ref: ResultRef, data: bytes) -> str:
    """Write the result image, then its ``ResultRef`` sidecar; returns the image's URI.

    The sidecar is written last, so its presence means the image is complete.
    """
    return write_result(load_storage(storage_block), job_id, attempt, ref, data)


def write_result(store: ByteStore, job_id: str, attempt: int, ref: ResultRef, data: bytes) -> str:
    """Write a job attempt's result image, then its ``ResultRef`` sidecar (last, so its
    presence means the image is complete); returns the image's URI."""
    write_to(store, ref.key, data)
    write_to(store, result_meta_key(job_id, attempt), ref.model_dump_json().encode())
    return location_of(store, ref.key)


@task(name="load-batch", task_run_name="load", persist_result=False, cache_policy=NO_CACHE)
def load_batch_task(
    storage_block: str, keys: list[tuple[str, str]], ctx: PipelineContext
) -> list[Each[tuple[RGBImage, RGBImage]]]:
    """``load_task`` of every job (source and target keys); one job's missing or invalid
    image, or images past the job's budget, end that job only. The block itself failing to
    load fails the stage.

    The run decodes at most ``ctx.limits.max_batch_pixels`` (from the headers, in the
    jobs' order; the first job always fits): the relay plans batches within that budget,
    so a job past it (a relay with a larger budget than this worker's) ends with
    ``OverBatchBudget``, which is transient: the relay sends it again in another run."""
    store = load_storage(storage_block)
    threads = ctx.cpu_threads
    read = each(lambda pair: read_job(store, pair, ctx.limits), keys, threads=threads)
    admitted = within_budget(
        [one.value[1] if one.value is not None else None for one in read],
        ctx.limits.max_batch_pixels,
    )
    decoded = iter(
        each(
            lambda data: (decode_stage(data[0], ctx), decode_stage(data[1], ctx)),
            [
                one.value[0]
                for one, fits in zip(read, admitted, strict=True)
                if fits and one.value is not None
            ],
            threads=threads,
        )
    )
    outcomes: list[Each[tuple[RGBImage, RGBImage]]] = []
    for one, fits in zip(read, admitted, strict=True):
        if one.value is None:
            outcomes.append(Each(None, one.error, one.ms))
        elif not fits:
            detail = f"{one.value[1]} pixels past {ctx.limits.max_batch_pixels} in the run"
            outcomes.append(Each(None, OverBatchBudget(detail=detail), one.ms))
        else:
            pair = next(decoded)
            outcomes.append(Each(pair.value, pair.error, one.ms + pair.ms))
    return outcomes


def within_budget(pixels: Sequence[int | None], budget: int) -> list[bool]:
    """Which jobs (their pixels; None for a job already ended) a run may decode, in order,
    without passing ``budget`` together: each job that still fits (the first always does)."""
    fits: list[bool] = []
    total = 0
    for count in pixels:
        ok = count is not None and (total == 0 or total + count <= budget)
        total += count if ok and count is not None else 0
        fits.append(ok)
    return fits


@task(name="store-batch", task_run_name="store", persist_result=False, cache_policy=NO_CACHE)
def store_batch_task(
    storage_block: str, results: list[tuple[str, int, ResultRef, bytes]], threads: int = 1
) -> list[Each[str]]:
    """``store_task`` of every job (job id, attempt, ref, image bytes): image, then sidecar;
    the jobs on up to ``threads`` threads."""
    store = load_storage(storage_block)
    return each(lambda result: write_result(store, *result), results, threads=threads)
