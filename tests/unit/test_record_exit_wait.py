"""flamed record's sampling loop wakes when the target exits, not at its next drain."""

from __future__ import annotations

import subprocess
import sys
import time

from flamed.commands.record import _ExitWait


def test_the_wait_ends_when_the_target_exits() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    w = _ExitWait(child.pid)
    try:
        assert w.fd >= 0
        t0 = time.monotonic()
        w.wait(60.0)
        waited = time.monotonic() - t0
        # Not reaped by the wait: the loop's own check (poll) still gives the exit status.
        assert child.poll() == 0
        assert waited < 30.0, waited  # a sleep would have taken the whole 60 s
        assert w.fd == -1  # it exited: the descriptor is given back at once
        t0 = time.monotonic()
        w.wait(0.2)  # a later wait is a plain sleep, never a busy loop on a readable fd
        assert time.monotonic() - t0 >= 0.15
    finally:
        w.close()
        child.kill()
        child.wait()


def test_a_process_already_gone_is_slept_on() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: its pid names no process
    w = _ExitWait(child.pid)
    assert w.fd == -1
    t0 = time.monotonic()
    w.wait(0.2)
    assert time.monotonic() - t0 >= 0.15
    w.wait(0)
    w.close()
