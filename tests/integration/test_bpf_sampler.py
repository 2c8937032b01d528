"""The BPF sampler against real workloads: a real program loaded by bcc,
sampling a C program built here, dd, and the machine around them.

Every workload exits on its own after a few seconds and is killed in a
finally; every sampler is closed in a finally.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from flamed.sampling.bpf import BpfSampler, BpfSamplerOptions, bpf_program
from flamed.errors import CapabilityError
from flamed.sampling.contract import Window
from support import ROOT, have_bcc, have_root, need

pytestmark = pytest.mark.bpf

WORKLOAD_SRC = ROOT / "tests" / "workloads" / "busy.c"
BUSY_FRAMES = ["main", "busy_outer", "busy_middle", "busy_leaf"]


@pytest.fixture(scope="module")
def busy_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/workloads/busy.c built with frame pointers (comm: flamed_busy)."""
    gcc = shutil.which("gcc")
    need(gcc is not None, "gcc (Debian gcc, libc6-dev) to build the C workload")
    assert gcc is not None
    out = tmp_path_factory.mktemp("workload") / "flamed_busy"
    subprocess.run(
        [gcc, "-O0", "-g", "-fno-omit-frame-pointer", "-o", str(out), str(WORKLOAD_SRC)],
        check=True, timeout=120,
    )
    return out


@contextmanager
def workload(*argv: str | Path) -> Iterator[subprocess.Popen[bytes]]:
    p = subprocess.Popen([str(a) for a in argv], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert p.stdout is not None
        # The workloads print "ready" at once (or die, which ends the read).
        assert p.stdout.readline().strip() == b"ready"
        yield p
    finally:
        p.kill()
        p.wait(timeout=10)


@pytest.fixture(scope="module")
def shared() -> Iterator[BpfSampler]:
    """One 199 Hz sampler for the tests that need no special options (a bcc
    compile costs seconds); each test drains first to start a clean window."""
    need(have_root(), "root (BPF and perf events need CAP_BPF/CAP_PERFMON)")
    need(have_bcc(), "bcc Python binding (Debian python3-bpfcc, under /usr/bin/python3)")
    s = BpfSampler(BpfSamplerOptions(frequency=199))
    try:
        s.start()
        yield s
    finally:
        s.close()


@contextmanager
def sampling(**kw: object) -> Iterator[BpfSampler]:
    s = BpfSampler(BpfSamplerOptions(**kw))  # type: ignore[arg-type]
    try:
        s.start()
        yield s
    finally:
        s.close()


def samples_of(w: Window, tgid: int) -> dict[tuple[str, ...], int]:
    out: dict[tuple[str, ...], int] = {}
    for (pid, _tid, _comm, stack), n in w.counts.items():
        if pid == tgid:
            out[stack] = out.get(stack, 0) + n
    return out


def contains_run(stack: tuple[str, ...], run: list[str]) -> bool:
    """``run`` appears in ``stack`` as consecutive frames."""
    n = len(run)
    return any(list(stack[i : i + n]) == run for i in range(len(stack) - n + 1))


def check_accounting(w: Window) -> None:
    assert w.samples == sum(w.counts.values()) + len(w.events) + w.lost["map_full"]


def test_busy_workload_has_its_frames_under_its_own_task(shared: BpfSampler, busy_bin: Path) -> None:
    s = shared
    with workload(busy_bin, "busy", "60") as p:
        s.drain()
        time.sleep(1.5)
        w = s.drain()
        check_accounting(w)
        mine = {k: n for k, n in w.counts.items() if k[0] == p.pid}
        assert sum(mine.values()) >= 20, f"too few samples of the workload: {sum(mine.values())}"
        assert {(tid, comm) for (_pid, tid, comm, _stack) in mine} == {(p.pid, "flamed_busy")}
        total = sum(mine.values())
        good = sum(n for (_p, _t, _c, stack), n in mine.items() if contains_run(stack, BUSY_FRAMES))
        # The rest is clock_gettime between the loops, and timer interrupts.
        assert good / total >= 0.7, sorted(mine.items(), key=lambda kv: -kv[1])[:5]
        assert w.start_ns < w.end_ns <= time.time_ns()

        # The process exits before the next drain: its symbols, cached by the
        # first drain, still name the samples it took in between.
        time.sleep(0.5)
        p.kill()
        p.wait(timeout=10)
        w2 = s.drain()
        check_accounting(w2)
        assert w2.start_ns == w.end_ns
        late = samples_of(w2, p.pid)
        assert late and any(contains_run(st, BUSY_FRAMES) for st in late)


def test_processes_that_exit_before_the_drain_keep_their_frames(shared: BpfSampler, busy_bin: Path) -> None:
    """Short-lived processes (0.1 s each, all gone when the drain runs): their
    maps were read when they were first sampled, so their frames are named."""
    s = shared
    s.drain()
    primed0 = s.stats().primed_total
    for _ in range(20):
        subprocess.run([str(busy_bin), "busy", "0.1"], stdout=subprocess.DEVNULL, timeout=30, check=True)
    w = s.drain()
    check_accounting(w)
    mine = {k: n for k, n in w.counts.items() if k[2] == "flamed_busy"}
    total = sum(mine.values())
    assert total >= 50, f"too few samples of the short-lived workloads: {total}"
    good = sum(n for (_p, _t, _c, stack), n in mine.items() if contains_run(stack, BUSY_FRAMES))
    unknown = sum(n for (_p, _t, _c, stack), n in mine.items() if stack and stack[0] == "[unknown]")
    # Without priming nearly all of them are "[unknown]" (every process gone).
    assert good / total >= 0.7, (good, unknown, sorted(mine.items(), key=lambda kv: -kv[1])[:5])
    assert s.stats().primed_total - primed0 >= 15
    assert len({k[0] for k in mine}) >= 15  # distinct processes


def test_syscall_heavy_workload_has_kernel_frames(shared: BpfSampler) -> None:
    s = shared
    dd = subprocess.Popen(["dd", "if=/dev/zero", "of=/dev/null", "bs=1", "count=1000000000"],
                          stderr=subprocess.DEVNULL)
    try:
        s.drain()
        time.sleep(1.5)
        w = s.drain()
    finally:
        dd.kill()
        dd.wait(timeout=10)
    mine = samples_of(w, dd.pid)
    total = sum(mine.values())
    assert total >= 20
    with_kernel = {st: n for st, n in mine.items() if any(f.endswith("_[k]") for f in st)}
    assert sum(with_kernel.values()) / total >= 0.3
    assert any(re.search(r"sys_(read|write)_\[k\]$", f) for st in with_kernel for f in st)
    for st in with_kernel:
        # Root first: the user frames, then the kernel ones, never interleaved.
        kinds = [f.endswith("_[k]") for f in st]
        assert kinds == sorted(kinds), st
        # A user process in a syscall has its user side too.
        assert not kinds[0], st


def test_drains_add_up_to_the_bpf_count_at_high_frequency(require_bpf: None, busy_bin: Path) -> None:
    """Many drains racing the program at 999 Hz: every sample exactly once."""
    windows: list[Window] = []
    with sampling(frequency=999) as s, workload(busy_bin, "busy", "60") as a, workload(busy_bin, "busy", "60") as b:
        s.watch(b.pid)  # events go through the generations too
        # By count, not by time: the first drains are slow (cold symbol
        # caches) on a loaded machine.  The deadline only bounds the loop.
        deadline = time.monotonic() + 60
        while len(windows) < 25 and time.monotonic() < deadline:
            time.sleep(0.03)
            windows.append(s.drain())
        s.stop()
        windows.append(s.drain())
        stats = s.stats()
        after_stop = s.drain()
    assert len(windows) >= 20
    for i, w in enumerate(windows):
        check_accounting(w)
        assert w.lost["map_full"] == 0
        assert all(e.tgid == b.pid for e in w.events)
        if i > 0:  # the first window has b's samples from before the watch
            assert not [k for k in w.counts if k[0] == b.pid]
    for prev, nxt in zip(windows, windows[1:]):
        assert prev.end_ns == nxt.start_ns
    total = sum(w.samples for w in windows)
    assert total == stats.samples_total == stats.bpf_samples_total
    assert total >= 500
    assert sum(samples_of(w, a.pid).get(st, 0) for w in windows for st in samples_of(w, a.pid)) > 0
    assert sum(len(w.events) for w in windows) > 0
    assert after_stop.samples == 0 and not after_stop.counts and not after_stop.events


def test_watched_process_gives_events_not_counts(shared: BpfSampler, busy_bin: Path) -> None:
    s = shared
    with workload(busy_bin, "busy", "60") as p:
        s.watch(p.pid)
        t0 = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        s.drain()  # start a clean window with the watch in place
        time.sleep(1.2)
        w = s.drain()
        t1 = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        check_accounting(w)
        assert not samples_of(w, p.pid)
        ev = [e for e in w.events if e.tgid == p.pid]
        assert len(ev) >= 20
        assert [e.ktime_ns for e in ev] == sorted(e.ktime_ns for e in ev)
        assert all(t0 < e.ktime_ns < t1 for e in ev)
        assert all(e.tid == p.pid and e.comm == "flamed_busy" and 0 <= e.cpu < os.cpu_count() for e in ev)
        good = [e for e in ev if contains_run(e.user_stack, BUSY_FRAMES)]
        assert len(good) / len(ev) >= 0.7
        assert all(not f.endswith("_[k]") for e in ev for f in e.user_stack)
        assert all(f.endswith("_[k]") for e in ev for f in e.kernel_stack)

        s.unwatch(p.pid)
        s.drain()
        time.sleep(0.5)
        w = s.drain()
        assert samples_of(w, p.pid) and not [e for e in w.events if e.tgid == p.pid]


def test_pid_filter(require_bpf: None, busy_bin: Path) -> None:
    with workload(busy_bin, "busy", "60") as a, workload(busy_bin, "busy", "60") as b:
        with sampling(frequency=199, pids=frozenset({a.pid})) as s:
            time.sleep(1.0)
            w = s.drain()
            assert samples_of(w, a.pid)
            assert {k[0] for k in w.counts} == {a.pid}
            assert s.stats().filtered_total > 0  # b, and everything else
            # The filter can change while sampling.
            s.add_pid(b.pid)
            s.remove_pid(a.pid)
            s.drain()
            time.sleep(0.8)
            w = s.drain()
            assert {k[0] for k in w.counts} == {b.pid}


def test_comm_filter(require_bpf: None, busy_bin: Path, tmp_path: Path) -> None:
    other = tmp_path / "flamed_other"
    shutil.copy(busy_bin, other)
    with workload(busy_bin, "busy", "60"), workload(other, "busy", "60") as o:
        with sampling(frequency=199, comms=frozenset({"flamed_other"})) as s:
            time.sleep(1.0)
            w = s.drain()
    assert {k[2] for k in w.counts} == {"flamed_other"}
    assert {k[0] for k in w.counts} == {o.pid}


def _cgroup2_root() -> Path | None:
    for line in Path("/proc/self/mounts").read_text().splitlines():
        parts = line.split()
        if len(parts) > 2 and parts[2] == "cgroup2":
            return Path(parts[1])
    return None


def test_cgroup_filter(require_bpf: None, busy_bin: Path) -> None:
    root = _cgroup2_root()
    need(root is not None and os.access(root, os.W_OK), "a writable cgroup v2 hierarchy")
    assert root is not None
    cg = root / f"flamed-test-{os.getpid()}"
    cg.mkdir()
    try:
        with workload(busy_bin, "busy", "60") as inside, workload(busy_bin, "busy", "60") as outside:
            (cg / "cgroup.procs").write_text(str(inside.pid))
            with sampling(frequency=199, cgroups=frozenset({str(cg)})) as s:
                time.sleep(1.0)
                w = s.drain()
        assert samples_of(w, inside.pid)
        assert {k[0] for k in w.counts} == {inside.pid}
        assert outside.pid not in {k[0] for k in w.counts}
    finally:
        deadline = time.monotonic() + 5
        while True:
            try:
                cg.rmdir()
                break
            except OSError:  # the killed workload may not have left yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


def test_tiny_stack_map_counts_collisions_and_shows_placeholders(require_bpf: None, busy_bin: Path) -> None:
    with sampling(frequency=199, stack_storage_size=4) as s, workload(busy_bin, "paths", "60", "12") as p:
        time.sleep(1.2)
        w = s.drain()
        stats = s.stats()
    check_accounting(w)
    eexist = w.lost["user_stack_eexist"] + w.lost["kernel_stack_eexist"]
    assert eexist > 0
    assert stats.lost_total["user_stack_eexist"] == w.lost["user_stack_eexist"]
    placeholders = sum(n for (_p, _t, _c, st), n in w.counts.items() if "[lost stack: EEXIST]" in st)
    kplaceholders = sum(n for (_p, _t, _c, st), n in w.counts.items() if "[lost stack: EEXIST]_[k]" in st)
    # One placeholder per lost stack id (a sample can lose both its stacks).
    assert placeholders == w.lost["user_stack_eexist"]
    assert kplaceholders == w.lost["kernel_stack_eexist"]
    assert samples_of(w, p.pid)


def test_print_bpf_is_what_loads(require_bpf: None) -> None:
    import bcc  # type: ignore[import-not-found]

    opts = BpfSamplerOptions(frequency=49, pids=frozenset({1}), stack_storage_size=1024, stack_depth=32)
    prog = bpf_program(opts)
    text = prog.render()
    assert prog.text in text and prog.header in text
    flags = re.search(r"^// bcc cflags: (.*)$", text, re.M)
    assert flags is not None
    cflags = flags.group(1).split()
    assert "-DFLAMED_FILTER_PIDS=1" in cflags and "-DFLAMED_STACK_DEPTH=32" in cflags
    b = bcc.BPF(text=text.encode(), cflags=cflags)
    try:
        b.load_func(b"flamed_sample", bcc.BPF.PERF_EVENT)
        assert b["stacks0"].max_entries == 1024
    finally:
        b.cleanup()


def test_broken_program_is_a_capability_error_with_the_compiler_message(require_bpf: None, tmp_path: Path) -> None:
    src = bpf_program().path.parent
    shutil.copy(src / "flamed.h", tmp_path / "flamed.h")
    (tmp_path / "profile.bpf.c").write_text((src / "profile.bpf.c").read_text() + "\nthis is not C;\n")
    s = BpfSampler(BpfSamplerOptions(bpf_dir=tmp_path))
    try:
        with pytest.raises(CapabilityError, match=r"could not compile(.|\n)*error"):
            s.start()
    finally:
        s.close()
    with pytest.raises(CapabilityError, match="FLAMED_BPF_DIR"):
        BpfSampler(BpfSamplerOptions(bpf_dir=tmp_path / "nowhere")).start()


def test_without_privileges_start_says_what_is_missing(require_bpf: None) -> None:
    capsh = shutil.which("capsh")
    need(capsh is not None, "capsh (Debian libcap2-bin)")
    assert capsh is not None
    code = (
        "import sys\n"
        "from flamed.sampling.bpf import BpfSampler\n"
        "from flamed.errors import CapabilityError\n"
        "try:\n"
        "    BpfSampler().start()\n"
        "except CapabilityError as e:\n"
        "    print(e); sys.exit(e.exit_code)\n"
    )
    r = subprocess.run(
        [capsh, "--drop=cap_sys_admin,cap_bpf,cap_perfmon", "--", "-c", f'exec "$0" -c "$1"', sys.executable, code],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )
    assert r.returncode == CapabilityError.exit_code, r.stderr
    assert "CAP_BPF" in r.stdout and "CAP_PERFMON" in r.stdout
