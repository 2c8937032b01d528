"""Benchmark: what following forks in BPF costs (`flamed record --subprocesses`).

With ``follow_forks`` the program runs on two raw tracepoints of every task
on the host: ``task_newtask`` (one hash lookup of the parent in the pid
filter, an insert when it is there) and ``sched_process_exit`` (one lookup,
a delete for a followed process).  This runs the sampler at 99 Hz with the
pid filter on, following on and off in alternating rounds, and times a
shell starting /bin/true 300 times (per fork+exec+exit):

- host: the shell is not in the filter (what every other process pays);
- followed: the shell is (started by this process, which is in the filter):
  each /bin/true is filtered in at its fork and out at its exit.

    sudo .venv/bin/python bench/follow_forks_cost.py [--rounds 5]

Prints medians per mode.  Timing on a shared VM swings by 30 % or more:
compare the rows of one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flamed.sampling.bpf import BpfSampler, BpfSamplerOptions  # noqa: E402

EXECS = 300
LOOP = f"i=0; while [ $i -lt {EXECS} ]; do /bin/true; i=$((i+1)); done"


def per_exec_us(shell: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(shell, check=True)
    return (time.perf_counter() - t) / EXECS * 1e6


def one_round(follow: bool, cache: Path, other: int) -> tuple[float, float]:
    host = BpfSamplerOptions(frequency=99, pids=frozenset({other}), follow_forks=follow, bpf_cache_dir=cache)
    with BpfSampler(host):
        time.sleep(0.3)
        h = per_exec_us(["/bin/sh", "-c", LOOP])
    mine = BpfSamplerOptions(frequency=99, pids=frozenset({os.getpid()}), follow_forks=follow, bpf_cache_dir=cache)
    with BpfSampler(mine) as s:
        time.sleep(0.3)
        f = per_exec_us(["/bin/sh", "-c", LOOP])
        s.drain()
    return h, f


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    res: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    other = subprocess.Popen(["sleep", "3600"])
    try:
        with tempfile.TemporaryDirectory() as cache:
            for r in range(args.rounds):
                for follow in (True, False) if r % 2 == 0 else (False, True):
                    res[follow].append(one_round(follow, Path(cache), other.pid))
    finally:
        other.kill()
        other.wait()
    print(f"{'following forks':16} {'host: us per exec':>18} {'followed: us per exec':>22}")
    for follow in (True, False):
        rows = res[follow]
        print(f"{'on' if follow else 'off':16} {statistics.median(r[0] for r in rows):18.0f} "
              f"{statistics.median(r[1] for r in rows):22.0f}")


if __name__ == "__main__":
    main()
