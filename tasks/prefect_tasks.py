"""The stages of ``tasks.stages.PIPELINE`` as Prefect tasks: one task per stage, made from
the table, that runs the stage's step for the live jobs of a run (one job or a batch).
``stage_call`` is the same step without the task: what a run calls inline when the
settings run its stages without task runs (``FusionSettings.stage_task_runs``).

Images travel between tasks in-process: results are never persisted
(``persist_result=False``) nor cached (``NO_CACHE``), so no pixel ever becomes a Prefect
result. Timeouts and retries are set per call by ``flows.deadline.StageGuard``; these
definitions carry none. A stage in which every job failed raises ``EveryJobFailed`` (which
reads as the first job's error and carries every job's outcome): its task run ends
``Failed`` and the guard retries it when no error is permanent. In a batch, jobs that fail
beside others that pass leave the run; the relay re-dispatches the transient ones.
"""

from __future__ import annotations

from collections.abc import Callable

from prefect import Task, task
from prefect.cache_policies import NO_CACHE

from tasks.batch import Each, every_job_failed
from tasks.pipeline import PipelineContext
from tasks.stages import Stage, Work

StageCall = Callable[[list[Work], PipelineContext], list[Each[None]]]
StageTask = Task[[list[Work], PipelineContext], list[Each[None]]]


def stage_call(stage: Stage) -> StageCall:
    """``stage``'s step for the live jobs, raising ``EveryJobFailed`` when no job passed
    (the body of its task, and what a run without stage task runs calls)."""

    def run(works: list[Work], ctx: PipelineContext) -> list[Each[None]]:
        outcomes = stage.step(works, ctx)
        every_job_failed(outcomes)
        return outcomes

    run.__name__ = run.__qualname__ = f"{stage.name}_stage"
    run.__doc__ = stage.step.__doc__
    return run


def _as_task(stage: Stage) -> StageTask:
    return task(
        name=stage.name, task_run_name=stage.name, persist_result=False, cache_policy=NO_CACHE
    )(stage_call(stage))


_TASKS: dict[Stage, StageTask] = {}


def stage_task(stage: Stage) -> StageTask:
    """The Prefect task of ``stage`` (made once per table entry)."""
    if stage not in _TASKS:
        _TASKS[stage] = _as_task(stage)
    return _TASKS[stage]
