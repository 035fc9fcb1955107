"""The worker's claim journal: a dead predecessor's claims are handed over, a live one's
never (its ``flock`` is held while it lives), and a stray child is killed only if it is
the very process that was recorded."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from faceflow.worker.claims import Claim, ClaimJournal, identity_slug, kill_stray_child

HOLD = """
import sys, time
from pathlib import Path
from faceflow.worker.claims import ClaimJournal
journal = ClaimJournal(Path(sys.argv[1]), sys.argv[2])
assert journal.acquire() == []
journal.add("run-a")
journal.add("run-b", child_pid=1)
journal.remove("run-b")
print("held", flush=True)
time.sleep(float(sys.argv[3]))
"""


def _holder(state: Path, identity: str, seconds: float) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(state), identity, str(seconds)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_live_holder_keeps_its_claims_and_a_dead_ones_are_handed_over(tmp_path: Path) -> None:
    identity = identity_slug("gpu", "FaceFlowGpuWorker 1/2 x")
    assert "/" not in identity and " " not in identity
    holder = _holder(tmp_path, identity, 60)
    try:
        other = ClaimJournal(tmp_path, identity)
        assert other.acquire() is None  # a live worker holds this identity
        other.add("run-c")  # ... so this one journals nothing
        assert not other.held
    finally:
        holder.kill()
        holder.wait()
    successor = ClaimJournal(tmp_path, identity)
    left = successor.acquire()
    assert left is not None and [c.flow_run_id for c in left] == ["run-a"]
    successor.release()
    assert ClaimJournal(tmp_path, identity).acquire() == []  # handed over once


def test_a_stray_child_is_killed_only_if_it_is_the_recorded_process(tmp_path: Path) -> None:
    from faceflow.worker.claims import proc_start_time

    sleeper = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
    )
    try:
        started = proc_start_time(sleeper.pid)
        assert started
        # Not a faceflow child (another program reusing a PID): left alone.
        assert not kill_stray_child(Claim("run", sleeper.pid, started))
        # Same PID, another start time: a reused PID, left alone.
        assert not kill_stray_child(Claim("run", sleeper.pid, str(int(started) + 1)))
        assert sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait()
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", "faceflow.worker.child"],
        start_new_session=True,
    )
    try:
        time.sleep(0.1)
        assert kill_stray_child(Claim("run", child.pid, proc_start_time(child.pid) or ""))
        assert child.wait(timeout=5) < 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
