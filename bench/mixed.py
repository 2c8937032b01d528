"""Mixed-mode benchmark: attribution accuracy and overhead of `flamed record`.

Accuracy: tests/workloads/phases.py alternates a syscall-heavy and a compute
Python function in phases of 20, 50 and 200 ms; `flamed record -r 199`
(py-spy non-blocking, 100 Hz) records it R times per phase length with each
placement method, and tests/workloads/accuracy.py scores the timeline:
  bpf         -- record's default: Python frames read by the BPF program
  likelihood  -- py-spy (--pyspy): uprobe clock, signature likelihood
  read-times  -- the same, samples timed by py-spy's process_vm_readv (--read-times)
  midpoint    -- --no-refine (uprobe clock, change at the gap's midpoint)
  no-uprobe   -- --no-clock-uprobe --no-refine (py-spy's start guessed from its spawn)

Overhead: a fixed amount of work (compute + os.stat) timed alone, under
`flamed record` without py-spy (BPF sampler, clock programs and flamed's own
drains only), with the Python walker in BPF (record's default), with py-spy
non-blocking, and with --blocking; py-spy's CPU
(utime+stime over its lifetime) and peak RSS are read from /proc.  On a 2-CPU
host flamed's own CPU competes with the workload, so "BPF only" is the line
to compare the py-spy modes with.

The host is shared and small (2 CPUs): numbers are noisy, which is why each
cell says min/median over R runs.  Run as root:  bench/mixed.sh [-r R]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.workloads.accuracy import accuracy  # noqa: E402

PY = sys.executable
FLAMED = [PY, "-m", "flamed", "record"]
PHASES = str(ROOT / "tests" / "workloads" / "phases.py")
#: How each sample gets its Python frames: read in BPF (record's default for
#: CPython 3.8-3.13), or py-spy's stacks joined by time with each placement
#: method (--pyspy: without it these would be the BPF walker's too).
METHODS = {"bpf": [], "likelihood": ["--pyspy"], "read-times": ["--pyspy", "--read-times"],
           "midpoint": ["--pyspy", "--no-refine"], "no-uprobe": ["--pyspy", "--no-clock-uprobe", "--no-refine"]}

WORK = r"""
import os, sys, time
def compute(n):
    x = 0
    for i in range(n):
        x = (x * 31 + i) % 1000003
    return x
def syscalls(n):
    for _ in range(n):
        os.stat("/")
t, c = time.perf_counter(), time.process_time()
for _ in range(int(sys.argv[1])):
    compute(200000)
    syscalls(20000)
print(time.perf_counter() - t, time.process_time() - c)
"""


def record_accuracy(phase_ms: int, method: list[str], tmp: Path) -> dict[str, float]:
    cycles = max(4, int(4000 / (2 * phase_ms)))  # about 4 s of phases
    log, tl = tmp / "phases.log", tmp / "timeline.txt"
    r = subprocess.run(FLAMED + ["-r", "199", "-o", str(tmp / "out.folded"), "--timeline", str(tl), *method,
                                 "--", PY, PHASES, str(log), str(phase_ms), str(cycles)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(f"flamed record failed: {r.stderr}")
    a = accuracy(str(log), str(tl))
    return {"syscall": a.syscall, "compute": a.compute, "n": a.main_samples}


def watch_pyspy(parent: int, stop: threading.Event, out: dict[str, float]) -> None:
    """Peak RSS and final CPU seconds of py-spy children of ``parent``."""
    tick = os.sysconf("SC_CLK_TCK")
    while not stop.is_set():
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                if (d / "comm").read_text().strip() != "py-spy":
                    continue
                stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
                if int(stat[1]) != parent:
                    continue
                cpu = (int(stat[11]) + int(stat[12])) / tick
                age = time.monotonic() - (int(stat[19]) / tick - (time.clock_gettime(time.CLOCK_BOOTTIME) - time.monotonic()))
                rss = next(int(ln.split()[1]) for ln in (d / "status").read_text().splitlines()
                           if ln.startswith("VmRSS:")) / 1024
            except (OSError, StopIteration, ValueError, IndexError):
                continue
            out["rss_mb"] = max(out.get("rss_mb", 0.0), rss)
            out["cpu_s"] = max(out.get("cpu_s", 0.0), cpu)
            out["age_s"] = max(out.get("age_s", 0.0), age)
        stop.wait(0.2)


def timed_work(extra: list[str] | None, iters: int, tmp: Path) -> tuple[tuple[float, float], dict[str, float]]:
    """((wall s, cpu s) of the workload, py-spy stats)."""
    script = tmp / "work.py"
    script.write_text(WORK)
    if extra is None:
        r = subprocess.run([PY, str(script), str(iters)], capture_output=True, text=True, timeout=600)
        wall, cpu = r.stdout.split()
        return (float(wall), float(cpu)), {}
    p = subprocess.Popen(FLAMED + ["-r", "99", "-o", str(tmp / "w.folded"), *extra, "--", PY, str(script), str(iters)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    stats: dict[str, float] = {}
    stop = threading.Event()
    th = threading.Thread(target=watch_pyspy, args=(p.pid, stop, stats), daemon=True)
    th.start()
    out, err = p.communicate(timeout=600)
    stop.set()
    th.join()
    if p.returncode != 0:
        raise SystemExit(f"flamed record failed: {err}")
    wall, cpu = out.strip().splitlines()[-1].split()
    return (float(wall), float(cpu)), stats


def bench_accuracy(repeat: int, tmp: Path, raw: dict[str, object]) -> None:
    print(f"# mixed-mode attribution accuracy, {repeat} runs per cell (min / median); load {os.getloadavg()[0]:.1f}")
    print(f"{'phase':>6} {'method':>11} {'syscall':>15} {'compute':>15} {'samples':>8}")
    for phase in (20, 50, 200):
        for name, flags in METHODS.items():
            rs = [record_accuracy(phase, flags, tmp) for _ in range(repeat)]
            raw[f"acc_{phase}_{name}"] = rs
            sc = sorted(r["syscall"] for r in rs)
            cp = sorted(r["compute"] for r in rs)
            n = int(statistics.median(r["n"] for r in rs))
            print(f"{phase:>4}ms {name:>11} {sc[0]:>7.3f}/{statistics.median(sc):<7.3f} "
                  f"{cp[0]:>7.3f}/{statistics.median(cp):<7.3f} {n:>8}")


def bench_overhead(repeat: int, iters: int, tmp: Path, raw: dict[str, object]) -> None:
    print(f"# overhead: {iters} work units, {repeat} interleaved rounds (median); load {os.getloadavg()[0]:.1f}")
    print("# wall: elapsed seconds; cpu: the workload's own CPU seconds (less sensitive to the host's load)")
    print(f"{'mode':>28} {'wall s':>8} {'slowdown':>9} {'cpu s':>7} {'cpu +':>7} {'py-spy cpu':>11} {'py-spy rss':>11}")
    # record's default reads Python frames in BPF; the py-spy modes need --pyspy
    # (without it they were the walker's too), and "BPF only" a py-spy that is not there.
    modes = {"alone": None, "record, BPF only": ["--pyspy", "/nonexistent/py-spy"],
             "record, walker in BPF": [],
             "py-spy non-blocking": ["--pyspy"], "non-blocking + read times": ["--pyspy", "--read-times"],
             "py-spy --blocking": ["--pyspy", "--blocking"]}
    results: dict[str, list[tuple[tuple[float, float], dict[str, float]]]] = {m: [] for m in modes}
    # Round-robin, so that the host's load drifts over every mode alike.
    for _ in range(repeat):
        for name, extra in modes.items():
            results[name].append(timed_work(extra, iters, tmp))
    base_w = statistics.median(r[0][0] for r in results["alone"])
    base_c = statistics.median(r[0][1] for r in results["alone"])
    for name, runs in results.items():
        w = statistics.median(r[0][0] for r in runs)
        c = statistics.median(r[0][1] for r in runs)
        if name == "alone":
            print(f"{name:>28} {w:>8.3f} {'':>9} {c:>7.3f} {'':>7}")
            continue
        spy = [r[1] for r in runs if r[1]]
        cpu = statistics.median(x.get("cpu_s", 0.0) / max(x.get("age_s", 1e-9), 1e-9) for x in spy) if spy else 0.0
        rss = max((x.get("rss_mb", 0.0) for x in spy), default=0.0)
        spy_cols = f"{100 * cpu:>10.1f}% {rss:>8.0f} MB" if spy else f"{'-':>11} {'-':>11}"
        print(f"{name:>28} {w:>8.3f} {100 * (w / base_w - 1):>8.1f}% {c:>7.3f} {100 * (c / base_c - 1):>6.1f}% "
              f"{spy_cols}")
        raw[f"over_{name}"] = runs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-r", "--repeat", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20, help="work units of the overhead workload (default 20)")
    ap.add_argument("--json", help="also write the raw figures here")
    ap.add_argument("--only", choices=("accuracy", "overhead"), help="run one half")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench/mixed.sh needs root (BPF, py-spy)")
    raw: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="flamed-bench-mixed-") as t:
        tmp = Path(t)
        if args.only != "overhead":
            bench_accuracy(args.repeat, tmp, raw)
            print()
        if args.only != "accuracy":
            bench_overhead(args.repeat, args.iters, tmp, raw)
    if args.json:
        Path(args.json).write_text(json.dumps(raw, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
