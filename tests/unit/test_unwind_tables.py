"""flamed.sampling.unwind.tables.Unwinder against in-memory stand-ins for the
BPF maps (the real maps are exercised by tests/integration/test_unwind.py):
which binaries get rows, the process entries, forgetting, and the reload
when the rows are full of exited processes' binaries."""

from __future__ import annotations

import ctypes as ct
import shutil
import struct
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from flamed.sampling.unwind import ehframe
from flamed.sampling.unwind.tables import EVICT_IDLE_S, TableCache, Unwinder
from support import ROOT, need


class FakeArray:
    """An array map: values of ``size`` bytes by index."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.map_fd = -1
        self.values: dict[int, bytes] = {}

        class Leaf(ct.Structure):
            _fields_ = [("raw", ct.c_uint8 * size)]

        self.Leaf = Leaf

    def __setitem__(self, key: Any, leaf: Any) -> None:
        self.values[key.value] = bytes(leaf)

    def __delitem__(self, key: Any) -> None:
        del self.values[key.value]


class FakeLib:
    """bpf_update_batch into FakeArrays by fd (tables register themselves)."""

    def __init__(self, tables: dict[int, FakeArray]) -> None:
        self.tables = tables

    def bpf_update_batch(self, fd: int, keys: Any, vals: Any, count: Any) -> int:
        t = self.tables[fd]
        n = count._obj.value
        ks = ct.cast(keys, ct.POINTER(ct.c_uint32))
        raw = ct.string_at(ct.cast(vals, ct.c_void_p), n * t.size)
        for i in range(n):
            t.values[ks[i]] = raw[i * t.size:(i + 1) * t.size]
        return 0


def make(tmp_path: Path, proc: Path, rows: int) -> tuple[Unwinder, dict[str, FakeArray]]:
    maps = {"uw_rows": FakeArray(ehframe.ROW.size), "uw_procs": FakeArray(8), "uw_maps": FakeArray(48)}
    for i, t in enumerate(maps.values()):
        t.map_fd = 100 + i
    lib = FakeLib({t.map_fd: t for t in maps.values()})
    u = Unwinder(maps, lib, rows_capacity=rows, max_maps=8, max_procs=16, cache=TableCache(tmp_path / "cache"),
                 proc=proc)
    return u, maps


def fake_process(proc: Path, pid: int, binaries: list[Path]) -> None:
    """/proc/PID/maps mapping each binary's executable segment, /proc/PID/root,
    and a /proc/PID/stat of a sleeping process."""
    d = proc / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    lines = []
    for i, b in enumerate(binaries):
        info = ehframe.read_elf_info(str(b))
        vaddr, off, filesz, _flags = next(ld for ld in info.loads if ld[3] & 1)
        start = 0x7F0000000000 + i * 0x10000000
        lines.append(f"{start:x}-{start + ((filesz + 0xFFF) & ~0xFFF) + 0x1000:x} r-xp {off & ~0xFFF:08x} "
                     f"fe:00 {b.stat().st_ino} {b}")
    (d / "maps").write_text("\n".join(lines) + "\n")
    if not (d / "root").exists():
        (d / "root").symlink_to("/")
    if not (d / "stat").exists():
        (d / "stat").write_text(f"{pid} ({binaries[0].name if binaries else 'x'}) S 1 {pid} {pid} 0 -1 4194560 0\n")


@pytest.fixture
def binaries(tmp_path: Path) -> list[Path]:
    gcc = shutil.which("gcc")
    need(gcc is not None, "gcc to build small binaries")
    assert gcc is not None
    out = []
    for i in range(3):
        exe = tmp_path / f"prog{i}"
        subprocess.run([gcc, "-O2", "-o", str(exe), str(ROOT / "tests" / "workloads" / "unwind" / "chain.c")],
                       check=True, timeout=120)
        exe.write_bytes(exe.read_bytes() + bytes([i]))  # a different file (the table is the same)
        out.append(exe)
    return out


def slots(binary: Path) -> int:
    """Slots of uw_rows the binary's table takes: its rows and its page index."""
    packed = ehframe.build_table(str(binary)).pack()
    return (len(packed) + len(ehframe.page_index(packed)[2])) // ehframe.ROW.size


def proc_entry(maps: dict[str, FakeArray], pid: int) -> tuple[int, int]:
    slot, n = struct.unpack("<II", maps["uw_procs"].values[pid][:8])
    return slot, n


def test_describe_writes_the_mappings_and_forget_frees_them(tmp_path: Path, binaries: list[Path]) -> None:
    proc = tmp_path / "proc"
    fake_process(proc, 10, binaries[:2])
    u, maps = make(tmp_path, proc, rows=4096)
    assert u.describe(10)
    slot, n = proc_entry(maps, 10)
    assert n == 2
    starts = [struct.unpack_from("<QQQIIII", maps["uw_maps"].values[slot * 8 + i])[0] for i in range(n)]
    assert starts == sorted(starts)
    # Two files with one build id share one table in the rows.
    assert u.stats.binaries == 1 and u.stats.rows_used == len(maps["uw_rows"].values)
    u.forget(10)
    assert 10 not in maps["uw_procs"].values and u.stats.processes == 0


def test_full_rows_held_by_exited_processes_are_reloaded(tmp_path: Path) -> None:
    libc = Path("/usr/lib/x86_64-linux-gnu/libc.so.6")
    py = Path("/usr/bin/python3.11")
    need(libc.exists() and py.exists(), "Debian's libc.so.6 and python3.11")
    proc = tmp_path / "proc"
    n_libc = slots(libc)
    n_py = slots(py)
    # Room for python3.11, or for libc, not for both.  Both are "large" for
    # so few rows: loaded when a sample lands in them (the address passed).
    u, maps = make(tmp_path, proc, rows=max(n_libc, n_py) + 1000)
    for b in (py, libc):  # built before: loaded inline from the cache (see the test below for the builder)
        TableCache(tmp_path / "cache").rows(str(b), ehframe.read_elf_info(str(b)))
    sampled = {0x7F0000000000 + 0x100}
    fake_process(proc, 10, [py])
    assert not u.describe(10)  # mapped, not run yet: no rows
    assert u.describe(10, sampled) and u.stats.rows_used == n_py
    u.forget(10)  # exited: its rows are garbage now
    fake_process(proc, 11, [libc])
    # Full: python3.11's rows, used by no process now, are evicted for libc at once.
    assert u.describe(11, sampled)
    assert u.stats.skipped["rows_full"] == 0 and u.stats.evicted == 1 and u.stats.evicted_rows == n_py
    assert u.stats.rows_used == n_libc and u.stats.tables_cached >= 1



def _map_entries(maps: dict[str, FakeArray], pid: int) -> list[tuple[int, ...]]:
    """struct flamed_uw_map of each of the process's mappings (start, end, bias, first, index, base, pages,
    serial, pad)."""
    slot, n = proc_entry(maps, pid)
    return [struct.unpack("<QQQIIIIII", maps["uw_maps"].values[slot * 8 + i]) for i in range(n)]


def test_rows_loaded_again_at_the_same_place_get_a_new_serial(tmp_path: Path) -> None:
    """The program caches rows per CPU under (serial, address) (bpf/unwind.bpf.c,
    uw_row_cache): a table evicted and loaded again, even at the same rows,
    must carry a serial never given before, or a sample would take the
    evicted table's cached rows for the new one's."""
    libc = Path("/usr/lib/x86_64-linux-gnu/libc.so.6")
    py = Path("/usr/bin/python3.11")
    need(libc.exists() and py.exists(), "Debian's libc.so.6 and python3.11")
    proc = tmp_path / "proc"
    u, maps = make(tmp_path, proc, rows=max(slots(libc), slots(py)) + 1000)
    for b in (py, libc):
        TableCache(tmp_path / "cache").rows(str(b), ehframe.read_elf_info(str(b)))
    sampled = {0x7F0000000000 + 0x100}
    given: list[int] = []
    for pid, binary in ((10, py), (11, libc), (12, py)):  # each evicts the one before (room for one)
        fake_process(proc, pid, [binary])
        assert u.describe(pid, sampled)
        (entry,) = _map_entries(maps, pid)
        first, pages, serial = entry[3], entry[6], entry[7]
        assert pages > 0 and serial > 0
        given.append(serial)
        u.forget(pid)
    assert len(set(given)) == 3, given
    assert u.stats.evicted == 2


def _two_tables(tmp_path: Path) -> tuple[Unwinder, dict[str, FakeArray], Path, set[int], int, int]:
    libc = Path("/usr/lib/x86_64-linux-gnu/libc.so.6")
    py = Path("/usr/bin/python3.11")
    need(libc.exists() and py.exists(), "Debian's libc.so.6 and python3.11")
    proc = tmp_path / "proc"
    n_libc = slots(libc)
    n_py = slots(py)
    u, maps = make(tmp_path, proc, rows=max(n_libc, n_py) + 1000)
    for b in (py, libc):
        TableCache(tmp_path / "cache").rows(str(b), ehframe.read_elf_info(str(b)))
    fake_process(proc, 10, [py])
    fake_process(proc, 11, [libc])
    return u, maps, proc, {0x7F0000000000 + 0x100}, n_libc, n_py


def test_a_live_process_table_not_sampled_lately_is_evicted_for_a_new_one(tmp_path: Path) -> None:
    """A process alive but idle (a bcc tool after its compile) keeps no rows
    another binary needs: its table goes, least recently sampled first, and
    the process loses its description (no sample reads reused rows) until
    described again."""
    u, maps, _proc, sampled, n_libc, n_py = _two_tables(tmp_path)
    now = [1000.0]
    u._clock = lambda: now[0]
    assert u.describe(10, sampled) and u.stats.rows_used == n_py
    now[0] += EVICT_IDLE_S + 1  # process 10 alive, no unwound sample since
    assert u.describe(11, sampled)
    assert u.stats.evicted == 1 and u.stats.skipped["rows_full"] == 0 and u.stats.rows_used == n_libc
    assert 10 not in maps["uw_procs"].values and not u.described(10)
    u.note_sampled({11})
    assert u.stats.largest and u.stats.largest[0][1] == n_libc


def test_a_table_sampled_lately_is_not_evicted(tmp_path: Path) -> None:
    u, maps, _proc, sampled, _n_libc, n_py = _two_tables(tmp_path)
    now = [1000.0]
    u._clock = lambda: now[0]
    assert u.describe(10, sampled)
    now[0] += EVICT_IDLE_S + 1
    u.note_sampled({10})  # the last drain had unwound samples of process 10
    assert not u.describe(11, sampled)
    assert u.stats.evicted == 0 and u.stats.skipped["rows_full"] == 1 and u.stats.rows_used == n_py
    assert u.described(10)


def test_a_large_table_is_built_aside_and_loaded_when_ready(tmp_path: Path) -> None:
    """Building libLLVM's table takes seconds: the worker describes other
    processes meanwhile, and the one that needs it gets it when it is built."""
    py = Path("/usr/bin/python3.11")
    need(py.exists(), "Debian's python3.11")
    proc = tmp_path / "proc"
    fake_process(proc, 10, [py])
    u, maps = make(tmp_path, proc, rows=70000)  # python3.11 (~65,000 rows) is large here
    u.start()
    try:
        u.submit(10, 0x7F0000000000 + 0x100)  # a sample landed in it
        deadline = time.monotonic() + 60
        while not u.described(10) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert u.described(10), u.stats
        assert u.stats.tables_built == 1 and u.stats.rows_used == slots(py)
    finally:
        u.stop()


def test_a_miss_reported_while_the_process_is_described_is_not_dropped(tmp_path: Path) -> None:
    """A sample can land outside the tables while the process's description is
    still being written (its uw_procs entry comes before the description
    ends): that miss is the one report the program sends for a second.  It
    must be acted on when the description ends, not wait for the next report
    (a second later at best)."""
    py = Path("/usr/bin/python3.11")
    need(py.exists(), "Debian's python3.11")
    proc = tmp_path / "proc"
    fake_process(proc, 10, [py])
    u, _maps = make(tmp_path, proc, rows=70000)  # python3.11 is large here: loaded on a miss only
    inside, release = threading.Event(), threading.Event()
    real_describe = u.describe
    calls: list[set[int]] = []

    def held_describe(tgid: int, want: set[int] | None = None, want_keys: set[str] | None = None) -> bool:
        calls.append(set(want or ()))
        if len(calls) == 1:
            inside.set()
            assert release.wait(30), "never released"
        return real_describe(tgid, want, want_keys)

    u.describe = held_describe  # type: ignore[method-assign]
    u.start()
    try:
        u.submit(10)  # its first description: no sample in python3.11 yet
        assert inside.wait(30), "the first description never began"
        u.submit(10, 0x7F0000000000 + 0x100)  # the miss, while that description runs
        release.set()
        deadline = time.monotonic() + 60
        while u.stats.rows_used != slots(py) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert u.stats.rows_used == slots(py), (calls, u.stats)
        assert calls[0] == set() and 0x7F0000000100 in calls[1], calls
    finally:
        release.set()
        u.stop()


def test_stop_does_not_wait_for_a_large_table_being_built(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reload stops the old sampler's unwinder while it may be building a large
    table (libclang-cpp: seconds, tens of seconds on a loaded host): stop returns
    without waiting for it, and the build, left to finish, still fills the cache."""
    py = Path("/usr/bin/python3.11")
    need(py.exists(), "Debian's python3.11")
    proc = tmp_path / "proc"
    fake_process(proc, 10, [py])
    u, _maps = make(tmp_path, proc, rows=70000)  # python3.11's table is large here: built aside
    release, building = threading.Event(), threading.Event()
    real_build = ehframe.build_table

    def slow_build(path: str, info: ehframe.ElfInfo | None = None) -> ehframe.Table:
        building.set()
        assert release.wait(60), "never released"
        return real_build(path, info)

    monkeypatch.setattr(ehframe, "build_table", slow_build)
    u.start()
    stopped = threading.Event()
    try:
        u.submit(10, 0x7F0000000000 + 0x100)  # a sample landed in it: its table is built
        assert building.wait(30), "the build never began"
        stopper = threading.Thread(target=lambda: (u.stop(), stopped.set()))
        stopper.start()
        # stop returns while the build is still held (before, it waited up to 30 s for it).
        assert stopped.wait(20), "stop waited for the table being built"
    finally:
        release.set()
    # The build goes on and writes its table to the cache.
    deadline = time.monotonic() + 60
    while not list((tmp_path / "cache").glob("*.uwt")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list((tmp_path / "cache").glob("*.uwt"))


def test_free_rows_broken_into_ranges_too_small_are_joined_by_a_reload(tmp_path: Path) -> None:
    """Tables come and go in a long-running daemon, and the free rows end up
    in ranges none of which holds a new large table, though together they
    do (numpy's OpenBLAS, 410,000 rows, refused as rows_full with half of
    2 Mi rows free): the tables in use are loaded again from the disk cache,
    one after the other, and the new one fits after them."""
    libc = Path("/usr/lib/x86_64-linux-gnu/libc.so.6")
    py = Path("/usr/bin/python3.11")
    gcc = shutil.which("gcc")
    need(libc.exists() and py.exists() and gcc is not None, "Debian's libc.so.6 and python3.11, gcc")
    assert gcc is not None
    small = []
    for name in ("chain", "recurse"):  # two build ids: two tables
        exe = tmp_path / name
        subprocess.run([gcc, "-O2", "-o", str(exe), str(ROOT / "tests" / "workloads" / "unwind" / f"{name}.c")],
                       check=True, timeout=120)
        small.append(exe)
    n_a, n_b, n_c, n_d = slots(small[0]), slots(libc), slots(small[1]), slots(py)
    assert n_b < n_d
    tail = n_d - n_b // 2  # room left after a, b, c: less than d, and less than d once b is freed
    proc = tmp_path / "proc"
    u, maps = make(tmp_path, proc, rows=n_a + n_b + n_c + tail)
    for b in (*small, libc, py):
        TableCache(tmp_path / "cache").rows(str(b), ehframe.read_elf_info(str(b)))
    now = [1000.0]
    u._clock = lambda: now[0]
    sampled = {0x7F0000000000 + 0x100}
    for pid, binary in ((10, small[0]), (11, libc), (12, small[1])):
        fake_process(proc, pid, [binary])
        assert u.describe(pid, sampled)
    u.forget(11)  # exited: libc's rows, between the other two, are free
    u.note_sampled({10, 12})  # both busy: never evicted
    fake_process(proc, 13, [py])
    assert not u.describe(13, sampled)
    assert u.stats.skipped["rows_full"] == 1
    u._run_reset_if_due()  # what the worker does after each description
    assert u.described(10) and u.described(12)
    assert u.describe(13, sampled)  # its next sample in it asks again
    assert u.stats.rows_used == n_a + n_c + n_d and u.stats.resets == 1


def test_a_table_taken_by_the_same_description_is_not_taken_for_garbage(tmp_path: Path) -> None:
    """A process that runs two large binaries (a bcc tool: libLLVM and
    libclang-cpp) where the rows hold only the first: the first is its own,
    live, not rows of exited processes to reload (which dropped every table
    of the host and refused the second again, at each of its misses)."""
    _u, _maps, proc, _sampled, n_libc, n_py = _two_tables(tmp_path)  # the tables in the disk cache
    u, _ = make(tmp_path, proc, rows=n_py + n_libc - 1000)
    fake_process(proc, 20, [Path("/usr/bin/python3.11"), Path("/usr/lib/x86_64-linux-gnu/libc.so.6")])
    both = {0x7F0000000000 + 0x100, 0x7F0010000000 + 0x100}
    assert u.describe(20, both) and u.stats.rows_used == n_py and u.stats.skipped["rows_full"] == 1
    assert not u._reset_due
    u._run_reset_if_due()
    assert u.stats.resets == 0 and u.described(20)


def test_a_process_with_more_mappings_than_unwind_maps_keeps_some_and_says_so(
        tmp_path: Path, binaries: list[Path], caplog: pytest.LogCaptureFixture) -> None:
    """More executable mappings with a table than unwind_maps (8 here): the
    process keeps that many, the others' frames use frame pointers, and one
    warning names the setting to raise (before, only a counter no metric
    showed knew it)."""
    import logging

    proc = tmp_path / "proc"
    fake_process(proc, 10, binaries * 3)  # 9 mappings
    fake_process(proc, 11, binaries * 3)
    u, maps = make(tmp_path, proc, rows=4096)
    with caplog.at_level(logging.WARNING, logger="flamed.unwind"):
        assert u.describe(10)
        assert u.describe(11)
    assert proc_entry(maps, 10)[1] == 8 and proc_entry(maps, 11)[1] == 8
    assert u.stats.mappings_dropped == 2
    said = [r.getMessage() for r in caplog.records if "unwind_maps" in r.getMessage()]
    assert len(said) == 1 and "pid 10 has 9 executable mappings" in said[0] and "sampling.unwind_maps (8)" in said[0]


def test_slots_of_exited_processes_are_reclaimed_when_they_run_out(tmp_path: Path, binaries: list[Path]) -> None:
    """Nothing told the unwinder of a non-Python process's exit: after
    unwind_max_procs processes had come and gone, every new one kept
    frame-pointer stacks, and one described again raised "pop from empty
    list" (`record --subprocesses` of 1,100 pyenv-shimmed `python3 -c pass`).
    The slots of exited processes (gone from /proc, or zombies) are reclaimed;
    with none free, a process described before keeps its description."""
    import shutil as sh

    proc = tmp_path / "proc"
    u, maps = make(tmp_path, proc, rows=8192)  # max_procs=16
    for pid in range(100, 116):
        fake_process(proc, pid, binaries[:1])
        assert u.describe(pid)
    fake_process(proc, 200, binaries[:1])
    for pid in (100, 101):
        sh.rmtree(proc / str(pid))  # exited and reaped
    (proc / "102" / "stat").write_text("102 (prog0) Z 1 102 102 0 -1 4194564 0\n")  # a zombie
    assert u.describe(200)
    assert set(maps["uw_procs"].values) == set(range(103, 116)) | {200}
    for pid in (201, 202):
        fake_process(proc, pid, binaries[:1])
        assert u.describe(pid)
    # Full of live processes: a new one is refused, one described before keeps its entry.
    fake_process(proc, 203, binaries[:1])
    assert not u.describe(203) and 203 not in maps["uw_procs"].values
    before = maps["uw_procs"].values[110]
    fake_process(proc, 110, binaries[:2])  # maps a second binary: described again
    u._last_reclaim = -float("inf")
    assert not u.describe(110)
    assert maps["uw_procs"].values[110] == before
