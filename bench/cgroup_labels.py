#!/usr/bin/env python3
"""What naming a sample's cgroup costs: flamed.sampling.cgroups on a real tree.

For each size N the script creates N service cgroups (``sK.slice/uI.service``,
50 per slice) in a private subtree ``<v2 root>/flamed-bench-<random>/`` and
measures, as medians of RUNS runs:

* cold: resolving the id of a cgroup created after the last walk (a miss in
  the cache and the path index, so one walk of the whole hierarchy: the
  subtree plus whatever the host has);
* cached: one lookup of an id already resolved (the per-sample cost);
* refresh: ``CgroupFilter.refresh()`` for one unit name (a walk plus the match).

The subtree is removed afterwards, leaves first, whatever happened.

    sudo .venv/bin/python bench/cgroup_labels.py [--sizes "10 100 1000"] [--runs 7]
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flamed.sampling.cgroups import CgroupFilter, CgroupResolver, find_v2_hierarchy  # noqa: E402

CACHED_LOOKUPS = 100_000


def build(base: Path, n: int) -> list[Path]:
    made = []
    for i in range(n):
        d = base / f"s{i // 50}.slice" / f"u{i}.service"
        d.mkdir(parents=True)
        made.append(d)
    return made


def remove_tree(base: Path) -> None:
    for dirpath, _dirs, _files in sorted(os.walk(base, topdown=False), key=lambda w: -len(w[0])):
        os.rmdir(dirpath)


def measure(resolver: CgroupResolver, base: Path, runs: int) -> tuple[float, float, float]:
    """Medians of (cold resolve s, cached lookup s, filter refresh s)."""
    cold, cached, refresh = [], [], []
    unit = "u0.service"
    f = CgroupFilter([unit], resolver)
    for run in range(runs):
        resolver.rescan(force=True)
        new = base / f"late{run}.service"
        new.mkdir()
        cid = os.stat(new).st_ino
        t0 = time.perf_counter()
        ident = resolver.resolve(cid)
        cold.append(time.perf_counter() - t0)
        assert ident is not None and ident.unit == new.name, ident
        resolve = resolver.resolve
        t0 = time.perf_counter()
        for _ in range(CACHED_LOOKUPS):
            resolve(cid)
        cached.append((time.perf_counter() - t0) / CACHED_LOOKUPS)
        t0 = time.perf_counter()
        f.refresh()
        refresh.append(time.perf_counter() - t0)
    return statistics.median(cold), statistics.median(cached), statistics.median(refresh)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10 100 1000", help="cgroups to create per row")
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root: it creates cgroups", file=sys.stderr)
        return 2
    h, why = find_v2_hierarchy()
    if h is None:
        print(f"no cgroup v2 hierarchy: {why}", file=sys.stderr)
        return 2
    print(f"# {why}; medians of {args.runs} runs; cached = {CACHED_LOOKUPS} lookups of one id")
    print(f"{'N':>6} {'walked':>7} {'cold resolve':>13} {'cached lookup':>14} {'filter refresh':>15}")
    for n in (int(x) for x in args.sizes.split()):
        base = h.dir_of(f"/flamed-bench-{secrets.token_hex(4)}")
        base.mkdir()
        try:
            build(base, n)
            # min_rescan_interval 0: every miss walks, which is the cost measured.
            r = CgroupResolver(h, min_rescan_interval=0.0)
            cold, cached, refresh = measure(r, base, args.runs)
            walked = len(r.index())
        finally:
            remove_tree(base)
        print(f"{n:>6} {walked:>7} {cold * 1e3:>10.2f} ms {cached * 1e9:>11.0f} ns {refresh * 1e3:>12.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
