"""The flow's storage stages: load (read + decode inputs) and store (result + sidecar).

The storage block is named by a flow parameter and loaded here, never hard-coded.
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from blocks.storage import ByteStore, load_storage, location_of, read_from, write_to
from flows.params import ResultRef, result_meta_key
from tasks.batch import Each, each
from tasks.pipeline import PipelineContext, decode_stage
from tasks.types import RGBImage


@task(name="load", task_run_name="load", persist_result=False, cache_policy=NO_CACHE)
def load_task(
    storage_block: str, source_key: str, target_key: str, ctx: PipelineContext
) -> tuple[RGBImage, RGBImage]:
    """Read both inputs from storage and decode them (bounded by ``ctx.limits``)."""
    store = load_storage(storage_block)
    source = decode_stage(read_from(store, source_key), ctx)
    target = decode_stage(read_from(store, target_key), ctx)
    return source, target


@task(name="load-more", task_run_name="load-more", persist_result=False, cache_policy=NO_CACHE)
def load_more_task(storage_block: str, keys: list[str], ctx: PipelineContext) -> list[RGBImage]:
    """Read and decode more inputs (a per-face mapping's extra sources and references),
    in the load stage."""
    store = load_storage(storage_block)
    return [decode_stage(read_from(store, key), ctx) for key in keys]


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
    image ends that job only. The block itself failing to load fails the stage."""
    store = load_storage(storage_block)
    return each(
        lambda pair: (
            decode_stage(read_from(store, pair[0]), ctx),
            decode_stage(read_from(store, pair[1]), ctx),
        ),
        keys,
        threads=ctx.cpu_threads,
    )


@task(name="store-batch", task_run_name="store", persist_result=False, cache_policy=NO_CACHE)
def store_batch_task(
    storage_block: str, results: list[tuple[str, int, ResultRef, bytes]], threads: int = 1
) -> list[Each[str]]:
    """``store_task`` of every job (job id, attempt, ref, image bytes): image, then sidecar;
    the jobs on up to ``threads`` threads."""
    store = load_storage(storage_block)
    return each(lambda result: write_result(store, *result), results, threads=threads)
