"""`flamed record` in mixed mode on the ground-truth workload: real BPF, real py-spy.

tests/workloads/phases.py alternates 200 ms phases of a syscall-heavy and a
pure-compute Python function on its main thread and logs each phase start
(CLOCK_MONOTONIC); the recorded timeline is scored by tests/workloads/accuracy.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flamed.folded import read_folded
from support import ROOT, ctrl_c_deliverable
from tests.workloads.accuracy import accuracy

FLAMED = [sys.executable, "-m", "flamed"]
PHASES = str(ROOT / "tests" / "workloads" / "phases.py")

pytestmark = [pytest.mark.bpf, pytest.mark.pyspy, pytest.mark.slow]


def run_record(args: list[str], timeout: float = 120,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(FLAMED + ["record", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env=env)


@pytest.mark.parametrize("path", ["pyspy", "bpf"])
def test_record_command_attributes_phases(tmp_path: Path, require_bpf: None, require_pyspy: str,
                                          path: str) -> None:
    """Each sample in --timeline with its time, scored against the phases the
    workload logged: py-spy's samples (joined by time), and those whose Python
    frames the BPF program read (counted in maps, their times sent beside).
    Before, the BPF path, record's default, wrote an empty timeline."""
    log, tl, out = tmp_path / "phases.log", tmp_path / "timeline.txt", tmp_path / "out.folded"
    # The BPF path samples from the command's first instruction: no warm-up, half the cycles.
    cycles, env = ("10", None) if path == "pyspy" else ("5", dict(os.environ, PHASES_WARMUP_S="0"))
    r = run_record([*(["--pyspy"] if path == "pyspy" else []), "-r", "199", "-o", str(out), "--timeline", str(tl),
                    "--", sys.executable, PHASES, str(log), "200", cycles], env=env)
    assert r.returncode == 0, r.stderr
    assert ("read in BPF" in r.stderr) == (path == "bpf"), r.stderr
    acc = accuracy(str(log), str(tl))
    # enough samples to mean something, few enough for a loaded CI host
    assert acc.syscall_samples >= 10 and acc.compute_samples >= 30, acc
    assert acc.syscall >= 0.90, acc
    assert acc.compute >= 0.90, acc
    assert acc.background >= 0.90, acc
    text = out.read_text()
    # one stack reads python frames; native frames; kernel frames
    mixed = [ln for ln in text.splitlines()
             if "syscall_phase (" in ln and "do_syscall_64_[k]" in ln]
    assert mixed, text[:2000]
    frames = mixed[0].rsplit(" ", 1)[0].split(";")
    py = max(i for i, f in enumerate(frames) if f.startswith("syscall_phase ("))
    k = min(i for i, f in enumerate(frames) if f.endswith("_[k]"))
    assert py < k
    # Weights are BPF samples, and every one is on the timeline, with the stack it has in the profile.
    weights: dict[str, int] = {}
    for ln in tl.read_text().splitlines():
        stack = ln.split(" ", 3)[3]
        weights[stack] = weights.get(stack, 0) + 1
    assert weights == {ln.rsplit(" ", 1)[0]: int(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()}
    assert "not in the timeline" not in r.stderr, r.stderr


def test_record_returns_command_exit_code(tmp_path: Path, require_bpf: None, require_pyspy: str) -> None:
    r = run_record(["-o", str(tmp_path / "o.folded"), "--", sys.executable, "-c",
                    "import time; t=time.time()\nwhile time.time()-t<1: pass\nraise SystemExit(7)"])
    assert r.returncode == 7, r.stderr
    assert (tmp_path / "o.folded").stat().st_size > 0


def test_record_pid_with_duration_and_ctrl_c(tmp_path: Path, require_bpf: None, require_pyspy: str) -> None:
    log = tmp_path / "p.log"
    env = dict(os.environ, PHASES_WARMUP_S="0")
    target = subprocess.Popen([sys.executable, PHASES, str(log), "50", "400"], env=env)
    try:
        out = tmp_path / "p.folded"
        rec = subprocess.Popen(FLAMED + ["record", "--pyspy", "-p", str(target.pid), "-d", "60", "-o", str(out)],
                               cwd=ROOT, stderr=subprocess.PIPE, text=True, preexec_fn=ctrl_c_deliverable)
        # BPF compiles first (seconds on a loaded host): wait for py-spy to run, then record a little
        deadline = time.monotonic() + 90
        while not pyspy_children(rec.pid) and time.monotonic() < deadline and rec.poll() is None:
            time.sleep(0.2)
        time.sleep(3)
        rec.send_signal(signal.SIGINT)
        _, err = rec.communicate(timeout=60)
        assert rec.returncode == 130, err
        text = out.read_text()
        assert "compute_phase (" in text and "syscall_phase (" in text, err
        assert target.poll() is None  # recording never disturbed the target
    finally:
        target.kill()
        target.wait()


def test_record_subprocesses_follows_python_children(tmp_path: Path, require_bpf: None,
                                                     require_pyspy: str) -> None:
    parent = tmp_path / "parent.py"
    parent.write_text(
        "import subprocess, sys, time\n"
        "code = 'import time\\ndef child_work(end):\\n    while time.monotonic() < end: pass\\n"
        "child_work(time.monotonic() + 2.5)\\n'\n"
        "p = subprocess.Popen([sys.executable, '-c', code])\n"
        "def parent_work(end):\n    while time.monotonic() < end: sum(range(100))\n"
        "parent_work(time.monotonic() + 2.5)\n"
        "sys.exit(p.wait() + 3)\n")
    out = tmp_path / "sub.folded"
    r = run_record(["--subprocesses", "-o", str(out), "--", sys.executable, str(parent)])
    assert r.returncode == 3, r.stderr
    p = read_folded(out.open("rb"))
    roots: dict[str, set[str]] = {}
    for stack in p.stacks:
        for f in stack[1:]:
            if f.startswith(("child_work (", "parent_work (")):
                roots.setdefault(f.split(" ")[0], set()).add(stack[0])
    # each function under its own process's root frame (--root pid by default with --subprocesses)
    assert set(roots) == {"child_work", "parent_work"}, roots
    assert roots["child_work"].isdisjoint(roots["parent_work"]), roots


def test_record_interrupted_while_loading_keeps_the_earlier_output(tmp_path: Path, require_bpf: None,
                                                                   require_pyspy: str) -> None:
    """Ctrl-C while BPF is still compiling: nothing was recorded, so nothing is
    written; an output left there by an earlier run is kept (it used to be
    replaced by an empty profile).  Exit 130, no traceback, and the message says it."""
    target = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        out = tmp_path / "e.folded"
        out.write_text("earlier;run 7\n")
        rec = subprocess.Popen(FLAMED + ["record", "-p", str(target.pid), "-o", str(out)], cwd=ROOT,
                               stderr=subprocess.PIPE, text=True, preexec_fn=ctrl_c_deliverable)
        assert rec.stderr is not None
        first = rec.stderr.readline()  # "loading the BPF programs ..."
        assert "BPF" in first, first
        rec.send_signal(signal.SIGINT)
        _, err = rec.communicate(timeout=60)
        err = first + err
        assert rec.returncode == 130, err
        assert "Traceback" not in err, err
        assert (f"interrupted while the BPF programs loaded: process {target.pid} was not sampled") in err, err
        assert f"{out} was not written (the earlier file there is kept)" in err, err
        assert out.read_text() == "earlier;run 7\n"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["e.folded"]
    finally:
        target.kill()
        target.wait()


def pyspy_children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if (d / "comm").read_text().strip() == "py-spy" and \
                        int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
            except (OSError, ValueError, IndexError):
                continue
    return out


def test_record_without_bpf_falls_back_to_pyspy(tmp_path: Path, require_pyspy: str) -> None:
    out = tmp_path / "f.folded"
    r = run_record(["--no-bpf", "-o", str(out), "--", sys.executable, PHASES, str(tmp_path / "l"), "100", "6"])
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "py-spy alone" in ln]
    assert len(lines) == 1, r.stderr
    text = out.read_text()
    assert "compute_phase (" in text and "_[k]" not in text


def test_record_usage_errors_are_one_line() -> None:
    r = run_record([])
    assert r.returncode == 2 and "nothing to record: give -p PID or -- COMMAND" in r.stderr and "Traceback" not in r.stderr
    r = run_record(["-p", "999999999"])  # above Linux's PID_MAX_LIMIT: refused as it is parsed
    assert r.returncode == 2 and "argument -p/--pid" in r.stderr and "Traceback" not in r.stderr
    r = run_record(["-p", "4194304"])  # pid_max is at most 2^22: no task has this id
    assert r.returncode == 2 and "no process 4194304" in r.stderr


def test_record_pid_that_exits_while_bpf_compiles_says_so(tmp_path: Path, require_bpf: None) -> None:
    target = subprocess.Popen(["sleep", "600"])
    out = tmp_path / "gone.folded"
    rec = subprocess.Popen(FLAMED + ["record", "-p", str(target.pid), "-d", "5", "-o", str(out)],
                           cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        assert rec.stderr is not None
        first = rec.stderr.readline()  # printed before the compile starts
        assert "loading the BPF programs" in first, first
        target.kill()
        target.wait(10)  # reaped: the pid is gone, not a zombie
        _, err = rec.communicate(timeout=120)
    finally:
        for p in (rec, target):
            if p.poll() is None:
                p.kill()
                p.wait(10)
    assert rec.returncode != 0, err
    assert f"process {target.pid} exited before sampling began" in err, err
    # flamed's own lines (bcc may add its own noise at exit)
    ours = "\n".join(ln for ln in err.splitlines() if ln.startswith("flamed record"))
    assert "Python" not in ours, err


def test_record_native_processes_idle_or_busy(tmp_path: Path, require_bpf: None) -> None:
    idle = subprocess.Popen(["sleep", "600"])
    busy = subprocess.Popen(["sh", "-c", "while :; do :; done"])
    try:
        r = run_record(["-p", str(idle.pid), "-d", "2", "-o", str(tmp_path / "idle.folded")])
        assert r.returncode == 1, r.stderr
        assert "nothing was recorded" in r.stderr and "not on a CPU" in r.stderr, r.stderr
        assert "Python samples" not in r.stderr and "py-spy failures" not in r.stderr, r.stderr
        r = run_record(["-p", str(busy.pid), "-d", "2", "-o", str(tmp_path / "busy.folded")])
        assert r.returncode == 0, r.stderr
        assert "Python samples" not in r.stderr and "no Python process" in r.stderr, r.stderr
        assert read_folded(open(tmp_path / "busy.folded", "rb")).total() > 0
    finally:
        for p in (idle, busy):
            p.kill()
            p.wait(10)


def test_record_reads_python_frames_in_bpf(tmp_path: Path, require_bpf: None) -> None:
    """The default: CPython's frames read by the BPF program, no py-spy, every
    signature sample under its step; a 3.8 interpreter too (py-spy's join
    could not map its threads)."""
    sys.path.insert(0, str(ROOT / "tests" / "workloads"))
    from cpython_support import pyenv_python
    from py_truth_score import misattributed, score

    for exe in (sys.executable, str(pyenv_python("3.8"))):
        out = tmp_path / "bpf.folded"
        r = run_record(["-r", "199", "-o", str(out), "--", exe, str(ROOT / "tests" / "workloads" / "py_truth.py"), "3"])
        assert r.returncode == 0, r.stderr
        assert "read in BPF" in r.stderr and "py-spy" not in r.stderr, r.stderr
        stacks = list(read_folded(out.open("rb")).stacks.items())
        sc = score(stacks)
        # Samples whose Python frames name the wrong step are bounded apart
        # from samples that lost their Python frames (counted by the sampler).
        assert sc.signature >= 20 and sc.attributed_accuracy >= 0.995, (exe, sc, misattributed(stacks))
        assert sc.lost_share <= 0.02, (exe, sc, misattributed(stacks), r.stderr)
        assert sc.python_share >= 0.95, (exe, sc)


@pytest.mark.parametrize("minor", ["", "13"])
def test_record_names_a_freed_module_code_object_as_it_was_sampled(tmp_path: Path, require_bpf: None,
                                                                    minor: str) -> None:
    """A module's top level, sampled while it ran, keeps its name after its
    code object is freed and another takes its address: the names given when
    the stack was new, not read again at the drain (which named it after a
    code object that never ran).  Drains come every 0.5 s while the process
    runs on for 1.5 s after the import."""
    from support import need

    interp = Path(sys.executable) if not minor else _pyenv_python(minor)
    need(interp is not None, f"a pyenv python3.{minor} ($(pyenv root)/versions/3.{minor}.*)")
    assert interp is not None
    out = tmp_path / "freed.folded"
    r = run_record(["-r", "199", "-o", str(out), "--", str(interp),
                    str(ROOT / "tests" / "workloads" / "freed_code.py"), str(tmp_path), "1.2", "1.5"])
    assert r.returncode == 0, r.stderr
    if (tmp_path / "reused").read_text() != "1":
        pytest.skip("no code object took the freed one's address here (the allocator's choice)")
    stacks = [ln.rsplit(" ", 1)[0].split(";") for ln in out.read_text().splitlines()]
    module = [s for s in stacks if any(f.startswith("<module> (") and "spun_module.py:" in f for f in s)]
    wrong = [s for s in stacks if any("decoy_" in f for f in s)]
    assert len(module) >= 3, (len(stacks), r.stderr)
    assert not wrong, [[f for f in s if "decoy_" in f or "_call_with" in f] for s in wrong[:3]]
    assert any(f.startswith("after_import (") for s in stacks for f in s)


def _pyenv_python(minor: str) -> Path | None:
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    found = sorted(root.glob(f"3.{minor}.*/bin/python3.{minor}")) if root.is_dir() else []
    return found[-1] if found else None


@pytest.mark.parametrize("minor", ["8", "9", "10"])
def test_record_python_before_311_maps_pthread_ids(tmp_path: Path, require_bpf: None, require_pyspy: str,
                                                   minor: str) -> None:
    from support import need

    interp = _pyenv_python(minor)
    need(interp is not None, f"a pyenv python3.{minor} ($(pyenv root)/versions/3.{minor}.*)")
    assert interp is not None
    out = tmp_path / "old.folded"
    # Two threads for the whole run: the map must hold for more than the main thread.
    work = tmp_path / "two_threads.py"
    work.write_text("import runpy, sys, threading\n"
                    "done = threading.Event()\n"
                    "def side_work():\n"
                    "    while not done.is_set():\n"
                    "        sum(i * i for i in range(20000))\n"
                    "t = threading.Thread(target=side_work, name='side')\n"
                    "t.start()\n"
                    f"sys.argv = [{PHASES!r}, sys.argv[1], '100', '8']\n"
                    "try:\n"
                    f"    runpy.run_path({PHASES!r}, run_name='__main__')\n"
                    "finally:\n"
                    "    done.set()\n"
                    "    t.join()\n")
    r = run_record(["--pyspy", "-o", str(out), "--", str(interp), str(work), str(tmp_path / "p.log")])
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    lines = [ln.rsplit(" ", 1) for ln in text.splitlines()]
    total = sum(int(n) for _, n in lines)
    python = sum(int(n) for s, n in lines if ".py:" in s)
    side = sum(int(n) for s, n in lines if "side_work (" in s)
    # Most samples carry Python frames (none did before: py-spy named the threads by pthread id).
    assert total > 50 and python >= 0.8 * total, (python, total, r.stderr)
    assert side > 0.2 * total, (side, total)
    assert "not matched to an OS thread" not in r.stderr, r.stderr


LATE_THREADS = """\
import threading, time
def main_spin(t):
    end = time.time() + t
    while time.time() < end:
        sum(i * i for i in range(2000))
def late_worker(t):
    end = time.time() + t
    while time.time() < end:
        sum(i * i for i in range(2000))
def request_work():
    end = time.time() + 0.05
    while time.time() < end:
        sum(i * i for i in range(2000))
main_spin(2.5)
threads = [threading.Thread(target=late_worker, args=(2.0,)) for _ in range(2)]
for t in threads:
    t.start()
for t in threads:
    t.join()
# A thread per request: each takes the pthread id (glibc's struct pthread) of the one before.
for _ in range(20):
    t = threading.Thread(target=request_work)
    t.start()
    t.join()
"""


def test_threads_that_start_late_in_a_short_process_keep_python_frames(tmp_path: Path, require_bpf: None,
                                                                        require_pyspy: str) -> None:
    """py-spy's trace comes when its run ends, and a 3.7 thread is named by its
    pthread id, which only the live process's memory maps to an OS thread:
    threads started after py-spy's first run, in a process that exits before
    the next one ends, lost every Python frame (main_spin kept its frames,
    late_worker had none).  Their ids are now mapped while they run.  Threads
    of 50 ms, one after another, share one pthread id: every one of them
    gets the id's stack while it lived (request_work had almost none)."""
    from support import need

    interp = _pyenv_python("7")
    need(interp is not None, "a pyenv python3.7 ($(pyenv root)/versions/3.7.*)")
    assert interp is not None
    work = tmp_path / "late.py"
    work.write_text(LATE_THREADS)
    out = tmp_path / "late.folded"
    r = run_record(["-o", str(out), "--", str(interp), str(work)])
    assert r.returncode == 0, r.stderr
    assert "by py-spy" in r.stderr, r.stderr  # 3.7: the BPF walker leaves it to py-spy
    lines = [ln.rsplit(" ", 1) for ln in out.read_text().splitlines()]
    total = sum(int(n) for _, n in lines)
    late = sum(int(n) for s, n in lines if "late_worker (" in s)
    early = sum(int(n) for s, n in lines if "main_spin (" in s)
    request = sum(int(n) for s, n in lines if "request_work (" in s)
    # The threads' samples (Python's thread bootstrap, or the native start_thread when the
    # Python frames are missing): the main thread's first ones precede py-spy's attach,
    # which on a loaded host takes a second and more.
    in_threads = sum(int(n) for s, n in lines if "_bootstrap (" in s or "start_thread" in s)
    python_in_threads = sum(int(n) for s, n in lines if ("_bootstrap (" in s or "start_thread" in s) and ".py:" in s)
    assert total > 150 and in_threads > 50, (total, in_threads, r.stderr)
    assert python_in_threads >= 0.95 * in_threads, (python_in_threads, in_threads, r.stderr)
    # 2.5 s of main_spin, 2 s of two GIL-bound late workers, 20 x 50 ms of request_work:
    # ~45 %, ~36 % and ~18 % of the samples.
    assert late >= 0.2 * total and request >= 0.1 * total and early > 0, (late, request, early, total)
    assert "not matched to an OS thread" not in r.stderr, r.stderr


SUBINTERPRETER_SPIN = """\
import os, sys, time
try:
    import _interpreters as interpreters  # 3.13
except ImportError:
    import _xxsubinterpreters as interpreters  # 3.8-3.12
sub = interpreters.create()

def spin_main():
    end = time.monotonic() + 60
    while time.monotonic() < end:
        sum(i * i for i in range(1000))

with open(sys.argv[1] + ".tmp", "w") as f:
    f.write("ready")
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
spin_main()
"""


@pytest.mark.parametrize("minor", ["8", "12"])
def test_record_pid_of_a_process_with_a_subinterpreter(tmp_path: Path, require_bpf: None, minor: str) -> None:
    """``record -p`` of a process that made a subinterpreter before the
    recording: ``interpreters.head`` is that interpreter, whose one thread
    state (the main thread's) has no frame.  The walker reads the main
    interpreter: the busy main thread's samples are under ``spin_main``.
    Before, none had a Python frame (3.12: the walk found no frame; 3.8:
    the layout never validated and py-spy, given the process, read nothing)."""
    from support import need

    interp = _pyenv_python(minor)
    need(interp is not None, f"a pyenv python3.{minor} ($(pyenv root)/versions/3.{minor}.*)")
    assert interp is not None
    script, ready, out = tmp_path / "sub.py", tmp_path / "ready", tmp_path / "sub.folded"
    script.write_text(SUBINTERPRETER_SPIN)
    target = subprocess.Popen([str(interp), str(script), str(ready)])
    try:
        deadline = time.monotonic() + 30
        while not ready.exists() and target.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), "the target did not start"
        # -r: sampled here, not through a daemon; the native unwinder plays no part.
        r = run_record(["-p", str(target.pid), "-d", "2", "-r", "199", "--no-unwind", "-o", str(out)])
    finally:
        target.kill()
        target.wait(10)
    assert r.returncode == 0, r.stderr
    assert "read in BPF" in r.stderr, r.stderr
    stacks = [(ln.rsplit(" ", 1)[0], int(ln.rsplit(" ", 1)[1])) for ln in out.read_text().splitlines()]
    total = sum(n for _, n in stacks)
    spun = sum(n for s, n in stacks if f"spin_main ({script}:" in s)
    assert total >= 20, r.stderr
    assert spun >= 0.8 * total, (spun, total, r.stderr, stacks[:5])


TWO_THREADS = """
import threading, time
def spin_here(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass
def in_the_thread():
    for _ in range(4):
        spin_here(0.2)
        time.sleep(0.2)
t = threading.Thread(target=in_the_thread)
t.start()
spin_here(0.6)
time.sleep(0.6)
t.join()
"""


def test_record_writes_each_sample_at_its_time(tmp_path: Path, require_bpf: None) -> None:
    """``flamed record -o run.trace`` (and chrometrace, speedscope): every
    sample at its wall-clock time under its thread's root frame, Python frames
    read in BPF.  Before, record refused the trace format and wrote the
    others as the aggregated profile (no time order)."""
    out = tmp_path / "run.trace"
    t0 = time.time_ns()
    r = run_record(["-r", "99", "-o", str(out), "--", sys.executable, "-c", TWO_THREADS])
    t1 = time.time_ns()
    assert r.returncode == 0, r.stderr
    assert "samples in time order" in r.stderr and "not in the timeline" not in r.stderr, r.stderr
    lines = out.read_text().splitlines()
    assert lines[0].startswith("# flamed trace")
    rows = [ln.split(" ", 1) for ln in lines[1:]]
    times = [int(t) for t, _ in rows]
    assert times == sorted(times) and t0 <= times[0] and times[-1] <= t1, (t0, times[:3], times[-3:], t1)
    threads: dict[str, list[int]] = {}
    for (t, rest) in rows:
        stack, count = rest.rsplit(" ", 1)
        assert count == "1"
        threads.setdefault(stack.split(";", 1)[0], []).append(int(t))
        if "in_the_thread (<string>" in stack:
            assert "spin_here (<string>" in stack or "[" in stack, stack
    assert len(threads) == 2, list(threads)
    spun = [int(t) for (t, rest) in rows if "in_the_thread (<string>:" in rest and "spin_here (<string>:" in rest]
    # The thread spins 4 x 0.2 s with sleeps between: its spinning samples come in bursts.
    assert len(spun) >= 30, len(spun)
    gaps = sum(1 for a, b in zip(spun, spun[1:]) if b - a > 150_000_000)
    assert gaps >= 2, (gaps, spun)
    # flamed's own tools read it as a timeline: one speedscope track per thread.
    ss = tmp_path / "run.speedscope.json"
    e = subprocess.run(FLAMED + ["export", "-o", str(ss), str(out)], capture_output=True, text=True, timeout=60)
    assert e.returncode == 0, e.stderr
    import json

    doc = json.loads(ss.read_text())
    assert sorted(p["type"] for p in doc["profiles"]) == ["evented", "evented"], doc["profiles"][0]["type"]
