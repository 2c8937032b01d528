"""A window numbered straight into the ring's table (flamed/sampling/packed.py).

The BPF drain names each key's stack from parts (user stack, Python runs,
kernel stack) and, in a daemon, joins their frame numbers in the snapshot
ring's table instead of building a tuple of frames per key.  These tests
check that both ways give the same window, whatever the stacks, and that the
window keeps its meaning through what may happen before the ring packs it.
"""

from __future__ import annotations

import errno
import random
import struct
from typing import Any

import pytest

from flamed.daemon.ring import PackedCounts, RingWindow, WindowRing
from flamed.model import EMPTY_STACK_FRAME
from flamed.sampling.drain import Drainer
from flamed.sampling.packed import PackedBuilder, StackTable
from flamed.sampling.program import BpfSamplerOptions
from flamed.sampling.pyframes import (
    PY_ID_NO_THREAD,
    join_frames,
    splice,
    splice_into,
    splice_parts,
    unencoded,
)

DEPTH = 16
EVAL = "_PyEval_EvalFrameDefault"


class _Symbols:
    """Names addresses as the real symbolizer would, without processes: a
    user address divisible by 7 is an evaluation-loop frame."""

    def kernel_stack(self, ips: list[int]) -> tuple[str, ...]:
        return tuple(f"k{ip}_[k]" for ip in reversed(ips))

    def user_stack(self, _tgid: int, ips: list[int]) -> tuple[str, ...]:
        return tuple(EVAL if ip % 7 == 0 else f"u{ip}" for ip in reversed(ips))

    def begin_drain(self) -> None: ...

    def end_drain(self) -> None: ...


class _Python:
    """Runs of Python frames as PythonFrames.stack gives them: a code address
    with the entry bit starts a new run (innermost first in, root first out)."""

    def stack(self, tgid: int, frames: list[tuple[int, int]], _flags: int, sid: int | None = None) -> list[tuple[str, ...]]:
        runs: list[list[str]] = [[]]
        for code, instr in reversed(frames):
            if code & 1 and runs[-1]:
                runs.append([])
            runs[-1].append(f"f{code >> 1} (m{tgid}.py:{instr})")
        return [tuple(r) for r in runs if r]


def _pystack(frames: list[tuple[int, int]]) -> bytes:
    codes = [c for c, _ in frames] + [0] * (DEPTH - len(frames))
    instrs = [i for _, i in frames] + [0] * (DEPTH - len(frames))
    return (struct.pack("<II", len(frames), 0) + struct.pack(f"<{DEPTH}Q", *codes) + struct.pack(f"<{DEPTH}I", *instrs)
            + bytes(4 * DEPTH))  # guard[]: not read (no FLAMED_PYSTACK_GUARDED)


def _drainer() -> Drainer:
    d = Drainer.__new__(Drainer)
    d.options = BpfSamplerOptions(python=True, python_depth=DEPTH)
    d._symbolizer = _Symbols()  # type: ignore[assignment]
    d._python = _Python()  # type: ignore[assignment]
    d._unwinder = None
    d._comm_cache = {}
    d.numbering = None
    return d


def _ustacks(seed: int) -> dict[int, bytes]:
    """Unwound stacks (``struct flamed_ustack``: count, end reason, addresses leaf first)."""
    rnd = random.Random(seed)
    out = {}
    for nid in range(1, 30):
        ips = [0] + [rnd.choice([7, 14, rnd.randrange(1, 400)]) for _ in range(rnd.randrange(0, 9))]
        out[nid] = struct.pack("<II", len(ips), rnd.choice([0, 0, 3])) + struct.pack(f"<{len(ips)}Q", *ips)
    return out


def _unwound_rows(seed: int, n: int = 300) -> list[Any]:
    """Rows of unwound stacks: a stack id and the leaf the sample had, some of them with Python frames."""
    rnd = random.Random(seed)
    return [(tgid, tgid, rnd.choice([-errno.EFAULT, *range(1, 60)]), -errno.EFAULT, b"w%d" % tgid,
             rnd.choice([0, *range(1, 80)]), rnd.choice([*range(1, 30), 99]), 1, rnd.choice([5, 7, 9, 21]), 1)
            for tgid in (10, 11) for _ in range(n // 2)]


def _window(seed: int, n: int = 400) -> tuple[list[Any], dict[int, list[int]], dict[int, bytes]]:
    """Count rows, stacks and Python stacks of every shape a drain meets."""
    rnd = random.Random(seed)
    stacks: dict[int, list[int]] = {}
    for sid in range(1, 60):
        stacks[sid] = [rnd.choice([7, 14, 21, rnd.randrange(1, 400)]) for _ in range(rnd.randrange(0, 12))]
    pystacks: dict[int, bytes] = {}
    for pid_ in range(1, 80):
        frames = [(rnd.randrange(2, 200) << 1 | rnd.choice([0, 0, 1]), rnd.randrange(1, 90))
                  for _ in range(rnd.randrange(1, DEPTH + 1))]
        pystacks[pid_] = _pystack(frames)
    rows = []
    for _ in range(n):
        kid = rnd.choice([-errno.EFAULT, -errno.ENODATA, -errno.EEXIST, 999, *range(1, 60)])
        uid = rnd.choice([-errno.EFAULT, -errno.ENOMEM, 998, *range(1, 60)])
        pyid = rnd.choice([0, 0, PY_ID_NO_THREAD, 997, *range(1, 80)])
        tgid = rnd.choice([10, 11, 12])
        rows.append((tgid, tgid + rnd.randrange(3), kid, uid, b"w%d\0\0" % tgid, pyid, 0, 1, 0, rnd.randrange(1, 9)))
    stacks[60] = [1, 7, 2, 14, 3]  # two evaluation-loop frames, and Python stack 80 has two runs
    pystacks[80] = _pystack([(5 << 1 | 1, 1), (4 << 1, 2), (3 << 1 | 1, 3)])
    rows.append((10, 10, -errno.EFAULT, -errno.EFAULT, b"w10", 0, 0, 1, 0, 1))  # nothing read: the empty stack
    rows.append((10, 10, 1, 60, b"w10", 80, 0, 1, 0, 2))
    return rows, stacks, pystacks


@pytest.mark.parametrize("seed", range(6))
def test_numbered_in_a_table_the_window_is_the_one_of_tuples(seed: int) -> None:
    rows, stacks, pystacks = _window(seed)
    d = _drainer()
    plain, _ = d._symbolize(rows, [], stacks, pystacks, {})
    table = StackTable()
    numbered, _ = d._symbolize(rows, [], stacks, pystacks, {}, table)
    assert isinstance(numbered, PackedBuilder) and not isinstance(plain, PackedBuilder)
    assert dict(numbered.items()) == dict(plain)
    assert len(numbered) == len(plain) and sum(numbered.values()) == sum(plain.values()) == sum(r[9] for r in rows)
    assert any(k[3] == (EMPTY_STACK_FRAME,) for k in plain)  # the shapes the rows were made to have
    assert any(EVAL in k[3] for k in plain) and any("(m1" in "".join(k[3]) for k in plain)
    # Unwound user stacks (their own memo and leaf), with and without Python frames.
    d._unwinder = object()  # type: ignore[assignment]
    urows, ust = _unwound_rows(seed), _ustacks(seed)
    uplain, _ = d._symbolize(urows, [], stacks, pystacks, ust)
    unumbered, _ = d._symbolize(urows, [], stacks, pystacks, ust, StackTable())
    assert dict(unumbered.items()) == dict(uplain) and len(uplain) > 100
    assert any(k[3][0] == "[truncated: depth limit]" for k in uplain)
    assert any("[lost stack: unwound]" in k[3] for k in uplain)
    spliced = ("u3", "f3 (m10.py:3)", "f4 (m10.py:2)", "u2", "f5 (m10.py:1)", "u1")
    assert any(k[3][:len(spliced)] == spliced for k in plain)


def test_the_parts_of_a_splice_join_to_the_splice() -> None:
    rnd = random.Random(5)
    table = StackTable()
    for _ in range(300):
        user = tuple(rnd.choice([EVAL, "_PyEval_Vector", "PyObject_Call", "[unknown]", "main", "deflate",
                                 "greenlet::UserGreenlet::inner_bootstrap(_greenlet*, _object*)", "[truncated: depth limit]"])
                     for _ in range(rnd.randrange(0, 8)))
        runs = [tuple(f"p{rnd.randrange(9)}" for _ in range(rnd.randrange(1, 4))) for _ in range(rnd.randrange(1, 4))]
        whole = splice(user, runs)
        assert splice_into(splice_parts(user, unencoded), runs, join_frames) == whole
        enc = splice_into(splice_parts(user, table.encode_stack), [table.encode_stack(r) for r in runs], b"".join)
        assert enc == table.encode_stack(whole)


def test_a_builder_reads_and_takes_keys_like_a_dict() -> None:
    table = StackTable()
    a, b = (1, 1, "w", ("x", "y")), (1, 2, "w", ("x",))
    numbered = table.number({a: 3})
    built = PackedBuilder(table, numbered)
    assert dict(built.items()) == {a: 3} and built[a] == 3 and b not in built
    built[a] = built.get(a, 0) + 1  # numbered already: stays numbered
    built[b] = built.get(b, 0) + 2  # a task the table has not seen: kept aside as a tuple
    assert built.packed == {next(iter(numbered)): 4} and built.extra == {b: 2}
    assert dict(built) == {a: 4, b: 2} and len(built) == 2 and sorted(built.values()) == [2, 4]
    built[b] += 1
    del built[a]
    assert dict(built) == {b: 3}
    with pytest.raises(KeyError):
        del built[a]


def _drained_into_a_ring(seed: int) -> tuple[WindowRing, PackedBuilder, dict[Any, int]]:
    """A ring, a window drained into its table, and that window's counts as tuples."""
    ring = WindowRing(1e9, 1 << 30, clock_ns=lambda: 0)
    rows, stacks, pystacks = _window(seed)
    d = _drainer()
    d.numbering = ring
    counts, _ = d._symbolize_all(rows, [], stacks, pystacks, {})
    assert isinstance(counts, PackedBuilder) and counts.table is ring._table
    return ring, counts, dict(counts.items())


def test_the_ring_takes_a_builder_of_its_table_as_numbered_and_its_extra_keys_too() -> None:
    ring, counts, plain = _drained_into_a_ring(1)
    before = len(ring._table)
    extra = (10, 10, "w10", ("an event's frame", "k1_[k]"))
    counts[extra] = counts.get(extra, 0) + 1  # as the loop adds an unclaimed event
    some = next(iter(plain))
    counts[some] += 5  # and one to a key already there
    ring.add(RingWindow(0, 1, counts, 0))
    (w,) = ring.since(-1)
    assert isinstance(w.counts, PackedCounts) and w.counts.table is ring._table
    assert dict(w.counts) == {**plain, extra: 1, some: plain[some] + 5}
    assert len(ring._table) == before + 1  # only the event's stack was new


def test_a_builder_whose_table_was_replaced_is_decoded_into_the_new_one() -> None:
    ring, counts, plain = _drained_into_a_ring(2)
    ring.widen(ring._table)  # a window packed in between needed 4-byte numbers
    assert counts.table is not ring._table
    ring.add(RingWindow(0, 1, counts, 0))
    (w,) = ring.since(-1)
    assert w.counts.table is ring._table and ring._table.code == "I"  # type: ignore[attr-defined]
    assert dict(w.counts) == plain


def test_a_table_out_of_two_byte_frame_numbers_is_widened_and_the_window_named_again() -> None:
    ring = WindowRing(1e9, 1 << 30, clock_ns=lambda: 0)
    table = ring._table
    for i in range(65_530):  # frames numbered by earlier windows: six 2-byte numbers left
        table.encode_stack((f"old{i}",))
    earlier = {(1, 1, "w", ("old1", "old2")): 9}
    ring.add(RingWindow(0, 1, dict(earlier), 9))
    rows, stacks, pystacks = _window(3)
    d = _drainer()
    d.numbering = ring
    plain = dict(d._symbolize(rows, [], stacks, pystacks, {})[0])
    counts, _ = d._symbolize_all(rows, [], stacks, pystacks, {})
    assert isinstance(counts, PackedBuilder) and counts.table is ring._table and ring._table.code == "I"
    assert dict(counts.items()) == plain
    ring.add(RingWindow(1, 2, counts, 0))
    old, new = ring.since(-1)
    assert dict(old.counts) == earlier and dict(new.counts) == plain  # the earlier window moved too


def _period_counts(seed: int) -> list[dict[tuple[int, int, str, tuple[str, ...]], int]]:
    """Three windows of random keys: shared stacks and tasks, threads of one
    process, frames that sort differently as strings and as joined text
    ("a", "a1", "a;" is not possible but "a b" is), an empty stack."""
    rnd = random.Random(seed)
    frames = ["a", "a1", "a b", "b", "é", "[k]_[k]", "main", "x" * 40, "_start", "f (m.py:3)"]
    out = []
    for _w in range(3):
        c: dict[tuple[int, int, str, tuple[str, ...]], int] = {}
        for _ in range(rnd.randrange(50, 300)):
            tgid = rnd.choice([10, 20, 30, 40])
            key = (tgid, tgid + rnd.randrange(3), rnd.choice(["app", "nginx"]),
                   tuple(rnd.choice(frames) for _ in range(rnd.randrange(0, 6))))
            c[key] = c.get(key, 0) + rnd.choice([1, 2, 499, 500, 1500, 10**6])
        out.append(c)
    return out


@pytest.mark.parametrize("root", ["comm", "pid", "tid", "none", "unit,pid", "container,cgroup,comm"])
@pytest.mark.parametrize("kind", ["cpu", "offcpu"])
@pytest.mark.parametrize("compress", [False, True])
def test_a_period_of_packed_windows_is_written_as_the_windows_of_tuples_were(
        tmp_path: Any, root: str, kind: str, compress: bool) -> None:
    import gzip
    import json

    from flamed.daemon.config import OutputConfig, RetentionConfig
    from flamed.daemon.metrics import DaemonMetrics
    from flamed.daemon.store import ProfileStore, _merged
    from flamed.sampling.cgroups import identity_from_path

    idents = {10: identity_from_path("/system.slice/nginx.service", 101),
              20: identity_from_path("/system.slice/docker-" + "ab" * 32 + ".scope", 102)}
    windows = _period_counts(len(root) + len(kind))
    ring = WindowRing(1e9, 1 << 30, clock_ns=lambda: 0)
    written = {}
    for how in ("tuples", "packed"):
        d = tmp_path / how
        st = ProfileStore(OutputConfig(state_dir=str(d), host="h", root_frame=root, compress=compress),
                          RetentionConfig(), DaemonMetrics(process=False), clock_ns=lambda: 0)
        st.ensure_dir()
        for i, c in enumerate(windows):
            counts = ring.pack(RingWindow(0, 1, c, 0)).counts if how == "packed" else dict(c)
            if kind == "cpu":
                st.add(i, i + 1, counts, sum(c.values()), {}, 99.0, idents)
            else:
                st.add_offcpu(i, i + 1, counts, idents)
        period = st.period if kind == "cpu" else st.offcpu_period
        assert (_merged(period, root) is not None) == (how == "packed")  # written from frame numbers
        st.rotate()
        (data,) = [p for p in d.iterdir() if ".folded" in p.name and not p.is_symlink()]
        (side,) = [p for p in d.iterdir() if p.suffix == ".json" and not p.is_symlink()]
        meta = json.loads(side.read_text())
        payload = data.read_bytes()
        written[how] = (gzip.decompress(payload) if compress else payload,
                        {k: v for k, v in meta.items() if k not in ("bytes", "sha256")})
    assert written["packed"] == written["tuples"]
    text = written["packed"][0]
    assert text.count(b"\n") == written["packed"][1]["stacks"] > 10


@pytest.mark.parametrize("names", [300, 70_000])
def test_a_period_sorts_its_lines_as_tuples_of_their_frames_would(names: int) -> None:
    """The lines of a period's file are ordered by their frames (root frames,
    then the stack) as tuples of strings compare: with 2-byte frame ranks,
    and 4-byte ones past 65,535 distinct names (root frames counted in)."""
    from flamed.sampling.packed import MergedByRoot

    rnd = random.Random(names)
    frames = [f"f{i}" for i in range(names)] + ["a", "a1", "a b", "é", ""]
    c: dict[tuple[int, int, str, tuple[str, ...]], int] = {}
    for i in range(3000):
        stack = tuple(rnd.choice(frames) for _ in range(rnd.randrange(0, 8)))
        c[(rnd.choice([1, 2, 3]), i, "w", stack)] = 1 + i
    for i, f in enumerate(frames[: names]):  # every name in the table
        c[(1, 10_000 + i, "w", (f,))] = 1
    table = StackTable(None, "I" if names > 60_000 else "H")
    packed = table.pack(c)
    roots = {1: ("b",), 2: ("a", "zz"), 3: ()}
    m = MergedByRoot(table, [packed], lambda task: roots[task[0]])
    # a line is its root frames then its stack: they compare as one tuple
    got = [m.roots[k >> 32] + table.stack(k & 0xFFFF_FFFF) for k in m.sorted_keys()]
    assert got == sorted(r + st for r, st in {(roots[t], st) for (t, _tid, _comm, st) in c})


def test_sorting_a_period_holds_one_small_key_per_line() -> None:
    """The sort of a period's lines holds one key of bytes per line, 2 bytes a
    frame while there are fewer than 65,535 names (a memo of every key beside
    the sort's own, 4 bytes a frame, took twice as much)."""
    import gc
    import tracemalloc

    from flamed.sampling.packed import MergedByRoot

    n, depth = 20_000, 30
    rnd = random.Random(3)
    names = [f"func_{i} (/srv/app/m{i % 50}.py:{i})" for i in range(3000)]
    c = {(1, 1, "w", tuple(rnd.choice(names) for _ in range(depth))): 1 + i for i in range(n)}
    table = StackTable()
    m = MergedByRoot(table, [table.pack(c)], lambda task: ())
    del c
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        keys = m.sorted_keys()
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert len(keys) == n
    assert peak <= n * (96 + 2 * depth), peak


def test_weight_by_process_is_the_same_packed_or_not() -> None:
    from flamed.sampling.packed import weight_by_tgid

    (c, *_rest) = _period_counts(9)
    want: dict[int, int] = {}
    for (tgid, _tid, _comm, _stack), n in c.items():
        want[tgid] = want.get(tgid, 0) + n
    table = StackTable()
    built = PackedBuilder(table, table.number(dict(list(c.items())[: len(c) // 2])))
    for k, n in list(c.items())[len(c) // 2:]:
        built[k] = n
    assert weight_by_tgid(c) == weight_by_tgid(table.pack(c)) == weight_by_tgid(built) == want
