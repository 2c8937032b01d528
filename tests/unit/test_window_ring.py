"""flamed/daemon/ring.py: the snapshot ring's bounds and its packed windows."""

from __future__ import annotations

import gc
import tracemalloc

from flamed.daemon.ring import PackedCounts, RingWindow, StackTable, WindowRing

Counts = dict[tuple[int, int, str, tuple[str, ...]], int]


def _counts(tag: str, n: int, frames: int = 5) -> Counts:
    # new tuples every call, as each drain builds them
    return {(1, i, "w", tuple(f"{tag}{i}:{j}" for j in range(frames))): i + 1 for i in range(n)}


def test_a_packed_window_reads_as_the_counts_it_was_given() -> None:
    c = _counts("a", 300)
    c[(2, 2, "x", ())] = 7  # an empty stack, and a task of its own
    p = StackTable().pack(c)
    assert isinstance(p, PackedCounts) and len(p) == len(c)
    assert dict(p) == c and p == c and dict(p.items()) == c
    assert sorted(p.values()) == sorted(c.values()) and sum(p.values()) == sum(c.values())
    k = next(iter(c))
    assert p[k] == c[k] and k in p
    assert (1, 0, "w", ("nope",)) not in p and (9, 9, "w", k[3]) not in p
    cache: dict[StackTable, dict[int, tuple[int, int, str, tuple[str, ...]]]] = {}
    assert dict(p.decoded_items(cache)) == c
    again = dict(p.decoded_items(cache))
    assert again == c and all(a is b for a, b in zip(again, dict(p.decoded_items(cache))))


def test_equal_keys_of_later_windows_share_their_numbers() -> None:
    ring = WindowRing(1e9, 1 << 30, clock_ns=lambda: 0)
    ring.add(RingWindow(0, 1, _counts("a", 50), 50))
    ring.add(RingWindow(1, 2, _counts("a", 50), 50))
    w0, w1 = ring.since(-1)
    assert isinstance(w0.counts, PackedCounts) and isinstance(w1.counts, PackedCounts)
    assert w0.counts._state[1] == w1.counts._state[1]  # the same numbers: one stack each
    assert w0.counts == w1.counts == _counts("a", 50)
    assert ring.distinct_keys() == 50 and ring.stats() == (2, 100)


def test_keys_of_evicted_windows_are_forgotten() -> None:
    ring = WindowRing(1e9, 10_000, clock_ns=lambda: 0)
    for i in range(40):  # every window new keys; the ring holds 5 windows of 2,000
        ring.add(RingWindow(i, i + 1, _counts(f"w{i}-", 2000), 2000))
    assert ring.stats() == (5, 10_000)
    assert ring.sweeps >= 1
    # what is held, and at most a quarter (or 4,096) more before the next sweep
    assert 10_000 <= ring.distinct_keys() <= 10_000 + 4096 + 2000
    held = [w.counts for w in ring.since(-1)]
    assert held == [_counts(f"w{i}-", 2000) for i in range(35, 40)]  # renumbered, same counts


def test_a_window_held_outside_the_ring_moves_with_a_sweep_and_a_reader_keeps_its_table() -> None:
    ring = WindowRing(1e9, 2000, clock_ns=lambda: 0)
    first = ring.pack(RingWindow(0, 1, _counts("keep-", 2000), 2000))
    ring.add(first)
    kept = first.counts  # as the file being filled holds it
    assert isinstance(kept, PackedCounts)
    reader = iter(kept.items())  # a reader that began before the sweep
    old_table = kept.table
    for i in range(1, 12):
        ring.add(RingWindow(i, i + 1, _counts(f"w{i}-", 2000), 2000))
    assert ring.sweeps >= 1 and kept.table is not old_table  # moved to the new table
    assert kept == _counts("keep-", 2000)
    assert dict(reader) == _counts("keep-", 2000)  # decoded with the table it began with
    del kept, first, reader
    gc.collect()
    for i in range(12, 20):
        ring.add(RingWindow(i, i + 1, _counts(f"w{i}-", 2000), 2000))
    assert ring.distinct_keys() <= 2000 + 4096 + 2000  # once nothing holds it, it is forgotten


def test_frames_are_renumbered_when_they_outnumber_the_live_stacks_by_far() -> None:
    ring = WindowRing(1e9, 100, clock_ns=lambda: 0)
    for i in range(60):  # 100 stacks of 40 new frames each per window: frames pile up
        ring.add(RingWindow(i, i + 1, _counts(f"f{i}-", 100, frames=40), 100))
    table = ring.since(-1)[-1].counts.table  # type: ignore[attr-defined]
    assert ring.sweeps >= 1 and len(table.frames) < 120_000  # 240,000 without renumbering
    assert ring.since(-1)[-1].counts == _counts("f59-", 100, frames=40)


def test_readers_decode_correctly_while_windows_are_added_and_swept() -> None:
    import threading

    ring = WindowRing(1e9, 3000, clock_ns=lambda: 0)
    expected: dict[int, Counts] = {}
    errors: list[str] = []
    done = threading.Event()

    def read() -> None:
        reads = 0
        while not done.is_set() or reads == 0:
            for w in ring.since(-1):
                if dict(w.counts.items()) != expected[w.start_ns]:
                    errors.append(f"window {w.start_ns} decoded wrong")
            reads += 1

    t = threading.Thread(target=read)
    for i in range(3):
        expected[i] = _counts(f"w{i}-", 1000)
        ring.add(RingWindow(i, i + 1, expected[i], 1000))
    t.start()
    try:
        for i in range(3, 40):
            expected[i] = _counts(f"w{i}-", 1000)
            ring.add(RingWindow(i, i + 1, expected[i], 1000))
    finally:
        done.set()
        t.join(timeout=60)
    assert not t.is_alive() and ring.sweeps >= 2 and not errors, errors[:3]


def test_frame_numbers_widen_past_65536_frames_and_windows_read_the_same() -> None:
    ring = WindowRing(1e9, 1 << 30, clock_ns=lambda: 0)
    early = _counts("early-", 100)
    ring.add(RingWindow(0, 1, early, 100))
    assert ring.since(-1)[0].counts.table.code == "H"  # type: ignore[attr-defined]
    many = _counts("many-", 14_000)  # 70,000 new frames
    ring.add(RingWindow(1, 2, many, 14_000))
    w0, w1 = ring.since(-1)
    assert w0.counts.table is w1.counts.table and w1.counts.table.code == "I"  # type: ignore[attr-defined]
    assert w0.counts == early and w1.counts == many
    k = next(iter(many))
    assert w1.counts[k] == many[k] and w0.counts[next(iter(early))] == early[next(iter(early))]


def _table_bytes(t: StackTable) -> int:
    """What a table's arrays take (its stacks' bytes, offsets, hashes, index)."""
    slots, _mask = t._index
    return len(t._blob) + sum(a.buffer_info()[1] * a.itemsize for a in (t._offs, t._hashes, slots))


def test_a_sweep_needs_little_more_than_the_new_table() -> None:
    """A sweep marks the live numbers one byte each and maps old numbers to new
    ones in arrays: at most the new table and ~24 bytes per old stack beside
    it (a set of the live keys and a dict of their new numbers took ~250
    bytes per live key: ~100 MB at 400 k, the daemon's highest mark)."""
    n = 10_000
    ring = WindowRing(1e9, 4 * n, clock_ns=lambda: 0)
    measured = []
    for w in range(7):  # the ring keeps 4 windows: a sweep once enough of the table is dead
        packed = ring.pack(RingWindow(w, w + 1, _counts(f"w{w}-", n, frames=8), n))
        old_stacks = len(ring._table)
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            ring.add(packed)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        del packed
        measured.append((ring.sweeps, peak - before, old_stacks))
    assert measured[-1][0] == 1  # one sweep, after the ring let the first windows go
    for _sweeps, grew, stacks in measured:  # the checks that found too few dead stacks too
        assert grew <= _table_bytes(ring._table) + 24 * stacks + (1 << 20)
    assert [w.counts for w in ring.since(-1)] == [_counts(f"w{w}-", n, frames=8) for w in range(3, 7)]
