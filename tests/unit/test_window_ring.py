"""flamed/daemon/ring.py: the snapshot ring's bounds and its interning of keys."""

from __future__ import annotations

from flamed.daemon.ring import RingWindow, WindowRing


def _counts(tag: str, n: int) -> dict[tuple[int, int, str, tuple[str, ...]], int]:
    # new tuples every call, as each drain builds them
    return {(1, i, "w", tuple(f"{tag}{i}:{j}" for j in range(5))): i + 1 for i in range(n)}


def test_equal_keys_of_later_windows_share_the_first_ones() -> None:
    ring = WindowRing(1e9, 1 << 30, clock_ns=lambda: 0)
    ring.add(RingWindow(0, 1, _counts("a", 50), 50))
    ring.add(RingWindow(1, 2, _counts("a", 50), 50))
    w0, w1 = ring.since(-1)
    k0 = {k: k for k in w0.counts}
    assert all(k0[k] is k for k in w1.counts)  # the very same tuples
    assert w0.counts == w1.counts  # and the same counts: nothing but identity changed
    assert ring.distinct_keys() == 50 and ring.stats() == (2, 100)


def test_keys_of_evicted_windows_are_forgotten() -> None:
    ring = WindowRing(1e9, 10_000, clock_ns=lambda: 0)
    for i in range(40):  # every window new keys; the ring holds 5 windows of 2,000
        ring.add(RingWindow(i, i + 1, _counts(f"w{i}-", 2000), 2000))
    assert ring.stats() == (5, 10_000)
    # at most twice what is held (a sweep runs when the table reaches that)
    assert 10_000 <= ring.distinct_keys() <= 20_000
    held = {k for w in ring.since(-1) for k in w.counts}
    assert len(held) == 10_000
