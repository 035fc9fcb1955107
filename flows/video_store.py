"""What the ``fuse-video`` coordinator runs itself, and what passes between the runs of a
video job attempt through storage: the steps' budgets and guard, the signed plan the
probe and plan parts store, the report part's record, and the coordinator's own steps
(fetch the stored chunks, join them with the audio, store the result).

The coordinator runs on the control pool, which has no GPU and loads no model: this
module imports neither the pipeline nor a model runtime (nor does anything it unpickles:
``tasks.video_records``), and ``tests/test_video_plan_store.py`` checks it in a fresh
process. The GPU steps (probe, analysis, plan, render, report) are ``flows.video_steps``'.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import os
import pickle
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from prefect import task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel

from blocks.settings import StagePolicy
from blocks.storage import ByteStore, is_stored, put_from, read_from, read_locally, write_to
from flows.binding import worker_keys
from flows.deadline import Deadline, StageGuard
from flows.params import VideoResultRef
from tasks.errors import InvalidInput, RunBindingInvalid, TransientError
from tasks.provenance import Ingredient, Marker, input_ingredients
from tasks.video_io import VideoInfo, join_segments
from tasks.video_records import Planned, Probed
from tasks.watermark import MIN_PIXELS


@dataclass(frozen=True, slots=True)
class Budget:
    """Time budget, expected cost and retries of one video step."""

    budget_s: float
    expected_s: float
    retries: int


VIDEO_STAGES: dict[str, Budget] = {
    "probe": Budget(budget_s=120.0, expected_s=1.0, retries=2),
    "analyse": Budget(budget_s=1800.0, expected_s=10.0, retries=1),
    "render_chunk": Budget(budget_s=600.0, expected_s=5.0, retries=2),  # per chunk
    "join": Budget(budget_s=300.0, expected_s=2.0, retries=2),
    "report": Budget(budget_s=300.0, expected_s=2.0, retries=1),
    "store": Budget(budget_s=300.0, expected_s=1.0, retries=2),
}
"""Defaults of the video steps (seconds). A chunk of ~10 s renders in ~5-60 s on CPU."""

RETRY_DELAY_S = 1.0
WORKDIR_PREFIX = "fuse-video-"
"""Temporary directories of attempts: ``fuse-video-<pid>-…`` (swept once their process is
gone: a cancelled or overdue run's process is killed before it can remove its own)."""

RENDERED, STORED = "rendered", "stored"
"""How a completed part's state message starts: it did its work, or found its chunk
stored (then ``by pid <process>``: where it ran)."""

TASK_OPTIONS = {"persist_result": False, "cache_policy": NO_CACHE}
"""What every video step's ``@task`` takes: no result persisted (frames stay in-process),
no cache."""


class ReportRecord(BaseModel):
    """What the ``report`` part stores (``flows.params.video_report_key``) for its
    coordinator: moderation's flags on the sampled result frames, each track's identity
    similarities of its sampled fused faces to its source, and the device it ran on."""

    flags: list[str]
    similarities: dict[int, list[float]]
    device: str


@task(name="collect", task_run_name="collect", **TASK_OPTIONS)  # type: ignore[call-overload]
def collect_task(store: ByteStore, keys: list[str], workdir: Path) -> list[Path]:
    """Every chunk's stored segment (``keys``, in order), readable in ``workdir``
    (``read_locally``; the coordinator renders nothing: its parts stored them)."""
    segments = []
    for key in keys:
        segment = workdir / "chunks" / key.rsplit("/", 1)[-1]
        segment.parent.mkdir(parents=True, exist_ok=True)
        if not is_stored(store, key):  # deleted since its part stored it: another try
            raise TransientError("A rendered chunk went missing.", detail=key)
        read_locally(store, key, segment)
        segments.append(segment)
    return segments


@task(name="join", task_run_name="join", **TASK_OPTIONS)  # type: ignore[call-overload]
def join_task(segments: list[Path], video: Path, out: Path, info: VideoInfo) -> VideoInfo:
    """Concatenate the segments and mux the input ``video``'s audio into ``out``."""
    return join_segments(segments, video, out, source_info=info)


@dataclass
class Signer:
    """What a video result is signed with (``store_task``): the marker (None: marking
    off) and the job's inputs, its ingredients."""

    marker: Marker | None
    sources: list[bytes] = field(default_factory=list)
    references: list[bytes] = field(default_factory=list)
    digest: str = ""  # the target video's SHA-256


@task(name="store", task_run_name="store", **TASK_OPTIONS)  # type: ignore[call-overload]
def store_task(
    store: ByteStore, result: Path, signer: Signer, ref: VideoResultRef, meta_key: str
) -> None:
    """The result file (signed with its Content Credentials when there is a marker:
    ``tasks.provenance``), then its sidecar (last: its presence means the video is whole)."""
    if signer.marker is not None:
        target = Ingredient("target", ref.content_type, signer.digest)
        signed = result.with_name(f"{result.stem}.signed{result.suffix}")
        ingredients = input_ingredients(signer.sources, target, signer.references)
        signer.marker.sign_file(result, signed, ref.content_type, ingredients)
        result = signed
    put_from(store, ref.key, result)
    write_to(store, meta_key, ref.model_dump_json().encode())


def video_marks(marking: bool, info: VideoInfo) -> list[str]:
    """A video result's marks: none without marking; else its manifest, and the watermark
    when its frames are large enough to carry one (``watermark.MIN_PIXELS``)."""
    if not marking:
        return []
    return ["c2pa", *(["watermark"] if info.width * info.height >= MIN_PIXELS else [])]


@dataclass(frozen=True, slots=True)
class StoredPlan:
    """What the probe part stores (``planned`` None) and the plan part then stores for the
    render and report parts and the coordinator. The keys of the analysed ranges and of
    the chunks are made by the parts (they depend on the pipeline's context: detector
    input size, model pins, the job's watermark), so the coordinator reads them here."""

    digest: str
    probed: Probed
    planned: Planned | None = None
    ranges: list[tuple[int, int]] = field(default_factory=list)  # the analysis parts' frames
    analysis_keys: list[str] = field(default_factory=list)  # one per range
    chunk_keys: list[str] = field(default_factory=list)  # one per planned chunk


PLAN_MAGIC = b"FFPLAN1"
"""The first bytes of a stored plan: then its HMAC-SHA256 (32 bytes), then the pickle."""

#: What a stored plan may name besides FaceFlow's own classes: numpy's arrays, fractions.
_PLAN_GLOBALS = {
    ("fractions", "Fraction"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy._core.numeric", "_frombuffer"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy.core.numeric", "_frombuffer"),
}


class _PlanUnpickler(pickle.Unpickler):
    """Unpickles classes of ``tasks``/``flows`` and numpy arrays only: no function of
    another module can be called while a plan is read."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _PLAN_GLOBALS:
            return super().find_class(module, name)
        if module.split(".")[0] in ("tasks", "flows"):
            found = super().find_class(module, name)
            if isinstance(found, type):
                return found
        raise pickle.UnpicklingError(f"a video plan may not name {module}.{name}")


def plan_mac(key: str, body: bytes) -> bytes:
    """The HMAC-SHA256 of a stored plan's pickle ``body`` under run-signing ``key``."""
    return hmac.new(key.encode(), PLAN_MAGIC + body, hashlib.sha256).digest()


def save_plan(store: ByteStore, key: str, plan: StoredPlan) -> None:
    """Store a plan: pickled, behind an HMAC with the run-signing key (the key that binds
    runs to jobs, ``flows.binding.worker_keys``), so that only FaceFlow's flows can write
    one that another process reads."""
    body = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
    keys = worker_keys()
    if not keys:
        raise RunBindingInvalid(detail="no run-signing key: a video plan cannot be stored")
    write_to(store, key, PLAN_MAGIC + plan_mac(keys[0], body) + body)


def load_plan(store: ByteStore, key: str) -> StoredPlan:
    """The plan the analysis part stored under ``key``; ``InvalidInput`` when its HMAC
    matches no accepted key (written by something else) or it names a foreign global."""
    data = read_from(store, key)
    head, rest = data[: len(PLAN_MAGIC)], data[len(PLAN_MAGIC) :]
    mac, body = rest[:32], rest[32:]
    if head != PLAN_MAGIC or not any(
        hmac.compare_digest(mac, plan_mac(k, body)) for k in worker_keys()
    ):
        raise InvalidInput(detail=f"{key} holds no video plan signed by this service")
    try:
        plan = _PlanUnpickler(io.BytesIO(body)).load()
    except pickle.UnpicklingError as exc:
        raise InvalidInput(detail=f"{key}: {exc}") from exc
    except (AttributeError, ImportError, TypeError) as exc:  # signed by us, older code
        raise TransientError(
            "The video plan was stored by another version of FaceFlow.",
            detail=f"{key}: {type(exc).__name__}: {exc}"[:300],
        ) from exc
    if not isinstance(plan, StoredPlan):
        raise InvalidInput(detail=f"{key} holds no video plan")
    return plan


def sweep_workdirs(root: Path | None = None) -> int:
    """Remove the temporary directories of attempts whose process is gone; how many."""
    removed = 0
    for path in (root or Path(tempfile.gettempdir())).glob(f"{WORKDIR_PREFIX}*-*"):
        pid = path.name.removeprefix(WORKDIR_PREFIX).split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)) and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def guarded(stage: str, deadline: Deadline) -> StageGuard:
    """The guard of video step ``stage`` under the job's deadline."""
    b = VIDEO_STAGES[stage]
    policy = StagePolicy(
        stage=cast(Any, stage),
        budget_s=b.budget_s,
        expected_s=b.expected_s,
        retries=b.retries,
        retry_delay_s=RETRY_DELAY_S,
    )
    return StageGuard(deadline, policy)
