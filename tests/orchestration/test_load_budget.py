"""The flow's load stage bounds what a run decodes (issue 22: memory amplification): a job's
images within ``max_job_pixels`` and a batch run's within ``max_batch_pixels``, both read
from the headers before any pixel is decoded. Real storage block, real images."""

from __future__ import annotations

from collections.abc import Sequence

from prefect.logging import disable_run_logger

from blocks.storage import load_storage
from flows.fuse import fuse_faces
from flows.params import DEFAULT_STORAGE_BLOCK, JobAttempt
from flows.run import StoredJob
from tasks.batch import Each
from tasks.errors import InvalidInput, JobTooLarge, OverBatchBudget
from tasks.options import FusionOptions, ImageLimits
from tasks.pipeline import PipelineContext
from tasks.stages import Work, load_step
from tests.orchestration.conftest import Home
from tests.orchestration.helpers import batch_outcomes, job_params, stages_seen, stored_failure
from tests.samples import flat_png

MP = 1_000_000
LIMITS = ImageLimits(max_pixels=6 * MP, max_job_pixels=10 * MP, max_batch_pixels=10 * MP)


def _ctx(limits: ImageLimits = LIMITS) -> PipelineContext:
    return PipelineContext(device="cpu", limits=limits, cpu_threads=2)


def _work(*keys: str) -> Work:
    """A job reading ``keys`` (source, target, then more sources) from the storage block."""
    spec = JobAttempt.model_validate(job_params(keys[0], keys[1], extra_source_keys=keys[2:]))
    return Work(StoredJob(load_storage(DEFAULT_STORAGE_BLOCK), spec, "cpu"), FusionOptions())


def _load(
    jobs: Sequence[tuple[str, ...]], ctx: PipelineContext
) -> tuple[list[Work], list[Each[None]]]:
    """The table's load step over ``jobs``: each job's work and outcome."""
    works = [_work(*keys) for keys in jobs]
    with disable_run_logger():
        return works, load_step(works, ctx)


def test_load_refuses_a_job_past_its_budget_before_decoding_any_image(
    prefect_harness: Home,
) -> None:
    whole = prefect_harness.put_input(flat_png(2000, 2000), "png")  # 4 MP
    # Its header says 4 MP but its pixel data is cut: decoding it fails (invalid_input).
    cut = prefect_harness.put_input(flat_png(2000, 2000)[:120], "png")
    (work,), (ok,) = _load([(whole, whole)], _ctx())
    assert ok.error is None
    assert [i.shape for i in (work.source, work.target) if i is not None] == [(2000, 2000, 3)] * 2
    _, (within,) = _load([(whole, cut)], _ctx())  # 8 MP: decoded, and the cut one fails
    assert isinstance(within.error, InvalidInput) and within.error.code == "invalid_input"
    _, (over,) = _load([(whole, cut, whole)], _ctx())  # 12 MP: refused before any decode
    assert isinstance(over.error, JobTooLarge)
    assert over.error.code == "job_too_large" and over.error.permanent


def test_fuse_faces_fails_the_amplification_job_at_load_without_retrying(
    prefect_harness: Home,
) -> None:
    """8 sources, 8 references and a target, each a ≈ 50 KB PNG of 40 MP, under the
    default limits (FusionSettings block): refused at load, nothing decoded, no retry."""
    big = prefect_harness.put_input(flat_png(8000, 5000), "png")
    mapping = [{"source": i, "reference": i} for i in range(8)]
    params = job_params(
        big,
        big,
        extra_source_keys=[big] * 7,
        reference_keys=[big] * 8,
        options={"mapping": mapping},
    )
    state = fuse_faces(**params, return_state=True)
    assert state.is_failed()
    assert (state.message or "").startswith("[job_too_large]"), state.message
    # A permanent error: the load stage is not run again (it ends Failed at once; a single
    # job's stages run inline by default, so its run log says so).
    assert stages_seen(state.state_details.flow_run_id, inline=True)["load"] == (1, "Failed")


def test_a_batch_run_decodes_its_jobs_within_the_batch_budget(prefect_harness: Home) -> None:
    """In order, each job that still fits is decoded; one past the batch budget ends with a
    transient error (the relay sends it again), one past its own budget with a permanent
    one, and neither takes any of the budget."""
    four = prefect_harness.put_input(flat_png(2000, 2000), "png")
    one = prefect_harness.put_input(flat_png(1000, 1000), "png")
    six = prefect_harness.put_input(flat_png(3000, 2000), "png")
    jobs = [
        (four, four),  # 8 MP: decoded (8 of 10)
        (six, six),  # 12 MP: past the job's budget, takes none of the batch's
        (four, one),  # 5 MP: 13 > 10, past the batch budget
        ("inputs/missing.png", one),  # missing: ends on its own
        (one, one),  # 2 MP: still fits (10 of 10)
    ]
    works, outcomes = _load(jobs, _ctx())
    errors = [type(o.error) if o.error is not None else None for o in outcomes]
    assert errors[0] is None and errors[4] is None
    assert errors[1] is JobTooLarge and errors[2] is OverBatchBudget
    assert errors[3] is not None and errors[3] not in (JobTooLarge, OverBatchBudget)
    assert works[0].source is not None and works[0].source.shape == (2000, 2000, 3)
    assert works[4].target is not None and works[4].target.shape == (1000, 1000, 3)
    assert works[2].source is None  # never decoded
    over = outcomes[2].error
    assert over is not None and over.code == "over_batch_budget" and not over.permanent
    # The first job is always decoded, even alone past the batch budget (a run of one).
    _, (alone,) = _load([(six, four)], _ctx(LIMITS.model_copy(update={"max_batch_pixels": 5 * MP})))
    assert alone.error is None


def test_a_job_past_the_batch_budget_is_retryable_in_its_failure_record(
    prefect_harness: Home,
) -> None:
    """Through the real fuse-batch flow, with a settings block whose batch budget is 10 MP:
    the first job (8 MP) is decoded, the second (8 MP more) ends with a retryable
    ``over_batch_budget`` record at load, which the relay re-dispatches."""
    from blocks.settings import FusionSettings
    from flows.batch import fuse_batch
    from flows.binding import signed_parameters, worker_keys
    from flows.params import JobAttempt

    FusionSettings(image_limits=LIMITS).save("fusion-settings-budget", overwrite=True)
    four = prefect_harness.put_input(flat_png(2000, 2000), "png")
    budget = "fusion-settings/fusion-settings-budget"
    specs = [
        JobAttempt.model_validate(
            signed_parameters(job_params(four, four), worker_keys()[0], settings_block=budget)
        )
        for _ in range(2)
    ]
    state = fuse_batch(
        jobs=specs,
        deadline_at=max(spec.deadline_at for spec in specs),
        settings_block=budget,
        return_state=True,
    )
    assert state.is_completed(), state.message
    outcomes = batch_outcomes(state)
    assert outcomes[specs[1].job_id] == "over_batch_budget"
    assert outcomes[specs[0].job_id] != "over_batch_budget"  # decoded: the pipeline went on
    failure = stored_failure(specs[1].job_id)
    assert failure.retryable and failure.stage == "load"
