"""--subprocesses follows what a command starts in BPF, from the fork
(bpf/profile.bpf.c, flamed_forked/flamed_exited): a child's first wait, its
start-up and non-Python descendants are recorded, and a followed process
leaves the pid filter when it exits."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from flamed.folded import read_folded
from cpython_support import pyenv_python
from support import ROOT

FLAMED = [sys.executable, "-m", "flamed"]

pytestmark = pytest.mark.bpf

#: Blocks at once for 0.4 s (before anything could find it from user space), then spins.
CHILD = """
import time
def first_wait():
    time.sleep(0.4)
def then_busy():
    end = time.time() + 0.3
    while time.time() < end:
        pass
first_wait()
then_busy()
"""


def test_a_childs_first_wait_and_a_non_python_child_are_recorded(tmp_path: Path, require_bpf: None) -> None:
    """Before, a descendant was sampled from when user space found it (its exec
    through the proc connector, or a /proc scan): its first 0.4 s sleep was
    lost on every run, and the shell's `sleep` was not recorded at all."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    out = tmp_path / "sub.folded"
    exe = pyenv_python("3.12")
    r = subprocess.run(FLAMED + ["record", "--no-daemon", "--subprocesses", "--mode", "wall", "-o", str(out),
                                 "--", "sh", "-c", f"sleep 0.2; {exe} {script}; echo done"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    prof = read_folded(out.open("rb"))
    # The child's 0.4 s sleep, in us: with its Python frames when the walker read the
    # process before it slept (most runs), else with its native and kernel frames.
    first_wait = sum(w for s, w in prof.stacks.items() if s[0].startswith("python3.12-")
                     and any("nanosleep" in f for f in s) and s[-1] == "[off-cpu: blocked]")
    roots = {s[0].rsplit("-", 1)[0] for s in prof.stacks}
    assert first_wait >= 350_000, (first_wait, r.stderr)
    # sh is in the filter from its fork (record follows its own children while it starts
    # it), so the sleep it starts at once is followed too; and the moment before sh's
    # exec is filed under sh, not under record's name.
    assert roots == {"sh", "sleep", "python3.12"}, roots
    sleep = sum(w for s, w in prof.stacks.items() if s[0].startswith("sleep-"))
    assert sleep >= 150_000, (sleep, roots)


def test_followed_processes_leave_the_filter_and_threads_never_enter(require_bpf: None) -> None:
    """With the test process filtered: each child it starts is in the pid filter
    from its fork (marked as followed), a thread is not, and the entries of the
    children that exited are gone (200 of them: the filter holds 1,024)."""
    from flamed.sampling.bpf import BpfSampler, BpfSamplerOptions

    me = os.getpid()
    s = BpfSampler(BpfSamplerOptions(frequency=19, pids=frozenset({me}), follow_forks=True, prime=False))
    s.start()
    try:
        table = s._program.bpf["filter_pids"]

        def filtered() -> dict[int, int]:
            return {k.value: v.value for k, v in table.items()}

        def back_to_me() -> dict[int, int]:
            """The filter once exits have been seen (the exit program ran before the wait returned)."""
            deadline = time.monotonic() + 10
            while (now := filtered()) != {me: 1} and time.monotonic() < deadline:
                time.sleep(0.05)
            return now

        assert filtered() == {me: 1}
        for _ in range(200):
            subprocess.run(["true"], check=True)
        long = subprocess.Popen(["sleep", "30"])
        gone = threading.Event()
        t = threading.Thread(target=gone.wait, args=(30,))
        t.start()
        try:
            assert filtered() == {me: 1, long.pid: 2}
            assert t.native_id not in filtered()
        finally:
            gone.set()
            t.join(10)
            long.kill()
            long.wait(10)
        assert back_to_me() == {me: 1}
        # A followed process that user space then finds (a Python child, found by the
        # watcher) stays the program's to take out: its entry is gone after its exit too.
        found = subprocess.Popen(["sleep", "30"])
        s.add_pid(found.pid)
        assert filtered() == {me: 1, found.pid: 2}
        found.kill()
        found.wait(10)
        assert back_to_me() == {me: 1}
    finally:
        s.close()


def test_processes_user_space_added_leave_the_filter_after_their_exit(require_bpf: None) -> None:
    """A process added to the pid filter by user space (a Python descendant found
    by record's watcher) stayed in it after its exit: a recording that found
    more than 1,024 over its life filled the map.  The drain after the exit takes
    it out; a live one stays, a kernel thread too (`record -p 2`)."""
    from flamed.sampling.bpf import BpfSampler, BpfSamplerOptions

    s = BpfSampler(BpfSamplerOptions(frequency=19, pids=frozenset(), prime=False))
    s.start()
    kids = [subprocess.Popen(["sleep", "30"]) for _ in range(3)]
    try:
        table = s._program.bpf["filter_pids"]
        for k in kids:
            s.add_pid(k.pid)
        s.add_pid(2)  # kthreadd
        assert sorted(k.value for k in table.keys()) == sorted([2, *(k.pid for k in kids)])
        kids[0].kill()
        kids[0].wait(10)
        kids[1].kill()  # a zombie (not reaped yet) has exited too
        deadline = time.monotonic() + 10
        while Path(f"/proc/{kids[1].pid}/stat").read_text().rsplit(") ", 1)[1][0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        s.drain()
        assert sorted(k.value for k in table.keys()) == [2, kids[2].pid]
    finally:
        for k in kids:
            k.kill()
            k.wait(10)
        s.close()
