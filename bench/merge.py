#!/usr/bin/env python3
"""Benchmark ``flamed merge`` on 8 timestamped traces totalling >= 1 GB.

The traces are made from a real perf capture (the one bench/collapse.sh records,
or BENCH_INPUT): ``flamed merge perf-script.txt`` turns it into a trace with
its real stacks and timestamps; each of the 8 "workers" gets that trace with
its timestamps shifted by a few hundred ns per worker (so the k-way merge
really interleaves all 8) and repeated back to back until it is 1/8 of the
target size.  Then it times, in one run:

* ``flamed merge`` of the 8 traces -> one trace (streaming k-way merge),
* ``flamed merge --output-format folded`` (merge + aggregate),
* GNU ``sort -m`` on the same files, the classic streaming merge of sorted text,

and prints seconds, MB/s, CPU seconds, peak RSS, and checks the merged trace:
line count, timestamps non-decreasing, identical to ``sort -m``'s lines.

    .venv/bin/python bench/merge.py                 # BENCH_DIR=/tmp/flamed-bench
    BENCH_TOTAL_MB=1100 .venv/bin/python bench/merge.py

Timings on a shared 2-CPU machine are noisy; the CPU seconds are steadier.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FLAMED = [str(ROOT / ".venv" / "bin" / "flamed")]
DIR = Path(os.environ.get("BENCH_DIR", "/tmp/flamed-bench"))
TOTAL_MB = int(os.environ.get("BENCH_TOTAL_MB", "1024"))
SOURCES = 8


def base_trace() -> Path:
    base = DIR / "base.trace"
    if base.exists() and base.stat().st_size > 0:
        return base
    perf = Path(os.environ.get("BENCH_INPUT", DIR / "perf-script.txt"))
    if not perf.exists():
        print("bench: no perf script yet; running bench/collapse.sh's generator first", file=sys.stderr)
        subprocess.run(["sh", str(ROOT / "bench" / "collapse.sh")], check=True, env={**os.environ, "BENCH_ONLY_GENERATE": "1"})
    subprocess.run([*FLAMED, "merge", str(perf), "-o", str(base)], check=True)
    return base


def make_traces(base: Path) -> list[Path]:
    want = TOTAL_MB * 1_000_000 // SOURCES
    lines = base.read_bytes().split(b"\n")
    body = [ln for ln in lines if ln and not ln.startswith(b"#")]
    t0 = int(body[0].split(b" ", 1)[0])
    t1 = int(body[-1].split(b" ", 1)[0])
    span = t1 - t0 + 1_000_000
    paths = []
    for k in range(SOURCES):
        p = DIR / f"worker-{k}.trace"
        paths.append(p)
        if p.exists() and p.stat().st_size >= want:
            continue
        with p.open("wb") as f:
            f.write(b"# flamed trace: TIMESTAMP(ns) STACK COUNT\n")
            size, rep = 0, 0
            while size < want:
                shift = rep * span + k * 137
                out = []
                for ln in body:
                    ts, _, rest = ln.partition(b" ")
                    out.append(b"%d %s\n" % (int(ts) + shift, rest))
                chunk = b"".join(out)
                f.write(chunk)
                size += len(chunk)
                rep += 1
    return paths


def rss_of(cmd: list[str], out: Path) -> tuple[float, float, int]:
    tf = DIR / "time.txt"
    t = time.monotonic()
    with out.open("wb") as f:
        subprocess.run(["/usr/bin/time", "-f", "%e %U %S %M", "-o", str(tf), *cmd], stdout=f, check=True, env={**os.environ, "LC_ALL": "C"})
    wall = time.monotonic() - t
    _, u, s, m = tf.read_text().split()
    return wall, float(u) + float(s), int(m)


def main() -> int:
    DIR.mkdir(parents=True, exist_ok=True)
    traces = make_traces(base_trace())
    total = sum(p.stat().st_size for p in traces)
    n_lines = sum(1 for p in traces for _ in p.open("rb")) - len(traces)
    mb = total / 1e6
    print(f"input: {len(traces)} traces, {mb:.0f} MB, {n_lines} samples; load average {open('/proc/loadavg').read().split()[0]}")
    rows = []
    out_trace = DIR / "merged.trace"
    # --keep-ids: these copies of one capture share every id; remapping would make the
    # lines differ from sort -m (it costs the same).
    rows.append(("flamed merge -> trace", *rss_of([*FLAMED, "merge", "--keep-ids", *map(str, traces)], out_trace)))
    out_folded = DIR / "merged.folded"
    rows.append(("flamed merge -> folded", *rss_of([*FLAMED, "merge", "--output-format", "folded", *map(str, traces)], out_folded)))
    out_sort = DIR / "sort-m.txt"
    rows.append(("sort -m (GNU)", *rss_of(["sort", "-m", "-s", "-n", "-k1,1", *map(str, traces)], out_sort)))
    print(f"{'tool':<24} {'wall s':>7} {'MB/s':>7} {'CPU s':>7} {'peak RSS MB':>11}")
    for name, wall, cpu, rss in rows:
        print(f"{name:<24} {wall:7.1f} {mb / wall:7.1f} {cpu:7.1f} {rss / 1024:11.0f}")
    # Checks: every sample once, in time order, and the same lines as sort -m
    # (these traces carry no task ids, so there is nothing to remap).
    prev = -1
    count = 0
    with out_trace.open("rb") as f:
        for ln in f:
            if ln.startswith(b"#"):
                continue
            t = int(ln.split(b" ", 1)[0])
            assert t >= prev, "merged trace not in time order"
            prev = t
            count += 1
    print(f"merged trace: {count} samples ({'all' if count == n_lines else 'MISSING SOME'}), timestamps non-decreasing")
    cmp = subprocess.run(
        f"LC_ALL=C grep -v '^#' {out_sort} | cmp -s - <(LC_ALL=C grep -v '^#' {out_trace}) && echo same || echo differ",
        shell=True,
        executable="/bin/bash",
        capture_output=True,
        text=True,
    ).stdout.strip()
    print(f"merged trace vs sort -m: {cmp} lines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
