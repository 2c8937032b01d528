"""Benchmark: what the report of code mapped late costs, and what it gains.

The BPF program reports an mmap(2) of a file with PROT_EXEC in a process
user space has read (bpf/profile.bpf.c, flamed_code_mapped, on the raw
tracepoint mmap_lock_released), so that a library loaded late is named even
when its process exits before the drain.  The tracepoint fires at every
release of any process's memory-map lock.  This runs, with the sampler at
99 Hz (frame-pointer stacks: the unwinder, which also has the maps read
again after a miss, would hide what the report gains) and the report on,
then off (``new_code``, the daemon's ``reread_new_code``), in alternating
rounds:

- fork+exec: a shell starting /bin/true 300 times (per exec);
- mmap: a sampled Python process mapping and unmapping 1 MiB 20,000 times
  (per pair): the program's hash lookup hits, then its syscall check;
- named: tests/workloads/late_library.py (libbz2 loaded 0.5 s after start,
  run 1.5 s, exit before the drain): the share of its samples naming libbz2.

    sudo .venv/bin/python bench/new_code_cost.py [--rounds 5]

Prints medians per mode.  Timing on a shared VM swings by 30 % or more:
compare the two rows of one run.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "tests" / "workloads"))

from flamed.sampling.bpf import BpfSampler, BpfSamplerOptions  # noqa: E402
from late_library import names_libbz2  # noqa: E402

EXECS = 300
MMAP = ("import time\nt = time.perf_counter()\nfor i in range(20000): b = bytearray(1 << 20)\n"
        "print((time.perf_counter() - t) / 20000 * 1e6)")


def one_round(report: bool) -> tuple[float, float, float]:
    with BpfSampler(BpfSamplerOptions(frequency=99, python=True, new_code=report)) as s:
        time.sleep(0.5)
        t = time.perf_counter()
        subprocess.run(["/bin/sh", "-c", f"i=0; while [ $i -lt {EXECS} ]; do /bin/true; i=$((i+1)); done"],
                       check=True)
        per_exec = (time.perf_counter() - t) / EXECS * 1e6
        per_mmap = float(subprocess.run([sys.executable, "-c", MMAP], capture_output=True, text=True,
                                        check=True).stdout)
        s.drain()
        subprocess.run([sys.executable, str(ROOT / "tests" / "workloads" / "late_library.py"), "0.5", "1.5"],
                       check=True)
        w = s.drain()
    # late_library.py's samples: those under its module's frames
    total = named = 0
    for (_tgid, _tid, _comm, stack), n in w.counts.items():
        if any("late_library.py" in f for f in stack):
            total += n
            named += n if names_libbz2(stack) else 0
    return per_exec, per_mmap, (named / total if total else 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    res: dict[bool, list[tuple[float, float, float]]] = {True: [], False: []}
    for r in range(args.rounds):
        for report in (True, False) if r % 2 == 0 else (False, True):
            res[report].append(one_round(report))
    print(f"{'report of new code':20} {'us per exec':>12} {'us per 1 MiB mmap':>18} {'late library named':>19}")
    for report in (True, False):
        rows = res[report]
        print(f"{'on' if report else 'off':20} {statistics.median(r[0] for r in rows):12.0f} "
              f"{statistics.median(r[1] for r in rows):18.1f} {statistics.median(r[2] for r in rows):18.0%}")


if __name__ == "__main__":
    main()
