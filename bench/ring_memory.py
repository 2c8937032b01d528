#!/usr/bin/env python3
"""Memory of the daemon's snapshot ring (flamed/daemon/ring.py) per entry.

Windows of N distinct (tgid, tid, comm, stack) keys with 30-frame stacks are
added W times, each window with new tuples for the same keys (as each drain
builds them); the Python heap the ring holds (tracemalloc) is printed per
entry, with the time ``add`` (packing the window, see the module's doc)
takes per window, timed in a first run without tracemalloc.  Run from a
checkout:

    .venv/bin/python bench/ring_memory.py [--entries 100000] [--windows 5] [--distinct-each]

``--distinct-each``: every window has keys of its own (nothing to share): the
worst case, where every stack is stored.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flamed.daemon.ring import RingWindow, WindowRing  # noqa: E402

FRAMES = [f"func_{i} (/srv/app/module_{i % 50}.py:{i})" for i in range(3000)]


def stack(i: int) -> tuple[str, ...]:
    r = random.Random(i)
    return tuple(FRAMES[r.randrange(len(FRAMES))] for _ in range(30))


def fill(entries: int, windows: int, distinct_each: bool, *, trace: bool) -> tuple[list[float], tuple[int, int]]:
    """Add the windows to a new ring: (seconds per add, (heap held, distinct keys))."""
    if trace:
        tracemalloc.start()
    ring = WindowRing(1e9, 1 << 40, clock_ns=lambda: 0)
    t_add = []
    for w in range(windows):
        off = w * entries if distinct_each else 0
        counts = {(1000 + i % 50, 2000 + i % 200, "worker", stack(off + i)): 1 + i % 7 for i in range(entries)}
        t = time.perf_counter()
        ring.add(RingWindow(w, w + 1, counts, entries))
        t_add.append(time.perf_counter() - t)
        del counts
    held = tracemalloc.get_traced_memory()[0] if trace else 0
    if trace:
        tracemalloc.stop()
    return t_add, (held, ring.distinct_keys())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", type=int, default=100_000)
    ap.add_argument("--windows", type=int, default=5)
    ap.add_argument("--distinct-each", action="store_true")
    a = ap.parse_args()
    # Timed without tracemalloc (it slows every allocation), then measured with it.
    t_add, _ = fill(a.entries, a.windows, a.distinct_each, trace=False)
    _, (held, distinct) = fill(a.entries, a.windows, a.distinct_each, trace=True)
    n = a.windows * a.entries
    print(f"| windows x entries | distinct keys | heap held (MB) | bytes per entry | add per window (ms, median) |")
    print(f"|---|---|---|---|---|")
    print(f"| {a.windows} x {a.entries} | {distinct} | {held / 2**20:.0f} | {held / n:.0f} | "
          f"{sorted(t_add)[len(t_add) // 2] * 1000:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
