"""The page index of an unwind table (ehframe.page_index, read by
uw_find_row in bpf/unwind.bpf.c): the row a bucket-bounded search finds is
the row a search of the whole table finds, for every address."""

from __future__ import annotations

import bisect
import random
import re
import struct
from pathlib import Path

import pytest

from flamed.sampling.unwind import ehframe
from support import ROOT


def pack(pcs: list[int]) -> bytes:
    return b"".join(ehframe.ROW.pack(pc, i & 0xFFFF, 1, 0) for i, pc in enumerate(pcs))


def find_in_bucket(pcs: list[int], base: int, pages: int, index: bytes, v: int) -> int | None:
    """uw_find_row's search, step for step: the index of the row in effect at v, or None."""
    words = struct.unpack(f"<{len(index) // 4}I", index)
    if v > 0xFFFFFFFF or v < base:
        return None
    b = (v - base) >> ehframe.PAGE_SHIFT
    if b >= pages:
        lo = hi = words[pages]
    else:
        lo, hi = words[b], words[b + 1]
    assert lo <= hi
    steps = 0
    while lo < hi:
        mid = (lo + hi) >> 1
        if pcs[mid] <= v:
            lo = mid + 1
        else:
            hi = mid
        steps += 1
    # The program's loop bound: a bucket holds at most 1 << PAGE_SHIFT rows.
    assert steps <= ehframe.PAGE_SHIFT + 1
    return lo - 1 if lo else None


@pytest.mark.parametrize("seed", range(20))
def test_bucket_search_finds_the_row_a_whole_search_finds(seed: int) -> None:
    rnd = random.Random(seed)
    start = rnd.choice([0, 0x1000, 0x401000, 0x12345, 0xFFFF0000])
    n = rnd.choice([1, 2, 3, 50, 1000, 5000])
    # Dense runs (many rows a bucket), sparse runs (empty buckets) and both.
    gaps = [rnd.choice([1, 1, 2, 16, 300, 5000]) for _ in range(n)]
    pcs: list[int] = []
    pc = start
    for g in gaps:
        pcs.append(pc)
        pc += g
    pcs = [p for p in pcs if p <= 0xFFFFFFFF]
    base, pages, index = ehframe.page_index(pack(pcs))
    assert base <= pcs[0] and base % (1 << ehframe.PAGE_SHIFT) == 0
    assert len(index) % ehframe.ROW.size == 0 and len(index) >= 4 * (pages + 1)
    probes = {0, max(0, base - 1), base, pcs[0] - 1 if pcs[0] else 0, pcs[-1], pcs[-1] + 1, pcs[-1] + 100000,
              0xFFFFFFFF, 1 << 33}
    probes |= {p + d for p in rnd.sample(pcs, min(len(pcs), 300)) for d in (-1, 0, 1)}
    probes |= {rnd.randrange(max(1, base), pcs[-1] + 2) for _ in range(300)}
    for v in sorted(p for p in probes if p >= 0):
        want = bisect.bisect_right(pcs, v) - 1 if v <= 0xFFFFFFFF else -1
        got = find_in_bucket(pcs, base, pages, index, v)
        assert got == (want if want >= 0 else None), (v, base, pages)


def test_a_real_table_index_agrees_with_its_rows() -> None:
    libc = Path("/usr/lib/x86_64-linux-gnu/libc.so.6")
    if not libc.exists():
        pytest.skip("Debian's libc.so.6 is missing")
    packed = ehframe.build_table(str(libc)).pack()
    pcs = [ehframe.ROW.unpack_from(packed, i)[0] for i in range(0, len(packed), ehframe.ROW.size)]
    base, pages, index = ehframe.page_index(packed)
    rnd = random.Random(1)
    for v in [rnd.randrange(base, pcs[-1] + 64) for _ in range(2000)]:
        assert find_in_bucket(pcs, base, pages, index, v) == bisect.bisect_right(pcs, v) - 1
    # A bucket of a real library holds a few dozen rows: a few steps, not log2(rows).
    words = struct.unpack(f"<{pages + 1}I", index[:4 * (pages + 1)])
    assert max(b - a for a, b in zip(words, words[1:])) < 1 << ehframe.PAGE_SHIFT


def test_empty_rows_have_no_index() -> None:
    assert ehframe.page_index(b"") == (0, 0, b"")


def test_the_page_shift_is_the_programs() -> None:
    header = (ROOT / "bpf" / "flamed.h").read_text()
    m = re.search(r"#define FLAMED_UW_PAGE_SHIFT (\d+)", header)
    assert m is not None and int(m.group(1)) == ehframe.PAGE_SHIFT
