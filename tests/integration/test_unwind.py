"""Native stacks unwound from .eh_frame in the BPF program, on real binaries
built here without frame pointers (C, C++ with exceptions, Rust), on Debian's
stripped python3.11, and against `perf record --call-graph dwarf` frame by frame.

One sampler (unwinding and the Python walker on, a pid filter) serves the
module; each test adds its workload's pid, waits until the process is
described to the unwinder, throws away what was sampled before, and reads
one window of ~1.5 s.  Workloads end on their own and are killed in a finally.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from flamed.sampling.bpf import BpfSampler, BpfSamplerOptions
from flamed.sampling.symbols import Symbolizer
from flamed.sampling.unwind import ehframe
from flamed.sampling.unwind.tables import mapping_bias, parse_exec_map
from support import ROOT, have_bcc, have_root, need

sys.path.insert(0, str(ROOT / "tests" / "workloads"))
from late_library import names_libbz2  # noqa: E402

pytestmark = pytest.mark.bpf

SRC = ROOT / "tests" / "workloads" / "unwind"
CHAIN = ["main", "level_a", "level_b", "level_c", "leaf"]
PY_FRAME = re.compile(r" \(.*:\d+\)$")


def _tool(name: str, *extra: Path) -> str:
    for p in (shutil.which(name), *(str(e) for e in extra)):
        if p and os.access(p, os.X_OK):
            return p
    need(False, f"{name} to build an unwinding workload")
    raise AssertionError


@pytest.fixture(scope="module")
def bins(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The workloads, all built optimized and without frame pointers."""
    d = tmp_path_factory.mktemp("unwind")
    gcc, gxx = _tool("gcc"), _tool("g++")
    rustc = _tool("rustc", Path.home() / ".cargo" / "bin" / "rustc")
    out = {name: d / name for name in ("chain", "throw", "chainrs", "recurse", "jit", "nocfi", "lost")}
    builds = [
        [gcc, "-O2", "-fomit-frame-pointer", "-o", str(out["chain"]), str(SRC / "chain.c")],
        [gxx, "-O2", "-fomit-frame-pointer", "-o", str(out["throw"]), str(SRC / "throw.cpp")],
        [rustc, "-O", "-C", "force-frame-pointers=no", "-o", str(out["chainrs"]), str(SRC / "chain.rs")],
        [gcc, "-O2", "-fomit-frame-pointer", "-o", str(out["recurse"]), str(SRC / "recurse.c")],
        [gcc, "-O2", "-fomit-frame-pointer", "-o", str(out["jit"]), str(SRC / "jit.c")],
        [gcc, "-O2", "-fomit-frame-pointer", "-o", str(out["nocfi"]), str(SRC / "nocfi.c")],
        [gcc, "-O2", "-fomit-frame-pointer", "-o", str(out["lost"]), str(SRC / "lost.c")],
    ]
    for cmd in builds:
        subprocess.run(cmd, check=True, timeout=300, cwd=d, capture_output=True)
    return out


class RecordingSymbolizer(Symbolizer):
    """The real symbolizer, remembering the raw addresses of each user stack it names in a drain."""

    def __init__(self) -> None:
        super().__init__()
        self.raw: dict[int, set[tuple[tuple[int, ...], tuple[str, ...]]]] = collections.defaultdict(set)

    def begin_drain(self) -> None:
        super().begin_drain()
        self.raw.clear()  # the last drain's only: _record's measured window

    def user_stack(self, pid: int, addrs_leaf_first: list[int]) -> tuple[str, ...]:
        frames = super().user_stack(pid, addrs_leaf_first)
        self.raw[pid].add((tuple(addrs_leaf_first), frames))
        return frames


@pytest.fixture(scope="module")
def sampler() -> Iterator[tuple[BpfSampler, RecordingSymbolizer]]:
    need(have_root(), "root (BPF and perf events)")
    need(have_bcc(), "bcc Python binding (Debian python3-bpfcc, under /usr/bin/python3)")
    sym = RecordingSymbolizer()
    s = BpfSampler(BpfSamplerOptions(frequency=199, pids=frozenset(), python=True, unwind=True),
                   symbolizer=sym)
    s.start()
    try:
        yield s, sym
    finally:
        s.close()


Stacks = collections.Counter[tuple[str, ...]]


def _record(s: BpfSampler, argv: list[str], seconds: float = 1.5, *,
            kernel: bool = False, warm_libs: tuple[str, ...] = ()) -> tuple[int, Stacks, list[str]]:
    """Run ``argv`` (which must run seconds + 3 s or more; the tests give 15 s, so that a
    slow description on a loaded host still leaves a whole window), sample it once it is
    described (at once without unwinding); its pid, the user+Python stacks
    (with the kernel frames when ``kernel``) of one window, its exec maps.
    ``warm_libs``: libraries it maps while it starts (names in its maps) whose
    tables must be loaded first: once mapped, a second is sampled and drained
    (a large table is loaded when a sample lands in it), then the unwinder
    is waited for."""
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    try:
        s.add_pid(p.pid)
        deadline = time.monotonic() + 20
        next_drain = time.monotonic() + 1.0
        while s.options.unwind and not s.unwind_ready(p.pid):
            st = s.stats()
            why = (f"primed {st.primed_total}, late {st.prime_late_total}, throttled {st.prime_throttled_total}, "
                   f"lost {st.prime_lost_total}, gone {st.prime_missed_total}; unwinder idle: "
                   f"{s.unwinder is not None and s.unwinder.idle()}")
            assert p.poll() is None, f"{argv[0]} exited before it was described to the unwinder ({why})"
            assert time.monotonic() < deadline, f"the process was never described to the unwinder ({why})"
            if time.monotonic() >= next_drain:
                s.drain()  # as the daemon does: a process the priming thread never read is read then
                next_drain = time.monotonic() + 1.0
            time.sleep(0.01)
        time.sleep(0.3)  # the libraries the dynamic loader maps after the first description
        if warm_libs and s.unwinder is not None:
            maps_path = Path("/proc") / str(p.pid) / "maps"
            while not all(lib in maps_path.read_text() for lib in warm_libs):
                assert time.monotonic() < deadline, f"{warm_libs} never mapped"
                time.sleep(0.05)
            s.unwinder.submit(p.pid)  # described again with its libraries
            time.sleep(1.0)
            s.drain()  # its misses ask for the large tables
            while not s.unwinder.idle():
                assert time.monotonic() < deadline, "the unwinder did not settle"
                time.sleep(0.05)
        maps = (Path("/proc") / str(p.pid) / "maps").read_text().splitlines()
        s.drain()  # what was sampled before: frame-pointer stacks
        time.sleep(seconds)
        w = s.drain()
    finally:
        p.kill()
        p.wait(timeout=10)
        s.remove_pid(p.pid)
    # Every stack id the window's keys name was read (an unwound sample's unset
    # user stack id 0 was counted as a lost stack in every window).
    assert w.lost.get("stack_read_failed", 0) == 0, w.lost
    stacks: Stacks = collections.Counter()
    for (tgid, _tid, _comm, stack), n in w.counts.items():
        if tgid == p.pid:
            stacks[tuple(f for f in stack if kernel or not f.endswith("_[k]"))] += n
    return p.pid, stacks, maps


def _share(stacks: Stacks, leaf: str, chain: list[str]) -> tuple[float, int]:
    """Of the samples whose leaf-most user frame is ``leaf``: the share holding ``chain`` in order."""
    with_leaf = {s: n for s, n in stacks.items() if s and s[-1] == leaf}
    total = sum(with_leaf.values())

    def holds(s: tuple[str, ...]) -> bool:
        it = iter(s)
        return all(any(f == want for f in it) for want in chain)

    good = sum(n for s, n in with_leaf.items() if holds(s) and s[0] == "_start")
    return (good / total if total else 0.0), total


def test_c_chain_without_frame_pointers(sampler: tuple[BpfSampler, RecordingSymbolizer],
                                        bins: dict[str, Path]) -> None:
    s, _ = sampler
    _pid, stacks, _ = _record(s, [str(bins["chain"]), "15"])
    share, total = _share(stacks, "leaf", CHAIN)
    assert total >= 100, stacks.most_common(5)
    assert share >= 0.95, stacks.most_common(5)


def test_samples_taken_in_the_kernel_have_the_whole_user_chain(sampler: tuple[BpfSampler, RecordingSymbolizer],
                                                               bins: dict[str, Path]) -> None:
    s, _ = sampler
    _pid, stacks, _ = _record(s, [str(bins["chain"]), "15", "sys"], kernel=True)
    in_kernel = {st: n for st, n in stacks.items() if st[-1].endswith("_[k]")}
    total = sum(in_kernel.values())
    assert total >= 50, list(in_kernel)[:3]
    whole = sum(n for st, n in in_kernel.items()
                if st[0] == "_start" and [f for f in st if f in CHAIN] == CHAIN)
    assert whole / total >= 0.9, sorted(in_kernel.items(), key=lambda kv: -kv[1])[:3]


def test_frame_pointer_walk_loses_the_chain(bins: dict[str, Path]) -> None:
    """The same program without unwinding: what users saw before (the test above can fail)."""
    need(have_root(), "root (BPF and perf events)")
    need(have_bcc(), "bcc Python binding (Debian python3-bpfcc, under /usr/bin/python3)")
    with BpfSampler(BpfSamplerOptions(frequency=199, pids=frozenset(), unwind=False)) as s:
        _pid, stacks, _ = _record(s, [str(bins["chain"]), "15"])
    share, total = _share(stacks, "leaf", CHAIN)
    assert total >= 50
    assert share < 0.05, stacks.most_common(5)


def test_cpp_with_exceptions_and_inlining(sampler: tuple[BpfSampler, RecordingSymbolizer],
                                          bins: dict[str, Path]) -> None:
    s, _ = sampler
    _pid, stacks, _ = _record(s, [str(bins["throw"]), "15"])
    names = ["main", "outer(unsigned long)", "middle(unsigned long)", "work(unsigned long)"]
    share, total = _share(stacks, "work(unsigned long)", names)
    assert total >= 100, stacks.most_common(5)
    assert share >= 0.95, stacks.most_common(5)


def test_rust_release_build(sampler: tuple[BpfSampler, RecordingSymbolizer], bins: dict[str, Path]) -> None:
    s, _ = sampler
    _pid, stacks, _ = _record(s, [str(bins["chainrs"]), "15"])
    leaf = {s_: n for s_, n in stacks.items() if s_ and s_[-1].startswith("chain::leaf::")}
    total = sum(leaf.values())
    assert total >= 100, stacks.most_common(5)
    want = ["main", "chain::main::", "chain::level_a::", "chain::level_b::", "chain::level_c::", "chain::leaf::"]

    def holds(st: tuple[str, ...]) -> bool:
        it = iter(st)
        return st[0] == "_start" and all(any(f.startswith(w) for f in it) for w in want)

    assert sum(n for st, n in leaf.items() if holds(st)) / total >= 0.95, stacks.most_common(3)


def test_jit_code_by_its_frame_pointer_and_perf_map(sampler: tuple[BpfSampler, RecordingSymbolizer],
                                                    bins: dict[str, Path]) -> None:
    """Code generated at run time has no table: the unwinder follows its frame
    pointer back into the tables, and /tmp/perf-PID.map names it."""
    s, _ = sampler
    fp_before = s.stats().unwind_total["UW_FP_FRAMES"]
    pid, stacks, _ = _record(s, [str(bins["jit"]), "15"])
    # The workload is stopped before it ends, so its map is left to remove here.
    Path(f"/tmp/perf-{pid}.map").unlink(missing_ok=True)
    share, total = _share(stacks, "jitted_spin", ["main", "level_a", "level_b", "call_jit", "jitted_spin"])
    assert total >= 100 and share >= 0.95, stacks.most_common(3)
    assert s.stats().unwind_total["UW_FP_FRAMES"] - fp_before >= total


def test_rbp_zero_in_code_without_cfi_is_not_the_outermost_frame(
        sampler: tuple[BpfSampler, RecordingSymbolizer], bins: dict[str, Path]) -> None:
    """A routine without CFI in a binary that has tables (OpenBLAS's kernels in
    numpy's wheel, or any of its code before its large table is loaded) that
    uses rbp as a plain register: reached with rbp == 0, the walk cannot go on
    and says so, instead of calling ``no_cfi;spin`` a complete stack."""
    s, _ = sampler
    _pid, stacks, _ = _record(s, [str(bins["nocfi"]), "15"])
    with_leaf = {st: n for st, n in stacks.items() if st and st[-1] == "spin"}
    total = sum(with_leaf.values())
    said = sum(n for st, n in with_leaf.items() if st[0] == "[truncated: no table]" and st[1:] == ("no_cfi", "spin"))
    complete_looking = sum(n for st, n in with_leaf.items() if st[0] == "no_cfi")
    assert total >= 30, stacks.most_common(3)  # 1.5 s at 199 Hz, on a loaded host
    assert complete_looking == 0 and said / total >= 0.95, with_leaf


def test_a_walk_lost_outside_every_mapping_is_not_complete(
        sampler: tuple[BpfSampler, RecordingSymbolizer], bins: dict[str, Path]) -> None:
    """A return address outside every mapping with rbp == 0 (gevent's
    greenlets: the C stack above greenlet's g_switch) read as a complete
    ``[unknown];spin``; it is a walk that lost its way."""
    s, _ = sampler
    _pid, stacks, _ = _record(s, [str(bins["lost"]), "15"])
    with_leaf = {st: n for st, n in stacks.items() if st and st[-1] == "spin"}
    total = sum(with_leaf.values())
    said = sum(n for st, n in with_leaf.items() if st == ("[truncated: no table]", "[unknown]", "spin"))
    assert total >= 30 and said / total >= 0.95, with_leaf


def test_depth_limit_is_said(sampler: tuple[BpfSampler, RecordingSymbolizer], bins: dict[str, Path]) -> None:
    s, _ = sampler
    before = s.stats().unwind_total["UW_DEPTH"]
    _pid, deep, _ = _record(s, [str(bins["recurse"]), "200", "15"])
    total = sum(deep.values())
    cut = sum(n for st, n in deep.items() if st and st[0] == "[truncated: depth limit]")
    assert total >= 100 and cut / total >= 0.9, deep.most_common(3)
    assert s.stats().unwind_total["UW_DEPTH"] - before >= cut
    # Within the limit: whole, down to _start.
    _pid, shallow, _ = _record(s, [str(bins["recurse"]), "20", "15"])
    whole = sum(n for st, n in shallow.items() if st and st[0] == "_start" and st.count("descend") == 21)
    assert whole / sum(shallow.values()) >= 0.9, shallow.most_common(3)


def test_samples_differing_only_in_their_leaf_share_one_stored_stack(
        sampler: tuple[BpfSampler, RecordingSymbolizer]) -> None:
    """An interpreter's leaf is anywhere in its evaluation loop: the program
    stores each caller chain once (the leaf address travels in the count
    key), and the drain still names every sample with its own leaf."""
    py = Path("/usr/bin/python3.11")
    need(py.exists(), "Debian's /usr/bin/python3.11")
    code = "import time\nend = time.time() + 15\nwhile time.time() < end:\n    sum(i * i for i in range(5000))\n"
    s, sym = sampler
    pid, stacks, _maps = _record(s, [str(py), "-c", code], seconds=2.0)
    assert stacks, "no samples of the workload"
    named = [addrs for addrs, _frames in sym.raw[pid] if len(addrs) > 1]
    leaves = {a[0] for a in named}
    chains = {a[1:] for a in named}
    # Many leaves (the workload's stacks differ below their callers), few chains above them.
    assert len(leaves) >= 20, (len(leaves), len(chains))
    assert len(chains) * 3 <= len(named), (len(named), len(chains))
    # What the program stored: one entry per chain (any process's in the window), not per sample.
    assert s.stats().last_unwound_stacks < len(named), (s.stats().last_unwound_stacks, len(named))
    # Every leaf is named as the leaf of its own stack.
    whole = [st for st in stacks if st and st[0] == "_start"]
    assert sum(stacks[st] for st in whole) >= 0.9 * sum(stacks.values()), stacks.most_common(3)


def test_debian_python311_native_frames(sampler: tuple[BpfSampler, RecordingSymbolizer]) -> None:
    py = Path("/usr/bin/python3.11")
    need(py.exists(), "Debian's /usr/bin/python3.11")
    code = (
        "import hashlib, json, threading, time, zlib\n"
        "def digest(d): return hashlib.sha256(d).digest()\n"
        "def pack(d): return zlib.compress(d, 6)\n"
        "def dump(o): return json.dumps(o)\n"
        "def pure(n): return sum(i * i for i in range(n))\n"
        "def work(end):\n"
        "    d = bytes(range(256)) * 2000\n"
        "    while time.time() < end:\n"
        "        digest(d * 4); pack(d); dump({'k': list(range(2000))}); pure(20000)\n"
        "end = time.time() + 8\n"
        "t = threading.Thread(target=work, args=(end,)); t.start(); work(end); t.join()\n"
    )
    s, _ = sampler
    before = dict(s.stats().unwind_total)
    # hashlib and zlib map libcrypto and libz while the process starts; a
    # large library's table is loaded once a sample lands in it: a second of
    # warm-up windows, then the tables asked for are loaded, before sampling.
    _pid, stacks, _ = _record(s, [str(py), "-c", code], seconds=2.0, warm_libs=("libcrypto", "libz"))
    total = sum(stacks.values())
    assert total >= 200, stacks.most_common(3)

    def natives(st: tuple[str, ...]) -> list[str]:
        return [f for f in st if not PY_FRAME.search(f) and not f.startswith("[truncated")]

    all_unknown = sum(n for st, n in stacks.items() if all(f.startswith("[unknown]") for f in natives(st)))
    assert all_unknown / total <= 0.05, stacks.most_common(5)
    # The Python frames are spliced where the interpreter ran them, under a whole native stack.
    with_python = sum(n for st, n in stacks.items() if any(PY_FRAME.search(f) for f in st))
    assert with_python / total >= 0.9, stacks.most_common(5)
    rooted = sum(n for st, n in stacks.items() if st and st[0] in ("_start", "clone3", "clone", "start_thread"))
    assert rooted / total >= 0.9, stacks.most_common(5)
    after = s.stats().unwind_total
    complete = after["UW_COMPLETE"] - before["UW_COMPLETE"]
    assert complete / max(1, after["UW_SAMPLES"] - before["UW_SAMPLES"]) >= 0.9


# -- the reference: perf record --call-graph dwarf --------------------------

def _perf_callers(perf: str, binary: Path, leaf_sym: str, tmp: Path) -> collections.Counter[tuple[tuple[str, int], ...]]:
    """Callers (binary name, file address of the call) of the samples perf unwound into ``leaf_sym``."""
    data = tmp / "perf.data"
    subprocess.run([perf, "record", "-q", "--call-graph", "dwarf", "-F", "199", "-o", str(data), "--",
                    str(binary), "2"], check=True, timeout=120, capture_output=True)
    out = subprocess.run([perf, "script", "-i", str(data), "-F", "comm,ip,sym,dso"], check=True,
                         timeout=300, capture_output=True, text=True).stdout
    chains: collections.Counter[tuple[tuple[str, int], ...]] = collections.Counter()
    for block in out.split("\n\n"):
        frames = []
        for line in block.splitlines()[1:]:
            m = re.match(r"\s*([0-9a-f]+) (.+) \((.+)\)$", line)
            if m:
                # "(inlined)" stands where perf names a frame from inline
                # information: the binary is the one of the frame before.
                dso = os.path.basename(m[3]) if m[3] != "inlined" or not frames else frames[-1][1]
                frames.append((m[2], dso, int(m[1], 16)))
        if frames and frames[0][0] == leaf_sym:
            # Frames perf adds for inlined functions share their caller's address.
            callers: list[tuple[str, int]] = []
            for name, dso, ip in frames[1:]:
                if callers and callers[-1] == (dso, ip):
                    continue
                callers.append((dso, ip))
            chains[tuple(callers)] += 1
    return chains


def _file_address(maps: list[str], addr: int) -> tuple[str, int] | None:
    """(binary name, file address) of a process address, from the process's maps."""
    for m in filter(None, map(parse_exec_map, maps)):
        if m.start <= addr < m.end:
            bias = mapping_bias(ehframe.read_elf_info(m.path).loads, m)
            return (os.path.basename(m.path), addr - bias) if bias is not None else None
    return None


@pytest.mark.parametrize("name,perf_leaf,leaf", [("chain", "leaf", "leaf"),
                                                 ("throw", "work", "work(unsigned long)")])
def test_same_callers_as_perf_dwarf(sampler: tuple[BpfSampler, RecordingSymbolizer], bins: dict[str, Path],
                                    tmp_path: Path, name: str, perf_leaf: str, leaf: str) -> None:
    perf = shutil.which("perf")
    need(perf is not None, "perf (Debian linux-perf)")
    assert perf is not None
    reference = _perf_callers(perf, bins[name], perf_leaf, tmp_path)
    assert reference, "perf unwound no sample into the leaf"
    want, n_ref = reference.most_common(1)[0]
    assert n_ref / sum(reference.values()) >= 0.9, reference.most_common(3)

    s, sym = sampler
    pid, stacks, maps = _record(s, [str(bins[name]), "15"])
    ours: collections.Counter[tuple[tuple[str, int] | None, ...]] = collections.Counter()
    for addrs, frames in sym.raw[pid]:
        if frames and frames[-1] == leaf:
            # perf shows a caller at its return address - 1 (in the call instruction).
            ours[tuple(_file_address(maps, a - 1) for a in addrs[1:])] += 1
    assert ours, stacks.most_common(3)
    # Every distinct stack of ours into the leaf has perf's callers, frame by frame.
    for callers in ours:
        assert list(callers) == list(want), (callers, want)


def test_processes_whose_first_read_was_throttled_are_described_after_a_drain(bins: dict[str, Path]) -> None:
    """prime_rate 1: of four processes started at once, the priming thread
    reads one and refuses the others' reports; the drains that sample them
    hand them on, and every one is unwound from tables."""
    need(have_root(), "root (BPF and perf events)")
    need(have_bcc(), "bcc Python binding (Debian python3-bpfcc, under /usr/bin/python3)")
    with BpfSampler(BpfSamplerOptions(frequency=199, pids=frozenset(), unwind=True, prime_rate=1)) as s:
        procs = [subprocess.Popen([str(bins["chain"]), "8"], stdout=subprocess.DEVNULL) for _ in range(4)]
        try:
            for p in procs:
                s.add_pid(p.pid)
            deadline = time.monotonic() + 7
            while not all(s.unwind_ready(p.pid) for p in procs) and time.monotonic() < deadline:
                time.sleep(0.5)
                s.drain()
            ready = [s.unwind_ready(p.pid) for p in procs]
            st = s.stats()
            assert all(ready), (ready, st.primed_total, st.prime_throttled_total, st.prime_late_total)
            assert st.prime_throttled_total >= 1 and st.prime_late_total >= 1, st
            s.drain()
            time.sleep(1.0)
            w = s.drain()
        finally:
            for p in procs:
                p.kill()
                p.wait(timeout=10)
    for p in procs:
        stacks: Stacks = collections.Counter()
        for (tgid, _tid, _comm, stack), n in w.counts.items():
            if tgid == p.pid:
                stacks[tuple(f for f in stack if not f.endswith("_[k]"))] += n
        share, total = _share(stacks, "leaf", CHAIN)
        assert total >= 20 and share >= 0.95, (p.pid, stacks.most_common(3))


def test_large_binaries_load_when_a_sample_needs_them(bins: dict[str, Path]) -> None:
    """With 65,536 rows, a binary above 4,096 rows (libc here) is loaded only
    once a stack meets it (the uw_miss report), not when the process is first
    described; the stacks are whole after that."""
    need(have_root(), "root (BPF and perf events)")
    need(have_bcc(), "bcc Python binding (Debian python3-bpfcc, under /usr/bin/python3)")
    with BpfSampler(BpfSamplerOptions(frequency=199, pids=frozenset(), unwind=True, unwind_rows=65536)) as s:
        u = s.unwinder
        assert u is not None
        _pid, stacks, _ = _record(s, [str(bins["chain"]), "15"])
        # libc's ~28,000 rows came with the first stack through __libc_start_call_main
        assert u.stats.rows_used > 4096, u.stats
    share, total = _share(stacks, "leaf", CHAIN)
    assert total >= 100 and share >= 0.95, stacks.most_common(3)


def test_rows_are_copied_through_the_mapped_map(bins: dict[str, Path], tmp_path: Path) -> None:
    """uw_rows is mappable: every table's rows are copied into its pages (no
    batch update), and the map then holds exactly the rows of each table's
    cache file, read back through the map's lookup (the program's view)."""
    need(have_root(), "root (BPF and perf events)")
    need(have_bcc(), "bcc Python binding (Debian python3-bpfcc, under /usr/bin/python3)")
    opts = BpfSamplerOptions(frequency=199, pids=frozenset(), unwind=True, unwind_cache_dir=tmp_path)
    with BpfSampler(opts) as s:
        u = s.unwinder
        assert u is not None
        _pid, stacks, _ = _record(s, [str(bins["chain"]), "15"])
        st = u.stats.copy()
        assert st.binaries >= 2 and st.rows_used > 0, st
        assert st.rows_mapped == st.rows_used, st  # nothing went by batch updates
        table = s._program.bpf["uw_rows"]
        for entry in list(u._by_key.values()):
            raw = (tmp_path / f"{entry.key}.uwt").read_bytes()[16:]  # the cache file's rows, after its header
            assert len(raw) == entry.rows * ehframe.ROW.size, entry
            for i in {0, entry.rows // 2, entry.rows - 1}:
                got = bytes(table[table.Key(entry.first + i)])
                assert got == raw[i * ehframe.ROW.size:(i + 1) * ehframe.ROW.size], (entry, i)
    share, total = _share(stacks, "leaf", CHAIN)
    assert total >= 100 and share >= 0.95, stacks.most_common(3)


def test_a_large_binary_mapped_but_not_run_costs_no_rows() -> None:
    """Every bcc user maps libLLVM (~980,000 rows); a process that maps it and
    never runs it is described without them."""
    llvm = sorted(Path("/usr/lib/x86_64-linux-gnu").glob("libLLVM-1*.so.1"))
    need(bool(llvm), "a libLLVM (Debian libllvm*, installed with bcc)")
    need(have_root(), "root (BPF and perf events)")
    need(have_bcc(), "bcc Python binding (Debian python3-bpfcc, under /usr/bin/python3)")
    code = ("import ctypes, sys, time\n"
            f"ctypes.CDLL({str(llvm[-1])!r})\n"
            "print('ready', flush=True)\n"
            "end = time.time() + 20\n"
            "while time.time() < end:\n"
            "    sum(i * i for i in range(10000))\n")
    with BpfSampler(BpfSamplerOptions(frequency=199, pids=frozenset(), unwind=True)) as s:
        u = s.unwinder
        assert u is not None
        p = subprocess.Popen(["/usr/bin/python3", "-c", code], stdout=subprocess.PIPE)
        try:
            assert p.stdout is not None and p.stdout.readline().strip() == b"ready"
            s.add_pid(p.pid)  # from here on: its constructors have run
            deadline = time.monotonic() + 20
            while not s.unwind_ready(p.pid) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert s.unwind_ready(p.pid)
            time.sleep(1.5)
            w = s.drain()
            st = u.stats.copy()
        finally:
            p.kill()
            p.wait(timeout=10)
    assert st.rows_used < 300_000, st  # python3.11, libc, libstdc++, ... but not libLLVM
    mine = sum(n for (tgid, _t, _c, _s), n in w.counts.items() if tgid == p.pid)
    assert mine >= 100


@pytest.mark.parametrize("minor", ["3.11", "3.12", "3.13", "3.12 -X perf", "3.13 -X perf_jit"])
def test_python_frames_spliced_at_the_evaluation_loops(sampler: tuple[BpfSampler, RecordingSymbolizer],
                                                       minor: str) -> None:
    """Python -> C -> Python: with whole native stacks the interpreter's
    evaluation-loop frames are where each run of Python frames goes, so the C
    function that called back into Python sits between the two runs.

    With -X perf (3.12+) every evaluation loop is entered through a perf
    trampoline: code in an anonymous mapping, without a table or a frame
    pointer, which the unwinder knows by its instructions.  Before, every
    stack stopped there (``[truncated: no table]``); and the trampolines'
    ``py::`` frames, named from the perf map, are left out where the Python
    frames go (3.13's -X perf_jit writes a jitdump instead of a perf map: its
    trampolines are bare ``[unknown]`` frames, left out too)."""
    from cpython_support import pyenv_python

    minor, _, perf = minor.partition(" ")
    py = pyenv_python(minor)
    code = ("import time\n"
            "def key(x):\n"
            "    s = 0\n"
            "    for i in range(200): s += i * x\n"
            "    return s\n"
            "def main():\n"
            "    end = time.time() + 8\n"
            "    while time.time() < end:\n"
            "        sorted(range(2000), key=key)\n"
            "main()\n")
    s, _ = sampler
    def perf_files() -> set[Path]:  # what -X perf / perf_jit leave in /tmp
        return {*Path("/tmp").glob("perf-*.map"), *Path("/tmp").glob("jit-*.dump")}

    before = perf_files()
    try:
        _pid, stacks, _ = _record(s, [str(py), *perf.split(), "-c", code])
    finally:
        for left in perf_files() - before:
            left.unlink(missing_ok=True)
    total = sum(stacks.values())
    assert not any(f.startswith("py::") for st in stacks for f in st), stacks.most_common(1)
    unknown = sum(n for st, n in stacks.items() if "[unknown]" in st)
    assert unknown <= 0.02 * total, stacks.most_common(1)

    def interleaved(st: tuple[str, ...]) -> bool:
        want = [re.compile(r"^main \(<string>:\d+\)$"), re.compile(r"^list_sort"), re.compile(r"^key \(<string>:\d+\)$")]
        it = iter(st)
        return st[0] == "_start" and all(any(w.match(f) for f in it) for w in want)

    good = sum(n for st, n in stacks.items() if interleaved(st))
    assert total >= 100 and good / total >= 0.9, stacks.most_common(3)


def test_python_frames_of_a_stack_deeper_than_the_unwind_depth(sampler: tuple[BpfSampler, RecordingSymbolizer]) -> None:
    """Python -> C -> Python 25 levels deep: the native walk stops at
    unwind_depth (64) with the outer evaluation loops missing, while the
    Python walk has every run.  The loops found take the innermost runs, so
    the C frames between them stay (sorted's list_sort under each lambda),
    and the outer runs go on top of the cut.  Before, the runs did not match
    the loops, and every Python frame went on top of the native frames below
    the innermost loop: no list_sort anywhere between Python frames."""
    from cpython_support import pyenv_python

    py = pyenv_python("3.12")
    code = ("import time\n"
            "def leaf():\n"
            "    s = 0\n"
            "    for i in range(20000): s += i\n"
            "    return s\n"
            "def level(n):\n"
            "    if n == 0:\n"
            "        return leaf()\n"
            "    return sorted([n], key=lambda x: level(n - 1))[0]\n"
            "end = time.time() + 15\n"
            "while time.time() < end:\n"
            "    level(25)\n")
    s, _ = sampler
    _pid, stacks, _ = _record(s, [str(py), "-c", code])
    deep = {st: n for st, n in stacks.items() if "leaf (<string>:4)" in st}
    total = sum(deep.values())
    lam = re.compile(r"^level\.<locals>\.<lambda> \(<string>:\d+\)$")

    def spliced(st: tuple[str, ...]) -> bool:
        # <module> on top, the cut below some Python frames, and above the
        # leaf at least five lambdas each right after sorted's C frames.
        if not st or not st[0].startswith("<module>") or "[truncated: depth limit]" not in st:
            return False
        after_sort = sum(1 for a, b in zip(st, st[1:]) if a == "PyObject_CallOneArg" and lam.match(b))
        return after_sort >= 5 and st.index("[truncated: depth limit]") > 10

    good = sum(n for st, n in deep.items() if spliced(st))
    assert total >= 30 and good / total >= 0.9, sorted(deep.items(), key=lambda kv: -kv[1])[:2]


def test_a_library_the_unwinder_found_is_named_after_its_process_exits() -> None:
    """Without the program's reports of new code (``new_code`` off, as
    ``reread_new_code = false`` or a kernel that refuses the raw tracepoint
    leaves it), the unwinder's own reading of
    the maps, after its miss in libbz2 (loaded half a second after start),
    is passed to the symbolizer: the stacks through libbz2 are named after
    the process is gone.  Before, the unwinder walked through libbz2 while
    the symbolizer cut every such stack to a lone ``[unknown]``
    (tests/integration/test_python_bpf.py has the program's side)."""
    need(have_root(), "root (BPF and perf events)")
    need(have_bcc(), "bcc Python binding (Debian python3-bpfcc, under /usr/bin/python3)")
    with BpfSampler(BpfSamplerOptions(frequency=199, pids=frozenset(), python=True, unwind=True,
                                      new_code=False)) as s:
        p = subprocess.Popen([sys.executable, str(ROOT / "tests" / "workloads" / "late_library.py"), "0.5", "1.5"])
        try:
            s.add_pid(p.pid)
            assert p.wait(timeout=60) == 0
        finally:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        w = s.drain()
        st = s.stats()
    stacks = collections.Counter({stack: n for (tgid, _t, _c, stack), n in w.counts.items() if tgid == p.pid})
    total = sum(stacks.values())
    named = sum(n for stack, n in stacks.items() if names_libbz2(stack))
    assert total >= 100, stacks.most_common(5)
    assert named / total >= 0.5, f"{named}/{total} samples name libbz2: {stacks.most_common(5)}"
    assert st.prime_remapped_total >= 1, st
