"""flamed/sampling/mapread.py: count rows unpacked as they are iterated, stack values read in place, stack addresses kept in one buffer."""

from __future__ import annotations

import random
import struct
from array import array
import sys

import pytest

from flamed.sampling.mapread import CountRows, StackAddrs, StackValues, cut_pystacks, cut_ustacks
from flamed.sampling.program import KEY
from flamed.sampling.pyframes import parse_pystack
from flamed.sampling.unwind import parse_ustack


def _row(r: random.Random) -> tuple[int, int, int, int, bytes, int, int, int, int, int]:
    comm = bytes(r.randrange(97, 123) for _ in range(r.randrange(1, 16))).ljust(16, b"\0")
    return (r.randrange(1, 1 << 22), r.randrange(1, 1 << 22), r.randrange(-20, 1 << 20), r.randrange(-20, 1 << 20),
            comm, r.choice([0, r.getrandbits(64)]), r.choice([0, r.getrandbits(64)]), r.getrandbits(64),
            r.choice([0, r.getrandbits(47)]), r.randrange(1, 1000))


def test_count_rows_and_their_columns_match_the_rows_they_were_read_from() -> None:
    r = random.Random(7)
    rows = [_row(r) for _ in range(2000)]
    extra = [_row(r) for _ in range(3)]  # read key by key after the batch
    c = CountRows(b"".join(KEY.pack(*x[:9]) for x in rows), [x[9] for x in rows], extra)
    assert len(c) == 2003 and list(c) == rows + extra and list(c) == rows + extra  # iterable again
    assert c.tgids() == {x[0] for x in rows + extra}
    # A row with an unwound stack (x[6]) took no frame-pointer walk: its user stack id is not a stack.
    assert c.stack_ids() == {x[2] for x in rows + extra} | {x[3] for x in rows + extra if not x[6]}
    assert c.native_tgids() == {x[0] for x in rows + extra if x[6]}


def test_stack_values_are_slices_of_the_buffer_by_id() -> None:
    ids = [random.Random(i).getrandbits(64) for i in range(50)]
    blob = b"".join(bytes([i]) * (i % 7) for i in range(50))  # values of their own lengths, some empty
    offs = [0]
    for i in range(50):
        offs.append(offs[-1] + i % 7)
    v = StackValues(ids, blob, offs)
    assert len(v) == 50 and ids[3] in v and 5 not in v
    assert bytes(v.get(ids[3]) or b"") == bytes([3]) * 3 and v.get(ids[49]) is not None and bytes(v.get(ids[49]) or b"") == b""
    assert v.get(6) is None


def test_stack_addresses_come_back_as_they_were_added_whatever_their_length() -> None:
    r = random.Random(11)
    want: dict[int, list[int]] = {}
    s = StackAddrs()
    for sid in r.sample(range(1 << 20), 500):
        ips = [r.getrandbits(64) or 1 for _ in range(r.randrange(0, 128))]  # 0..127 frames, as a stack map holds
        want[sid] = ips
        s.add(sid, b"".join(ip.to_bytes(8, sys.byteorder) for ip in ips))
    assert len(s) == 500 and set(s) == set(want)
    for sid, ips in want.items():
        assert sid in s and list(s[sid]) == ips and list(reversed(s[sid])) == ips[::-1]
    missing = next(i for i in range(1 << 21) if i not in want)
    assert missing not in s and s.get(missing) is None


def test_stack_values_find_every_id_of_a_large_map_and_no_other() -> None:
    """Ids anywhere in 0..2**64-1, in the buffer's order, found by bisection."""
    r = random.Random(5)
    ids = list({r.getrandbits(64) for _ in range(20000)} | {0, 1, (1 << 64) - 1})
    r.shuffle(ids)
    blob = b"".join(i.to_bytes(8, "little") for i in ids)  # each value is its own id
    v = StackValues(ids, blob, range(0, 8 * len(ids) + 1, 8))
    assert len(v) == len(ids)
    for i in ids:
        assert i in v and int.from_bytes(bytes(v.get(i) or b""), "little") == i
    present = set(ids)
    for i in (r.getrandbits(64) for _ in range(2000)):
        if i not in present:
            assert i not in v and v.get(i) is None
    assert -1 not in v and v.get(-1) is None


@pytest.mark.parametrize("depth", [1, 7, 32, 128])
def test_a_stack_cut_to_what_it_uses_reads_as_the_whole_value(depth: int) -> None:
    """What the drain keeps of a stack map's values (their used part) parses
    as the fixed-size value the program wrote, for every frame count and an
    odd depth (the struct's tail padding)."""
    r = random.Random(depth)
    for n in sorted({0, 1, depth // 2, depth, depth + 3}):  # a count past the depth is cut to it
        k = min(n, depth)
        codes = [r.getrandbits(64) for _ in range(k)] + [0] * (depth - k)
        instrs = [r.getrandbits(32) for _ in range(k)] + [0] * (depth - k)
        guards = [r.getrandbits(32) for _ in range(k)] + [0] * (depth - k)
        for flags in (r.getrandbits(32) & ~4, r.getrandbits(32) | 4):  # guards read (4) or not
            whole = struct.pack(f"<II{depth}Q{depth}I{depth}I", n, flags, *codes, *instrs, *guards)
            cut = bytearray()
            offs = array("Q", [0])
            cut_pystacks(memoryview(whole * 3), len(whole), cut, offs)  # three in a row
            assert list(offs) == [0, 8 + 16 * k, 2 * (8 + 16 * k), 3 * (8 + 16 * k)]
            cut = cut[: offs[1]]
            want = (list(zip(codes[:k], instrs[:k])), flags & ~4, tuple(guards[:k]) if flags & 4 else None)
            assert parse_pystack(bytes(cut), depth) == parse_pystack(whole, depth) == want

        ips = [r.getrandbits(64) for _ in range(k)] + [0] * (depth - k)
        uwhole = struct.pack(f"<II{depth}Q", n, 2, *ips)
        ucut = bytearray()
        uoffs = array("Q", [0])
        cut_ustacks(uwhole, len(uwhole), ucut, uoffs)
        assert list(uoffs) == [0, len(ucut)] and len(ucut) == 8 + 8 * k and parse_ustack(bytes(ucut)) == parse_ustack(uwhole) == (ips[:k], parse_ustack(uwhole)[1])


def test_the_unset_user_stack_id_of_an_unwound_sample_is_not_read_as_a_stack() -> None:
    """An unwound sample's key keeps user_stack_id 0 (the BPF program takes no
    frame-pointer walk for it). Read as a stack id, 0 was missing from the
    stack map in every window and counted as a lost stack (stack_read_failed)."""
    comm = b"python".ljust(16, b"\0")
    rows = [(10, 10, -14, 0, comm, 0, 0xABCDEF, 1, 0x401000, 5),  # unwound: user id 0 unset
            (11, 11, 7, 9, comm, 0, 0, 1, 0, 3)]  # frame pointers: user stack 9
    c = CountRows(b"".join(KEY.pack(*x[:9]) for x in rows), [x[9] for x in rows], [])
    assert c.stack_ids() == {-14, 7, 9}
