"""A video attempt's temporary directory is removed once its process is gone (a cancelled
or overdue run's child is killed before it can remove its own)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from flows.video import WORKDIR_PREFIX, sweep_workdirs


def test_directories_of_dead_processes_are_swept(tmp_path: Path) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    dead = tmp_path / f"{WORKDIR_PREFIX}{gone.stdout.strip()}-abc"
    live = tmp_path / f"{WORKDIR_PREFIX}{os.getpid()}-def"
    other = tmp_path / "fuse-video-notapid"
    for path in (dead, live, other):
        (path / "chunks").mkdir(parents=True)
        (path / "chunks" / "part.mp4").write_bytes(b"x" * 1000)
    assert sweep_workdirs(tmp_path) == 1
    assert not dead.exists() and live.exists() and other.exists()
