#!/usr/bin/env python3
"""Memory of the daemon's snapshot ring (flamed/daemon/ring.py) per entry.

Windows of N distinct (tgid, tid, comm, stack) keys with 30-frame stacks are
added W times, each window with new tuples for the same keys (as each drain
builds them); the Python heap the ring holds (tracemalloc) is printed per
entry, with the time ``add`` takes per window.  Run from a checkout:

    .venv/bin/python bench/ring_memory.py [--entries 100000] [--windows 5] [--distinct-each]

``--distinct-each``: every window has keys of its own (nothing to share): the
worst case, where interning costs time and saves nothing.
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", type=int, default=100_000)
    ap.add_argument("--windows", type=int, default=5)
    ap.add_argument("--distinct-each", action="store_true")
    a = ap.parse_args()
    tracemalloc.start()
    ring = WindowRing(1e9, 1 << 40, clock_ns=lambda: 0)
    t_add = []
    for w in range(a.windows):
        off = w * a.entries if a.distinct_each else 0
        counts = {(1000 + i % 50, 2000 + i % 200, "worker", stack(off + i)): 1 + i % 7 for i in range(a.entries)}
        t = time.perf_counter()
        ring.add(RingWindow(w, w + 1, counts, a.entries))
        t_add.append(time.perf_counter() - t)
        del counts
    held = tracemalloc.get_traced_memory()[0]
    n = a.windows * a.entries
    print(f"| windows x entries | distinct keys | heap held (MB) | bytes per entry | add per window (ms, median) |")
    print(f"|---|---|---|---|---|")
    print(f"| {a.windows} x {a.entries} | {ring.distinct_keys()} | {held / 2**20:.0f} | {held / n:.0f} | "
          f"{sorted(t_add)[len(t_add) // 2] * 1000:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
