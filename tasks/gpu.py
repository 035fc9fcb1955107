"""Torch device selection and GPU telemetry through pynvml (degrades to "no GPU")."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

DEVICE_ENV = "FACEFLOW_DEVICE"
THREADS_ENV = "OMP_NUM_THREADS"


def select_device(prefer: str | None = None) -> str:
    """``cuda`` when available (or asked for via ``prefer``/``$FACEFLOW_DEVICE``), else ``cpu``."""
    import torch

    wanted = prefer or os.environ.get(DEVICE_ENV) or "auto"
    if wanted == "cpu":
        return "cpu"
    if torch.cuda.is_available():
        return "cuda" if wanted in ("auto", "cuda") else wanted
    return "cpu"


def use_torch_threads(threads: int) -> int:
    """Give torch ``threads`` intra-op threads on the CPU (for this process; threads that
    start later take the same) unless the operator set ``$OMP_NUM_THREADS``, which wins;
    returns the count in use."""
    import torch

    if threads > 0 and not os.environ.get(THREADS_ENV):
        torch.set_num_threads(threads)
    return int(torch.get_num_threads())


@dataclass(frozen=True, slots=True)
class GpuStats:
    """Memory and utilisation of the visible GPU, or ``available=False``."""

    available: bool
    name: str | None = None
    memory_used_mb: float | None = None
    memory_total_mb: float | None = None
    utilization_pct: float | None = None
    torch_peak_mb: float | None = None
    reason: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def gpu_stats(index: int = 0) -> GpuStats:
    """Telemetry for GPU ``index`` (as pynvml numbers it); never raises."""
    try:
        import pynvml
    except ImportError:
        return GpuStats(available=False, reason="pynvml not installed")
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return GpuStats(available=False, reason=f"no GPU ({type(exc).__name__})")
    try:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible and visible.split(",")[0].strip().isdigit():
            index = int(visible.split(",")[0])
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
        util = pynvml.nvmlDeviceGetUtilizationRates(handle)
        name = pynvml.nvmlDeviceGetName(handle)
        return GpuStats(
            available=True,
            name=name.decode() if isinstance(name, bytes) else str(name),
            memory_used_mb=mem.used / 2**20,
            memory_total_mb=mem.total / 2**20,
            utilization_pct=float(util.gpu),
            torch_peak_mb=_torch_peak_mb(),
        )
    except Exception as exc:
        return GpuStats(available=False, reason=f"no GPU ({type(exc).__name__})")
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _torch_peak_mb() -> float | None:
    try:
        import torch

        if torch.cuda.is_available():
            return float(torch.cuda.max_memory_allocated()) / 2**20
    except Exception:
        return None
    return None
