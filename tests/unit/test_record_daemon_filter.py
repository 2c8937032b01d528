"""The daemon's [sampling] filter as ``flamed record`` through it reads it from
``status["filter"]`` (flamed/commands/record_daemon.py), and what record learns
of its target's children (TargetWatch)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

from flamed.commands.record_daemon import DaemonRecording, TargetWatch, filter_excludes, filter_unchecked


def _status(**flt: list[object]) -> dict[str, object]:
    return {"filter": {"pids": [], "comms": [], "cgroups": [], "units": [], **flt}}


def test_a_comm_or_pid_the_filter_leaves_out_is_named() -> None:
    assert filter_excludes(_status(comms=["nginx"]), 42, "python3") == '[sampling] comms = ["nginx"]'
    assert filter_excludes(_status(comms=["nginx"]), 42, "nginx") == ""
    assert filter_excludes(_status(pids=[1, 2]), 42, "python3") == "[sampling] pids = [1, 2]"
    assert filter_excludes(_status(pids=[42]), 42, "python3") == ""
    assert filter_excludes(_status(), 42, "python3") == ""
    assert filter_excludes({}, 42, "python3") == ""  # an older daemon: nothing known


def test_cgroups_and_units_are_mentioned_not_judged() -> None:
    st = _status(units=["a.service"], cgroups=["/system.slice"])
    assert filter_excludes(st, 42, "python3") == ""
    assert filter_unchecked(st) == '[sampling] cgroups = ["/system.slice"] and [sampling] units = ["a.service"]'
    rec = DaemonRecording("/s", target=42, comm="python3", maybe_filtered=filter_unchecked(st))
    assert "may leave it out" in rec.nothing_reason() and "on no CPU" in rec.nothing_reason()
    rec = DaemonRecording("/s", target=42, comm="python3", filtered_out='[sampling] comms = ["nginx"]')
    assert rec.nothing_reason() == ('the daemon at /s samples only [sampling] comms = ["nginx"], which leaves out '
                                    "python3 (pid 42); --no-daemon records it here")


FORK_THEN_EXEC = """
import os, sys
pid = os.fork()
if pid == 0:
    sys.stdin.readline()  # under the parent's name until the test says go
    os.execvp("sleep", ["sleep", "20"])
print(pid, flush=True)
os.waitpid(pid, 0)
"""


def test_a_child_seen_before_its_exec_is_named_as_what_it_became() -> None:
    """A wrapper's child is first seen between fork and exec, under the wrapper's
    name: ``sh -c 'sleep 0.3; exit 7'`` was said to have started "sh (pid N)".
    The hint now names the child as what it execs into (sleep here)."""
    parent = subprocess.Popen([sys.executable, "-c", FORK_THEN_EXEC], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    kid = 0
    try:
        assert parent.stdout is not None and parent.stdin is not None
        kid = int(parent.stdout.readline())
        watch = TargetWatch(parent.pid)
        watch.update()
        first = watch.child
        assert first.endswith(f"(pid {kid})") and not first.startswith("sleep "), first  # not exec'd yet
        parent.stdin.write("go\n")
        parent.stdin.flush()
        deadline = time.monotonic() + 15
        while not watch.child.startswith("sleep ") and time.monotonic() < deadline:
            time.sleep(0.05)
            watch.update()
        assert watch.child == f"sleep (pid {kid})", (first, watch.child)
        assert f"it started sleep (pid {kid}), which record does not follow" in watch.child_hint(daemon=True)
    finally:
        if kid:
            # still the parent's child (it waits for it): not yet another process's id
            with contextlib.suppress(ProcessLookupError):
                os.kill(kid, signal.SIGKILL)
        parent.kill()
        parent.wait(10)
