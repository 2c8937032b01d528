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


POOL = """
import os, sys, time
def burn(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass
kids = []
for _ in range(2):
    pid = os.fork()
    if pid == 0:
        burn(0.4)
        if os.fork() == 0:  # a grandchild, reaped by its parent
            burn(0.2)
            os._exit(0)
        os.wait()
        os._exit(0)
    kids.append(pid)
print("started", flush=True)
for pid in kids:
    os.waitpid(pid, 0)
print("reaped", flush=True)
sys.stdin.readline()
"""


def test_the_cpu_time_of_children_record_does_not_sample_is_counted() -> None:
    """A pool of worker processes (multiprocessing, a prefork server): record
    samples the target alone, so it says how much CPU the processes the
    target started used (1.2 s here: two children, each with a grandchild),
    counted through their exits and reaping, and, once the target has exited
    but is not reaped, from the zombie it leaves."""
    parent = subprocess.Popen([sys.executable, "-c", POOL], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert parent.stdout is not None and parent.stdin is not None
        assert parent.stdout.readline() == b"started\n"
        watch = TargetWatch(parent.pid, "python3")
        watch.update()
        assert watch.children_max == 2 and watch.child.endswith(")"), watch
        assert watch.python_children  # forks of a Python process: what --subprocesses follows
        assert parent.stdout.readline() == b"reaped\n"
        watch._next_cpu = 0.0  # the next update reads again (it reads twice a second)
        watch.update()
        assert 1.1 <= watch.children_cpu_s <= 1.6, watch.children_cpu_s
        said = watch.unrecorded_children(daemon=False)
        assert said.startswith(f"the processes that {watch.comm} (pid {parent.pid}) started (") and \
            "up to 2 at once) used at least 1." in said and "--subprocesses" in said, said
        # Exited, not yet reaped: its CPU time is read from the zombie, not lost by the reaping.
        parent.stdin.close()
        deadline = time.monotonic() + 15
        while os.waitid(os.P_PID, parent.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        fresh = TargetWatch(parent.pid, "python3")
        fresh._next_cpu = time.monotonic() + 60  # throttled: only the exit makes it read
        fresh.update(parent)  # type: ignore[arg-type]
        assert 1.1 <= fresh.children_cpu_s <= 1.6, fresh.children_cpu_s
    finally:
        parent.kill()
        parent.wait(10)
    idle = TargetWatch(os.getpid())
    assert idle.unrecorded_children(daemon=True) == ""  # no child: nothing to say
