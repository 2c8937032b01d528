"""Benchmark: how many samples of short-lived processes get their user frames named.

A process that lives and dies between two drains takes /proc/PID/maps with
it.  This runs tests/workloads/busy.c again and again (each run a new
process that spins in main;busy_outer;busy_middle;busy_leaf for RUN
seconds, then exits) for ``--seconds``, with the BPF sampler at 999 Hz, then
drains once -- every workload process is gone by then -- and counts, of the
samples under comm ``flamed_busy``: those whose stack has ``busy_leaf``
(named), and those whose user stack is only ``[unknown]``.  Once with the
sampler's priming (maps read at a process's first sample) and once without,
in the same run.

    sudo .venv/bin/python bench/short_lived.py [--runs 0.2,0.02,0.005] [--seconds 6]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flamed.sampling.bpf import BpfSampler, BpfSamplerOptions  # noqa: E402
from sampler import build  # noqa: E402  -- bench/sampler.py: tests/workloads/busy.c with frame pointers


def measure(binary: Path, run_s: float, seconds: float, prime: bool) -> dict[str, float]:
    s = BpfSampler(BpfSamplerOptions(frequency=999, prime=prime))
    s.start()
    try:
        # Steady state, as in the daemon: at start every process on the host is
        # new and the priming thread first reads all of their maps.
        time.sleep(1.0)
        s.drain()
        t0 = time.monotonic()
        runs = 0
        while time.monotonic() - t0 < seconds:
            subprocess.run([str(binary), "busy", str(run_s)], stdout=subprocess.DEVNULL, timeout=60, check=True)
            runs += 1
        w = s.drain()
        st = s.stats()
    finally:
        s.close()
    total = named = unknown = 0
    for (_pid, _tid, comm, stack), n in w.counts.items():
        if comm != "flamed_busy":
            continue
        total += n
        if any(f == "busy_leaf" for f in stack):
            named += n
        elif stack and stack[0] == "[unknown]":
            unknown += n
    return {"runs": runs, "samples": total, "named": named, "unknown": unknown,
            "primed": st.primed_total, "gone": st.prime_missed_total, "lost": st.prime_lost_total,
            "throttled": st.prime_throttled_total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default="0.2,0.02,0.005", help="seconds each process runs, comma-separated")
    ap.add_argument("--seconds", type=float, default=6.0, help="how long to keep starting processes")
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench: run as root (BPF)")
    with tempfile.TemporaryDirectory(prefix="flamed-short-") as d:
        binary = build(Path(d))
        load = os.getloadavg()[0]
        print(f"# {os.cpu_count()} CPUs, 999 Hz, {a.seconds:g} s of back-to-back runs per row, load average {load:.2f}")
        cols = ("run s", "priming", "processes", "samples", "named %", "[unknown] %", "primed", "gone", "lost", "throttled")
        print(" | ".join(cols))
        print(" | ".join("---" for _ in cols))
        for run_s in (float(x) for x in a.runs.split(",")):
            for prime in (True, False):
                m = measure(binary, run_s, a.seconds, prime)
                t = max(1, m["samples"])
                print(" | ".join(str(x) for x in (
                    f"{run_s:g}", "on" if prime else "off", m["runs"], m["samples"],
                    f"{100 * m['named'] / t:.1f}", f"{100 * m['unknown'] / t:.1f}",
                    *((m["primed"], m["gone"], m["lost"], m["throttled"]) if prime else ("-",) * 4),
                )), flush=True)


if __name__ == "__main__":
    main()
