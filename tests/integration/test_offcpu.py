"""Off-CPU and wall-clock profiles (bpf/offcpu.bpf.c, ``flamed record --mode``)
against workloads that measure their own waits: real BPF, real interpreters.

tests/workloads/offcpu_truth.py runs threads that sleep, wait on a lock, block
on a pipe and sleep once across several drains, each in a function of its own
that measures its off-CPU time (wall minus thread CPU time); the profile must
put the same time under each function.
"""

from __future__ import annotations

import json
import shutil
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cpython_support import DEBIAN_311, pyenv_python

from flamed.folded import read_folded
from flamed.model import Stack
from support import ROOT, need

FLAMED = [sys.executable, "-m", "flamed"]
TRUTH = str(ROOT / "tests" / "workloads" / "offcpu_truth.py")

pytestmark = [pytest.mark.bpf, pytest.mark.slow, pytest.mark.usefixtures("require_bpf")]


def _record(args: list[str], timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(FLAMED + ["record", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def _truth_function(stack: Stack) -> str | None:
    """The innermost truth_* function of a stack: ``truth_sleep`` for both
    ``truth_sleep.<locals>.body (...)`` (3.11+) and ``truth_sleep (...);body (...)``."""
    names = [f.split(" (", 1)[0].split(".", 1)[0] for f in stack]
    found = [n for n in names if n.startswith("truth_")]
    return found[-1] if found else None


def _interpreter(name: str) -> Path:
    if name == "debian-3.11":
        need(DEBIAN_311.exists(), f"Debian's {DEBIAN_311}")
        return DEBIAN_311
    return pyenv_python(name)


@pytest.mark.parametrize("interp", ["3.12", "debian-3.11", "3.8", "3.10", "3.13"])
def test_offcpu_time_under_each_function(tmp_path: Path, interp: str) -> None:
    exe = _interpreter(interp)
    out = tmp_path / "off.folded"
    r = _record(["--mode", "offcpu", "-o", str(out), "--", str(exe), TRUTH, "3", "3", "gil"])
    assert r.returncode == 0, r.stderr
    truth = json.loads(r.stdout.strip().splitlines()[-1])["blocked_s"]
    profile = read_folded(out.open("rb"))
    got: dict[str, float] = {}
    gil: dict[str, float] = {}
    for stack, w in profile.stacks.items():
        assert stack[-1] in ("[off-cpu: blocked]", "[off-cpu: preempted]", "[gil wait]"), stack
        name = _truth_function(stack) or "[outside]"
        got[name] = got.get(name, 0.0) + float(w) / 1e6
        if stack[-1] == "[gil wait]":
            gil[name] = gil.get(name, 0.0) + float(w) / 1e6
    for name, seconds in truth.items():
        assert abs(got.get(name, 0.0) - seconds) <= 0.2 * seconds, f"{interp} {name} {seconds} {got}\n{r.stderr}"
    # The long sleep spans several drains (0.5 s apart): counted in full.
    assert abs(got.get("truth_long_sleep", 0.0) - truth["truth_long_sleep"]) <= 0.05 * truth["truth_long_sleep"]
    total = sum(got.values())
    assert total - got.get("[outside]", 0.0) >= 0.95 * total, (interp, got)
    # The two spinners wait mostly for the GIL (the rest: preempted by the
    # other threads); a sleep of 3 s needs the GIL once, when it ends.
    for name in ("truth_gil_spin_a", "truth_gil_spin_b"):
        assert gil.get(name, 0.0) >= 0.4 * truth[name], f"{interp} {name} {truth[name]} {gil}\n{r.stderr}"
    assert gil.get("truth_long_sleep", 0.0) <= 0.1, (interp, gil)
    # Kernel frames of the wait under the Python function that waited.
    sleeps = [s for s in profile.stacks if _truth_function(s) == "truth_sleep" and s[-1] == "[off-cpu: blocked]"]
    # (clock_nanosleep from 3.11, select before)
    assert any(f.endswith("_[k]") and ("sleep" in f or "select" in f) for s in sleeps for f in s), sleeps[:3]


def test_a_sleep_across_drains_is_counted_in_full(require_bpf: None) -> None:
    """The library sampler, drained every 0.3 s while a thread sleeps 3 s.
    The child computes until the sampler has described it (a wait that begins
    before that has no Python frames: a loaded host may take longer than any
    fixed warm-up), then sleeps."""
    from flamed.sampling.bpf import BpfSampler, BpfSamplerOptions

    code = ("import select, sys, time\ndef nap_across_drains():\n    time.sleep(3)\n"
            "end = time.monotonic() + 60\n"
            "while time.monotonic() < end and not select.select([sys.stdin], [], [], 0)[0]: pass\n"
            "nap_across_drains()\n")
    s = BpfSampler(BpfSamplerOptions(frequency=49, pids=frozenset(), python=True, offcpu=True))
    s.start()
    off: dict[Stack, int] = {}

    def drain() -> None:
        for (_t, _i, _c, stack), ns in s.drain().offcpu.items():
            off[stack] = off.get(stack, 0) + ns

    child = None
    try:
        child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)
        s.add_pid(child.pid)
        deadline = time.monotonic() + 50
        while s.python_claim(child.pid)[0] is not True and time.monotonic() < deadline:
            time.sleep(0.1)
            drain()
        claim = s.python_claim(child.pid)
        assert claim[0] is True, claim
        off.clear()
        assert child.stdin is not None
        child.stdin.write(b"go\n")
        child.stdin.flush()
        while child.poll() is None and time.monotonic() < deadline + 30:
            time.sleep(0.3)
            drain()
        drain()
        stats = s.stats().offcpu_total
    finally:
        if child is not None and child.poll() is None:
            child.kill()
            child.wait(10)
        s.close()
    nap = sum(ns for st, ns in off.items() if any(f.startswith("nap_across_drains (") for f in st))
    top = sorted(off.items(), key=lambda kv: -kv[1])[:3]
    assert 2.95e9 <= nap <= 3.1e9, f"{nap} {stats} {top}"
    assert stats["OFF_CARRIED"] >= 1 and stats["CARRY_MISSING"] == stats["CARRY_EXPIRED"] == 0, f"{stats}"


SHORT_WAITS = """
import os, select, sys, time
def deep(n, f):
    return f() if n == 0 else deep(n - 1, f)
def short_sleep():
    time.sleep(0.0001)
def short_poll():
    r, w = os.pipe()
    os.write(w, b"x")
    select.select([r], [], [], 0.0001)
    os.close(r)
    os.close(w)
def long_sleep():
    time.sleep(0.005)
select.select([sys.stdin], [], [], 30)
end = time.monotonic() + float(sys.argv[1])
i = 0
while time.monotonic() < end:
    deep(i % 40, (short_sleep, short_poll, short_sleep, long_sleep)[i % 4])
    i += 1
"""


def test_stack_failures_of_short_waits_are_not_lost_samples(require_bpf: None) -> None:
    """A stack map of 4 buckets and a process that mostly waits below the
    threshold: its switches off the CPU collide in the stack map, but only the
    samples and the recorded waits that lost a stack count as lost.  Window.lost
    matches the samples' placeholders one for one (as without off-CPU time),
    Window.offcpu_lost the recorded waits' (never more than were recorded, and
    placeholders wherever it counts some), and the switches' own failures are
    counted apart (OFF_FETCH_EEXIST)."""
    from flamed.sampling.bpf import BpfSampler, BpfSamplerOptions

    s = BpfSampler(BpfSamplerOptions(frequency=49, pids=frozenset(), python=False, offcpu=True,
                                     stack_storage_size=4))
    s.start()
    lost = dict.fromkeys(("user_stack_eexist", "kernel_stack_eexist"), 0)
    off_lost = dict(lost)
    placeholders = dict(lost)
    off_stacks: dict[Stack, int] = {}
    child = None
    try:
        child = subprocess.Popen([sys.executable, "-c", SHORT_WAITS, "2"], stdin=subprocess.PIPE)
        s.add_pid(child.pid)
        assert child.stdin is not None
        child.stdin.write(b"go\n")
        child.stdin.flush()
        deadline = time.monotonic() + 60
        last = False
        while not last:
            last = child.poll() is not None or time.monotonic() > deadline
            if not last:
                time.sleep(0.3)
            w = s.drain(close_waits=last)
            for r in lost:
                lost[r] += w.lost[r]
                off_lost[r] += getattr(w, "offcpu_lost", {}).get(r, 0)
            for (_p, _t, _c, st), n in w.counts.items():
                placeholders["user_stack_eexist"] += n * ("[lost stack: EEXIST]" in st)
                placeholders["kernel_stack_eexist"] += n * ("[lost stack: EEXIST]_[k]" in st)
            for (_p, _t, _c, st), ns in w.offcpu.items():
                off_stacks[st] = off_stacks.get(st, 0) + ns
        assert child.wait(30) == 0
        stats = s.stats().offcpu_total
    finally:
        if child is not None and child.poll() is None:
            child.kill()
            child.wait(10)
        s.close()
    assert stats["OFF_BELOW"] > stats["OFF_COUNTED"] > 0, stats
    # a sample's lost stacks are its placeholders, one for one
    assert lost == placeholders, (lost, placeholders, stats)
    assert stats["OFF_FETCH_EEXIST"] > 0, stats
    # stack losses of waits below the threshold are not losses at all
    recorded = stats["OFF_COUNTED"] + stats["OFF_CARRIED"]
    assert sum(off_lost.values()) <= 2 * recorded, (off_lost, stats)
    assert off_lost["user_stack_eexist"] == stats["OFF_USTACK_EEXIST"]
    assert off_lost["kernel_stack_eexist"] == stats["OFF_KSTACK_EEXIST"]
    for r, frame in (("user_stack_eexist", "[lost stack: EEXIST]"),
                     ("kernel_stack_eexist", "[lost stack: EEXIST]_[k]")):
        shown = any(frame in st for st in off_stacks)
        assert shown == (off_lost[r] > 0), (r, off_lost, list(off_stacks)[:5])


WALL_WORKLOAD = """
import json, time
spent = {"wall_compute": 0.0, "wall_sleep": 0.0}
def wall_compute(seconds):
    t0 = time.monotonic()
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass
    spent["wall_compute"] += time.monotonic() - t0
def wall_sleep(seconds):
    t0 = time.monotonic()
    time.sleep(seconds)
    spent["wall_sleep"] += time.monotonic() - t0
w0, c0 = time.monotonic(), time.thread_time()
end = w0 + 4
while time.monotonic() < end:
    wall_compute(0.01)
    wall_sleep(0.09)
wall, cpu = time.monotonic() - w0, time.thread_time() - c0
print(json.dumps({"wall": wall, "cpu": cpu, **spent}))
"""


def test_wall_mode_shows_waits_in_proportion(tmp_path: Path) -> None:
    work = tmp_path / "wall.py"
    work.write_text(WALL_WORKLOAD)
    out = tmp_path / "wall.folded"
    r = _record(["--mode", "wall", "-r", "499", "-o", str(out), "--", sys.executable, str(work)])
    assert r.returncode == 0, r.stderr
    truth = json.loads(r.stdout.strip().splitlines()[-1])
    profile = read_folded(out.open("rb"))
    share = {"wall_compute": 0.0, "wall_sleep": 0.0}
    for stack, w in profile.stacks.items():
        for name in share:
            if any(f.startswith(name + " (") for f in stack):
                share[name] += float(w) / 1e6
    # Each function's wall time as it measured it: a compute step preempted
    # on a loaded host takes longer than its CPU time, and wall mode counts
    # that time under it (as CPU samples and [off-cpu: preempted]).
    for name in share:
        assert abs(share[name] - truth[name]) <= 0.2 * truth[name], (share, truth)
    total = sum(w for w in profile.stacks.values()) / 1e6
    assert share["wall_sleep"] / total >= 0.7, (share, total)


def test_pprof_says_off_cpu_nanoseconds(tmp_path: Path) -> None:
    go = shutil.which("go")
    need(go is not None, "go tool pprof (Debian golang-go)")
    assert go is not None
    out = tmp_path / "off.pb.gz"
    r = _record(["--mode", "offcpu", "-o", str(out), "--", sys.executable, "-c",
                 "import time\ndef pprof_nap():\n    time.sleep(0.5)\n"
                 "end = time.monotonic() + 0.3\nwhile time.monotonic() < end: pass\npprof_nap()\n"])
    assert r.returncode == 0, r.stderr
    raw = subprocess.run([go, "tool", "pprof", "-raw", str(out)], capture_output=True, text=True, timeout=120)
    assert raw.returncode == 0, raw.stderr
    assert "off_cpu/nanoseconds" in raw.stdout, raw.stdout[:2000]
    traces = subprocess.run([go, "tool", "pprof", "-traces", str(out)], capture_output=True, text=True, timeout=120)
    assert "pprof_nap" in traces.stdout and "Type: off_cpu" in traces.stdout, traces.stdout[:2000]
    from flamed.outputs.pprof import read_pprof

    p = read_pprof(out.read_bytes())
    assert p.labels["kind"] == "off_cpu" and p.labels["unit"] == "microseconds", p.labels
    nap = sum(float(w) for s, w in p.stacks.items() if any(f.startswith("pprof_nap") for f in s))
    assert 0.45e6 <= nap <= 0.6e6, nap


def test_a_wait_still_open_at_the_end_is_counted_up_to_it(tmp_path: Path) -> None:
    """A thread blocked when the recording stops keeps its wait so far."""
    out = tmp_path / "open.folded"
    # (record -d with a command writes the profile when the recording ends, then waits for it to exit)
    code = ("import time\ndef stuck_at_the_end():\n    time.sleep(6)\n"
            "end = time.monotonic() + 0.3\nwhile time.monotonic() < end: pass\nstuck_at_the_end()\n")
    t0 = time.monotonic()
    r = _record(["--mode", "offcpu", "-d", "3", "-o", str(out), "--", sys.executable, "-c", code])
    elapsed = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    stuck = sum(float(w) for s, w in read_folded(out.open("rb")).stacks.items()
                if any(f.startswith("stuck_at_the_end (") for f in s)) / 1e6
    # Began within the first second of the 3 s recording, ended with it.
    assert 1.8 <= stuck <= 3.05, (stuck, elapsed, r.stderr)



def test_no_thread_waits_longer_than_the_recording_of_a_large_process(tmp_path: Path) -> None:
    """-p of a process of 2,000 threads, -d 1.5: -d was counted from after the
    set-up of its threads (0.1 s and more), and one more drain ran past it before
    the last one, so threads were given up to 1.74 s of waits in 1.5 s."""
    code = ("import threading, time\n"
            "def napper():\n    while True:\n        time.sleep(0.3)\n"
            "for _ in range(2000):\n    threading.Thread(target=napper, daemon=True).start()\n"
            "print('ready', flush=True)\ntime.sleep(120)\n")
    target = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    out = tmp_path / "window.folded"
    try:
        assert target.stdout is not None and target.stdout.readline().strip() == "ready"
        r = _record(["--no-daemon", "--mode", "wall", "--root", "tid", "-p", str(target.pid), "-d", "1.5",
                     "-o", str(out)])
    finally:
        target.kill()
        target.wait(30)
    assert r.returncode == 0, r.stderr
    per_thread: dict[str, float] = {}
    for stack, w in read_folded(out.open("rb")).stacks.items():
        per_thread[stack[0]] = per_thread.get(stack[0], 0.0) + float(w) / 1e6
    assert len(per_thread) >= 1900, len(per_thread)
    longest = max(per_thread.values())
    # A thread is off the CPU for at most the recording (the last drain's flip is within
    # milliseconds of -d's end; 0.1 s leaves room for a loaded machine).
    assert longest <= 1.6, (longest, r.stderr)


def test_waits_of_a_process_read_by_pyspy_are_said_to_lack_python_frames(tmp_path: Path,
                                                                          require_pyspy: str) -> None:
    """py-spy's Python frames are joined with CPU samples by time; waits are
    summed in maps: the waits of a 3.7 process keep native and kernel frames
    only, and record says how much time that is instead of leaving it unsaid."""
    py37 = pyenv_python("3.7")
    out = tmp_path / "old.folded"
    code = "import time\ndef nap():\n    time.sleep(1.5)\nnap()\n"
    r = _record(["--mode", "offcpu", "-o", str(out), "--", str(py37), "-c", code])
    assert r.returncode == 0, r.stderr
    waited = sum(float(w) for w in read_folded(out.open("rb")).stacks.values()) / 1e6
    said = re.search(r"([0-9.]+) s of waits of the process\(es\) read by py-spy have native and kernel frames only",
                     r.stderr)
    assert said is not None and 1.4 <= float(said.group(1)) <= waited + 0.01, (waited, r.stderr)


def test_a_process_that_waits_since_before_the_recording_is_said_to(tmp_path: Path) -> None:
    """A process asleep (or stopped) since before the recording has no wait that
    begins in it, so nothing is measured: record says that its threads waited
    all along, since before it began, and not that the process "was not on a
    CPU ... record it while it works" or "did not wait 1000 us or longer"."""
    import signal  # noqa: PLC0415

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; print(flush=True); time.sleep(60)"],
                               stdout=subprocess.PIPE)
    try:
        assert sleeper.stdout is not None and sleeper.stdout.readline() == b"\n"
        out = tmp_path / "asleep.folded"
        for mode, how in (("wall", "blocked"), ("offcpu", "stopped")):
            if how == "stopped":
                sleeper.send_signal(signal.SIGSTOP)
            r = _record(["--mode", mode, "-p", str(sleeper.pid), "-d", "1", "-o", str(out)])
            assert r.returncode == 1, r.stderr
            assert (f"nothing was recorded: every thread of process {sleeper.pid} was {how} all along, in waits "
                    "that began before the recording") in r.stderr, r.stderr
            assert f"flamed dump -p {sleeper.pid}" in r.stderr, r.stderr
            assert "record it while it works" not in r.stderr and "did not wait" not in r.stderr, r.stderr
    finally:
        sleeper.kill()
        sleeper.wait()


def test_threads_waiting_all_along_beside_busy_ones_are_named(tmp_path: Path) -> None:
    """Some threads blocked since before the recording (a main thread in join), beside
    one that works: they were left out of a wall-clock profile without a word."""
    code = ("import threading, time\n"
            "def napper():\n    while True:\n        time.sleep(0.05)\n"
            "t = threading.Thread(target=napper)\nt.start()\nprint(flush=True)\nt.join()\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"\n"
        time.sleep(0.2)  # the main thread is in join()
        out = tmp_path / "some.folded"
        r = _record(["--mode", "wall", "--root", "tid", "-p", str(proc.pid), "-d", "1", "-o", str(out)])
    finally:
        proc.kill()
        proc.wait()
    assert r.returncode == 0, r.stderr
    assert read_folded(out.open("rb")).total() > 0
    assert (f"1 thread(s) of pid {proc.pid} are not in the profile (its main thread among them): they waited "
            "all along") in r.stderr, r.stderr
    assert f"tids {proc.pid};" in r.stderr, r.stderr


def test_wall_mode_of_a_waiting_service_against_pyspy(tmp_path: Path, require_pyspy: str) -> None:
    """The request-like service of tests/workloads/requests_wait.py (about 10 %
    computing, the rest sleeping, reading a socket, waiting on a lock):
    flamed's wall profile and ``py-spy record --idle``'s, in the same run,
    against the wall time each function measured (bench/wall_vs_pyspy.py
    gives the medians of several runs)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("wall_vs_pyspy", ROOT / "bench" / "wall_vs_pyspy.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    py = str(pyenv_python("3.12"))
    flamed, truth = bench.run_flamed(py, 3.0, tmp_path)
    pyspy, pyspy_truth = bench.run_pyspy(require_pyspy, py, 3.0, tmp_path)
    err = {f: abs(flamed[f] - truth[f]) for f in bench.FUNCTIONS}
    pyspy_err = {f: abs(pyspy[f] - pyspy_truth[f]) for f in bench.FUNCTIONS}
    detail = f"flamed {flamed} truth {truth}; py-spy {pyspy} truth {pyspy_truth}"
    # Waits in proportion: every function's share within 5 points of what it measured.
    assert max(err.values()) <= 0.05, detail
    # py-spy saw the same program: both tools name all four functions.
    assert all(pyspy[f] > 0 for f in bench.FUNCTIONS), detail
    print(f"max share error: flamed {max(err.values()):.3f}, py-spy --idle {max(pyspy_err.values()):.3f}")
