"""Stopping the stack leaves nothing behind (issue 22: after Ctrl-C a ``prefect.engine``
process of a reconcile run survived ``faceflow up`` with parent 1, ignoring SIGTERM).

A service here is a stand-in for a Prefect worker: it starts a "flow-run" grandchild the
way Prefect's runner does (``start_new_session``: outside the service's process group)
and that grandchild ignores SIGTERM. Stopping the service, or ``faceflow up``'s loop
(``serve_forever``) on SIGINT after the service itself crashed and orphaned it, must end
every one of those processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from faceflow.supervisor import Service, process_table
from faceflow.testing.wait import poll

REPO = Path(__file__).resolve().parents[1]

#: A worker stand-in: starts a grandchild in a session of its own that ignores SIGTERM,
#: writes the grandchild's pid to argv[1]; with argv[2] == "crash" it exits a second later
#: (its grandchild is orphaned), else it waits to be stopped.
WORKER = textwrap.dedent(
    """
    import subprocess, sys, time
    grandchild = subprocess.Popen(
        [sys.executable, "-c",
         "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"],
        start_new_session=True,
    )
    with open(sys.argv[1] + ".tmp", "w") as out:
        out.write(str(grandchild.pid))
    import os; os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(1.0 if sys.argv[2] == "crash" else 600)
    """
)


def _wait_for_pid(path: Path, timeout: float = 30.0) -> int:
    written = poll(path.exists, timeout)
    assert written, f"no pid written to {path}"
    return int(path.read_text())


def _running(pid: int) -> bool:
    return pid in process_table()  # zombies do not count: they have exited


def _worker(tmp_path: Path, mode: str) -> Service:
    return Service(
        "worker",
        [sys.executable, "-c", WORKER, str(tmp_path / f"{mode}.pid"), mode],
        tmp_path / f"worker-{mode}.log",
    )


def test_stopping_a_service_ends_its_grandchild_in_another_session(tmp_path: Path) -> None:
    worker = _worker(tmp_path, "wait")
    worker.start()
    grandchild = _wait_for_pid(tmp_path / "wait.pid")
    try:
        assert os.getpgid(grandchild) != worker.pid  # out of reach of killpg
        started = time.monotonic()
        worker.stop(grace=1.0)
        assert not worker.alive()
        assert not _running(grandchild), "the flow-run grandchild survived the stop"
        assert time.monotonic() - started < 10
    finally:
        if _running(grandchild):
            os.kill(grandchild, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="child subreaper: Linux")
def test_faceflow_up_stops_an_orphaned_grandchild_on_sigint(tmp_path: Path) -> None:
    """``serve_forever`` as ``faceflow up`` runs it, in its own process: the worker crashes
    (orphaning its grandchild), then Ctrl-C; nothing of the stack may survive."""
    script = textwrap.dedent(
        f"""
        import sys
        from pathlib import Path
        from faceflow.stack import Stack, StackConfig, serve_forever
        from faceflow.supervisor import Service
        home = Path({str(tmp_path)!r})
        stack = Stack(StackConfig(home=home, external_prefect=None), progress=print)
        stack.supervisor.restart_backoff_s = 3600  # the crashed worker stays down
        stack.supervisor.start(Service("worker", [sys.executable, "-c", {WORKER!r},
                               str(home / "up.pid"), "crash"], home / "worker.log"))
        serve_forever(stack, poll_s=0.1)
        """
    )
    up = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    grandchild = _wait_for_pid(tmp_path / "up.pid")
    try:
        adopted = poll(lambda: process_table().get(grandchild, (0,))[0] == up.pid, 10)
        assert adopted, "the orphan was not adopted by faceflow up"
        up.send_signal(signal.SIGINT)
        output, _ = up.communicate(timeout=60)
        assert b"stopping the stack" in output, output
        assert not _running(grandchild), "the orphaned flow-run process survived faceflow up"
    finally:
        if up.poll() is None:
            up.kill()
        if _running(grandchild):
            os.kill(grandchild, signal.SIGKILL)
