"""Mixed mode's loop and a process the BPF walker has not decided on yet."""

from __future__ import annotations

import subprocess
import sys
import time

from flamed.pyspy.mixed import MixedMode, MixedOptions
from flamed.pyspy.supervisor import PySpyOptions
from flamed.pyspy.watcher import WatchOptions
from flamed.sampling.pysource import Claim


def test_an_undecided_claim_is_asked_again_at_the_next_tick() -> None:
    """The walker answers "not decided yet" while its probe of a new process
    runs.  The loop used to sleep until the watcher's next job (a recheck, or
    the next /proc scan: here 30 s) before asking again, holding back the
    process's py-spy: a 2 s command under load kept Python frames on half its
    samples.  It asks again at the next tick."""
    asked: list[float] = []

    def claim(pid: int) -> Claim:
        asked.append(time.monotonic())
        # Undecided at the first asks (when followed, and at the loop's turn the follow wakes).
        return (None, "") if len(asked) <= 2 else (False, "unsupported_version")

    opts = MixedOptions(pyspy=PySpyOptions(binary="/nonexistent/py-spy"),
                        watch=WatchOptions(pids=frozenset(), scan_interval_s=30.0, exclude_self=True,
                                           use_connector=False))  # no other process's event wakes the loop
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    mixed = MixedMode(None, opts, claim=claim)
    try:
        mixed.start()
        time.sleep(0.5)  # a Python process already: followed, it is taken at once (no recheck due)
        t0 = time.monotonic()
        mixed.follow(child.pid)
        deadline = t0 + 10
        while child.pid not in mixed.decided and time.monotonic() < deadline:
            time.sleep(0.02)
        assert child.pid in mixed.decided, f"not decided in 10 s; asked at {[round(a - t0, 2) for a in asked]}"
        assert mixed.decided[child.pid][1] == "unsupported_version"
        assert len(asked) == 3, asked
    finally:
        mixed.close()
        child.kill()
        child.wait(10)
