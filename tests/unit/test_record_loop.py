"""flamed record's sampling loop: it wakes when the target exits (not at its next drain), and says at the end what its drains lost."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

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


def test_lost_stacks_of_samples_and_waits_are_said_at_the_end() -> None:
    """docs/offcpu.md says record prints the waits kept with a lost stack; it printed
    none (648 user-stack collisions in a recording of 3,000 threads, said nowhere),
    nor the CPU samples' own stack losses."""
    import io
    from types import SimpleNamespace

    from flamed.commands.record import RecordCommand
    from flamed.sampling.contract import Window

    err = io.StringIO()
    cmd = RecordCommand(stderr=err)
    cmd._identities, cmd._offcpu, cmd._timeline = {}, {}, []
    cmd._lost, cmd._offcpu_lost, cmd._samples_taken = {}, {}, 0
    windows = [Window(0, 1, samples=100, lost={"user_stack_eexist": 3, "map_full": 0}),
               Window(1, 2, samples=50, lost={"user_stack_eexist": 1, "kernel_stack_enomem": 2, "ringbuf_full": 4},
                      offcpu_lost={"user_stack_eexist": 648})]
    stats = SimpleNamespace(offcpu_total={"OFF_START_FULL": 5})
    sampler = SimpleNamespace(options=SimpleNamespace(offcpu=True), drain=lambda close_waits=False: windows.pop(0),
                              stats=lambda: stats)
    mixed = SimpleNamespace(process=lambda events: [])
    cmd._drain(sampler, mixed, [], {})
    assert err.getvalue() == ""  # said once, at the end
    cmd._drain(sampler, mixed, [], {}, last=True)
    said = err.getvalue()
    assert ("stacks lost in 6 of 150 CPU samples (counted under a [lost stack: ...] frame): "
            "kernel_stack_enomem=2, user_stack_eexist=4") in said, said
    assert "4 CPU samples came without their time" in said
    assert "stacks lost in 648 off-CPU waits" in said and "user_stack_eexist=648" in said
    assert "off_start_full=5 (the map of open waits was full)" in said
    assert "raise offcpu" not in said  # record has no such option


def test_a_daemon_holding_pyspy_samples_is_not_said_to_have_seen_the_target_off_the_cpu() -> None:
    """A CPython 3.7 service under the daemon's py-spy, recorded for a few seconds
    through the daemon: its samples wait in the daemon for py-spy's window, so none
    came back, and record said the daemon "saw it on no CPU"."""
    from flamed.commands.record_daemon import DaemonRecording

    def reason(version: str | None) -> str:
        rec = DaemonRecording(socket="/run/flamed/flamed.sock")
        rec.target, rec.comm, rec.version, rec.windows = 4242, "python3.7", version, 3
        return rec.nothing_reason()

    held = reason("3.7")
    assert "on no CPU" not in held
    assert held.startswith("no sample of python3.7 (pid 4242) came back in 3 window(s): it runs CPython 3.7, "
                           "whose Python frames the daemon takes from py-spy"), held
    assert "--no-daemon" in held
    assert reason("3.12").startswith("the daemon saw python3.7 (pid 4242) on no CPU in 3 window(s)")
    assert reason(None).startswith("the daemon saw python3.7 (pid 4242) on no CPU")


def test_a_sample_without_frames_has_the_same_stack_on_the_timeline_and_in_the_profile(tmp_path: Path) -> None:
    """A sample whose user and kernel stacks both failed has no frame: the profile
    files it under ``[no frames]``; the timeline wrote an empty stack, so the two
    disagreed (seen once in the suite, a record --pyspy --timeline of a workload)."""
    import argparse

    from flamed.commands.record import RecordCommand
    from flamed.sampling.contract import SampleEvent

    cmd = RecordCommand()
    cmd._identities, cmd._offcpu = {}, {}
    samples = [(SampleEvent(ktime_ns=10, tgid=7, tid=7, comm="app", user_stack=(), kernel_stack=()), ()),
               (SampleEvent(ktime_ns=20, tgid=7, tid=8, comm="app", user_stack=(), kernel_stack=()), ("main", "f"))]
    args = argparse.Namespace(root=None, subprocesses=False, mode="cpu", rate=99)
    profile = cmd._profile(args, samples, {}, None)
    path = tmp_path / "timeline.txt"
    cmd._write_timeline(str(path), samples)
    lines = path.read_text().splitlines()
    assert lines == ["10 7 7 [no frames]", "20 7 8 main;f"]
    on_timeline = {tuple(ln.split(" ", 3)[3].split(";")) for ln in lines}
    assert on_timeline == set(profile.stacks), (on_timeline, profile.stacks)
