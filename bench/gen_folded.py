#!/usr/bin/env python3
"""Write a deterministic synthetic folded file for the render benchmark.

Stacks come from a random tree (so they share prefixes the way real profiles
do) and mix the three kinds of frames flamed colors apart: kernel (``_[k]``),
native and Python (``func (file.py:N)``).  Lines repeat stacks (as the output
of several collapse runs concatenated would) in a shuffled order.

    bench/gen_folded.py LINES UNIQUE > synthetic.folded
"""

from __future__ import annotations

import random
import sys


def frame_name(rng: random.Random, depth: int) -> str:
    kind = rng.random()
    if depth > 12 and kind < 0.25:
        return f"sys_func_{rng.randrange(400)}_[k]"
    if kind < 0.55:
        return f"py_func_{rng.randrange(3000)} (app/module_{rng.randrange(200)}.py:{rng.randrange(1, 900)})"
    return f"native::Func{rng.randrange(2000)}<T>::call"


def main() -> int:
    lines = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
    unique = int(sys.argv[2]) if len(sys.argv) > 2 else 200_000
    rng = random.Random(20261202)
    roots = [f"worker-{1000 + i}" for i in range(8)]
    stacks: set[str] = set()
    # Grow stacks by extending a random earlier stack's prefix: shared prefixes,
    # depths from a handful to ~60 frames.
    pool: list[list[str]] = [[r] for r in roots]
    while len(stacks) < unique:
        base = rng.choice(pool)
        cut = rng.randrange(1, len(base) + 1)
        new = base[:cut] + [frame_name(rng, cut + i) for i in range(rng.randrange(1, 8))]
        if len(new) > 60:
            new = new[:60]
        key = ";".join(new)
        if key in stacks:
            continue
        stacks.add(key)
        pool.append(new)
    ordered = sorted(stacks)
    rng.shuffle(ordered)
    out = sys.stdout
    write = out.write
    buf: list[str] = []
    for i in range(lines):
        # Every unique stack appears at least once, the rest skewed to a few hot ones.
        s = ordered[i] if i < unique else ordered[int(unique * rng.random() ** 3)]
        buf.append(f"{s} {rng.randrange(1, 50)}\n")
        if len(buf) >= 10000:
            write("".join(buf))
            buf.clear()
    write("".join(buf))
    return 0


if __name__ == "__main__":
    sys.exit(main())
