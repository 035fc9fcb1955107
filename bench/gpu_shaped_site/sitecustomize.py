"""Interpreter start-up hook of the GPU-shaped benchmark mode (``bench/gpu_shaped.py``).

The bench puts this folder on ``PYTHONPATH`` of the warm worker it starts, together with
``FACEFLOW_BENCH_GPU_MS``: every Python process of that worker (its warm children
included) then runs the pipeline's compute stages as fixed sleeps. Without the variable
it does nothing. ``FACEFLOW_BENCH_VIDEO_FRAME_MS`` likewise makes each rendered video frame
a fixed sleep (``bench/video_fanout.py``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

_MS = os.environ.get("FACEFLOW_BENCH_GPU_MS")
if _MS:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from bench.gpu_shaped import install

    install(float(_MS))
_FRAME_MS = os.environ.get("FACEFLOW_BENCH_VIDEO_FRAME_MS")  # bench/video_fanout.py
if _FRAME_MS:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from bench.video_fanout import install_frame_ms

    install_frame_ms(float(_FRAME_MS))
_DETECT_MS = os.environ.get("FACEFLOW_BENCH_VIDEO_DETECT_MS")  # bench/video_fanout.py
if _DETECT_MS:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from bench.video_fanout import install_detect_ms

    install_detect_ms(float(_DETECT_MS))
if os.environ.get("FACEFLOW_BENCH_TRACE"):  # bench/dispatch_trace.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from bench.dispatch_trace import install as install_trace

    install_trace()
