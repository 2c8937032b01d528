#!/usr/bin/env python3
"""BPF run time per sample, by kind, as the kernel counts it.

    sudo .venv/bin/python bench/bpf_cost.py [--seconds 8] [--repeat 3] [--rate 999] [--compare DIR]

``--compare DIR`` judges a change to the program in one run: DIR is a copy
of bpf/ with the change undone (or made), and every kind runs with both
programs, interleaved, its rows marked ``(B)`` for DIR's.  The defines,
maps and user space stay the shipped ones, so the copy must keep the
layouts user space writes (struct flamed_uw_map and the like).

For each kind a BpfSampler in this process samples one workload (two
CPU-bound processes or threads, one per CPU of this 2-CPU VM, so that nearly
every sample is of the workload) through a pid filter, at --rate Hz, with
kernel.bpf_stats_enabled=1 (restored afterwards):

  plain            tests/workloads/busy.c (frame pointers), no unwinding, no walker
  unwound          tests/workloads/unwind/chain.c built without frame pointers,
                   user stack unwound from .eh_frame in the program
  python           tests/workloads/py_truth.py (pyenv's 3.11), the Python walker,
                   no unwinding (user stack by frame pointers)
  python+unwound   the same, walker and unwinding: the shipped default
  python-deep      a pure-Python recursion 60 frames deep, walker and unwinding
  python-pure      the same recursion 6 frames deep: a Python sample without
                   system calls, walker and unwinding
  python-new       a recursion 40 frames deep through two functions chosen at
                   random at each level, re-taken every ~0.3 ms: nearly every
                   sample's Python stack is new in its generation (stored,
                   its frames' guards read: flamed_pyguard), walker and
                   unwinding; the Python stack map holds 16384 per generation
  truth-bare       py_truth.py with neither walker nor unwinding: what its
                   samples cost before any Python work (its kernel stacks:
                   py_truth writes to a file)
  pure-bare        python-pure's workload with neither walker nor unwinding
  filtered         the plain workload outside the pid filter: what a sample the
                   filter turns away costs (always run)

The figures are the run time and run count of the sampler's perf-event
program (``flamed_sample``; the unwinder's tail calls run inside its runs and
are counted there), read from /proc/self/fdinfo of its fd before and after.
``ns/run`` divides by every run, including samples of other tasks the filter
turned away and idle CPUs; ``ns/sample`` is the run time of the samples the
program took: all of it less the other runs at the ``filtered`` kind's cost
per run (an idle CPU's run costs less still), divided by the samples taken.
The program's own counters say how many took Python frames and how many
stacks were unwound whole.  ``--timing`` also times the Python walk and the
unwinding alone inside the program (two extra clock reads each; the run
times then include them).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

STATS = Path("/proc/sys/kernel/bpf_stats_enabled")
_PY_FRAME = re.compile(r" \(.*:\d+\)$")
PY311 = Path(os.path.expanduser("~root")) / ".pyenv" / "versions" / "3.11.7" / "bin" / "python3.11"
DEEP = r"""
import sys, time, threading
def descend(n, end):
    if n:
        return descend(n - 1, end)
    x = 0
    while time.perf_counter() < end:
        for i in range(2000):
            x += i * i
    return x
end = time.perf_counter() + float(sys.argv[1])
DEPTH = int(sys.argv[3])
ts = [threading.Thread(target=descend, args=(DEPTH, end)) for _ in range(int(sys.argv[2]) - 1)]
for t in ts: t.start()
descend(DEPTH, end)
for t in ts: t.join()
"""
NEW = r"""
import random, sys, time
def a(n, end):
    return (a if random.random() < 0.5 else b)(n - 1, end) if n else spin(end)
def b(n, end):
    return (a if random.random() < 0.5 else b)(n - 1, end) if n else spin(end)
def spin(end):
    t = time.perf_counter() + 0.0003
    while time.perf_counter() < t:
        pass
    return time.perf_counter() < end
end = time.perf_counter() + float(sys.argv[1])
while a(40, end):
    pass
"""


def run_stats(fd: int) -> tuple[int, int]:
    """run_time_ns and run_cnt of the BPF program behind ``fd`` (this process's)."""
    info = dict(line.split(":\t", 1) for line in Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines()
                if ":\t" in line)
    return int(info.get("run_time_ns", "0")), int(info.get("run_cnt", "0"))


def build(tmp: Path) -> dict[str, Path]:
    gcc = shutil.which("gcc")
    if gcc is None:
        raise SystemExit("gcc is needed to build the native workloads")
    out = {"busy": tmp / "flamed_busy", "chain": tmp / "chain"}
    subprocess.run([gcc, "-O0", "-fno-omit-frame-pointer", "-o", str(out["busy"]),
                    str(ROOT / "tests" / "workloads" / "busy.c")], check=True)
    subprocess.run([gcc, "-O2", "-fomit-frame-pointer", "-o", str(out["chain"]),
                    str(ROOT / "tests" / "workloads" / "unwind" / "chain.c")], check=True)
    return out


def workload(kind: str, bins: dict[str, Path], seconds: float) -> list[list[str]]:
    s = f"{seconds + 6:g}"  # runs past the measured span: it is killed after
    if kind in ("plain", "filtered"):
        return [[str(bins["busy"]), "busy", s]] * 2
    if kind == "unwound":
        return [[str(bins["chain"]), s]] * 2
    if kind == "python-deep":
        return [[str(PY311), "-c", DEEP, s, "2", "60"]]
    if kind in ("python-pure", "pure-bare"):
        return [[str(PY311), "-c", DEEP, s, "2", "5"]]
    if kind == "python-new":
        return [[str(PY311), "-c", NEW, s]] * 2
    return [[str(PY311), str(ROOT / "tests" / "workloads" / "py_truth.py"), s, "2"]]


def case(kind: str, bins: dict[str, Path], seconds: float, rate: int, timing: bool,
         bpf_dir: Path | None = None, label: str | None = None) -> dict[str, Any]:
    from flamed.sampling.bpf import BpfSampler, BpfSamplerOptions  # noqa: PLC0415 - needs root and bcc

    python = kind.startswith("python")
    unwind = kind in ("unwound", "python+unwound", "python-deep", "python-pure", "python-new")
    more = {"python_stack_entries": 16384} if kind == "python-new" else {}
    s = BpfSampler(BpfSamplerOptions(frequency=rate, pids=frozenset(), python=python, unwind=unwind,
                                     python_timing=timing and python, unwind_timing=timing and unwind,
                                     bpf_dir=bpf_dir, **more))  # type: ignore[arg-type]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        s.start()
        fd = s._program.prog_fd  # noqa: SLF001 - flamed_sample's fd: the bench reads its run time
        procs = [subprocess.Popen(argv, stdout=subprocess.DEVNULL) for argv in workload(kind, bins, seconds)]
        for p in procs:
            if kind != "filtered":
                s.add_pid(p.pid)
        deadline = time.monotonic() + 20
        # Described to the walker and the unwinder, their tables loaded: a warm-up window.
        while time.monotonic() < deadline:
            time.sleep(0.5)
            s.drain()
            if all((not unwind or s.unwind_ready(p.pid)) and (not python or s.python_claim(p.pid)[0])
                   for p in procs):
                break
        time.sleep(1.0)
        s.drain()
        st0 = s.stats()
        ns0, cnt0 = run_stats(fd)
        t0 = time.monotonic()
        time.sleep(seconds)
        ns1, cnt1 = run_stats(fd)
        t1 = time.monotonic()
        w = s.drain()
        st1 = s.stats()
        if any(p.poll() is not None for p in procs):
            raise SystemExit(f"{kind}: the workload ended during the measurement")
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)
        s.close()
    pids = {p.pid for p in procs}
    mine = sum(n for (tgid, _t, _c, _st), n in w.counts.items() if tgid in pids)
    native = sum(n * sum(1 for f in st if not f.endswith("_[k]") and not _PY_FRAME.search(f))
                 for (tgid, _t, _c, st), n in w.counts.items() if tgid in pids)
    python_frames = sum(n * sum(1 for f in st if _PY_FRAME.search(f))
                        for (tgid, _t, _c, st), n in w.counts.items() if tgid in pids)
    taken = st1.bpf_samples_total - st0.bpf_samples_total
    py = {k: st1.python_total.get(k, 0) - st0.python_total.get(k, 0) for k in st1.python_total}
    uw = {k: st1.unwind_total.get(k, 0) - st0.unwind_total.get(k, 0) for k in st1.unwind_total}
    return {"kind": label or kind, "seconds": t1 - t0, "native_frames": native / max(1, mine),
            "python_frames": python_frames / max(1, mine), "runs": cnt1 - cnt0, "run_ns": ns1 - ns0, "taken": taken,
            "workload": mine, "py_stacks": py.get("PY_STACKS", 0), "py_ns": py.get("PY_NS", 0),
            "py_walks": py.get("PY_SAMPLES", 0),
            "py_distinct": len({tuple(f for f in st if _PY_FRAME.search(f))
                                for (tgid, _t, _c, st) in w.counts if tgid in pids}),
            "uw_samples": uw.get("UW_SAMPLES", 0), "uw_complete": uw.get("UW_COMPLETE", 0),
            "uw_ns": uw.get("UW_NS", 0)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=8.0, help="measured span of each run (8)")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each kind, interleaved; medians (3)")
    ap.add_argument("--rate", type=int, default=999, help="sampling rate, Hz (999)")
    ap.add_argument("--kinds", default="plain,unwound,python,python+unwound,python-deep")
    ap.add_argument("--timing", action="store_true", help="also time the Python walk inside the program")
    ap.add_argument("--compare", type=Path, metavar="DIR",
                    help="a changed copy of bpf/: each kind also runs with the program from DIR, "
                         "interleaved with the shipped one (rows 'KIND (B)'), so a change is judged in one run")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root (BPF, perf events, kernel.bpf_stats_enabled)")
    kinds = ["filtered", *(k for k in args.kinds.split(",") if k and k != "filtered")]
    print(f"load average at start: {os.getloadavg()[0]:.2f}; {os.cpu_count()} CPUs; {args.rate} Hz, "
          f"{args.seconds:g} s per run, {args.repeat} runs per kind")
    old = STATS.read_text()
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="flamed-bpfcost-") as d:
        bins = build(Path(d))
        try:
            STATS.write_text("1\n")
            for _ in range(args.repeat):
                for kind in kinds:
                    results.append(case(kind, bins, args.seconds, args.rate, args.timing))
                    if args.compare is not None and kind != "filtered":
                        results.append(case(kind, bins, args.seconds, args.rate, args.timing,
                                            bpf_dir=args.compare, label=f"{kind} (B)"))
        finally:
            STATS.write_text(old)
    med = statistics.median
    print()
    hdr = ("kind", "ns/run", "ns/sample", "runs", "taken", "workload", "native/Python frames", "Python stacks",
           "unwound whole",
           "Python walk ns", "unwind ns")
    rows = []
    turned_away = med([r["run_ns"] / max(1, r["runs"]) for r in results if r["kind"] == "filtered"])

    def net(r: dict[str, Any]) -> float:
        return (r["run_ns"] - (r["runs"] - r["taken"]) * turned_away) / max(1, r["taken"])

    labels = [k for kind in kinds for k in (kind, f"{kind} (B)") if any(r["kind"] == k for r in results)]
    for kind in labels:
        rs = [r for r in results if r["kind"] == kind]
        per_run = med([r["run_ns"] / max(1, r["runs"]) for r in rs])
        if kind == "filtered":
            rows.append((kind, f"{per_run:.0f}", "-", rs[-1]["runs"], rs[-1]["taken"], "-", "-", "-", "-", "-", "-"))
            continue
        per_taken = med([net(r) for r in rs])
        spread = f"{min(net(r) for r in rs):.0f}-{max(net(r) for r in rs):.0f}"
        last = rs[-1]
        walk = med([r["py_ns"] / r["py_walks"] for r in rs if r["py_walks"] and r["py_ns"]]) \
            if any(r["py_ns"] for r in rs) else None
        uwt = med([r["uw_ns"] / r["uw_samples"] for r in rs if r["uw_samples"] and r["uw_ns"]]) \
            if any(r["uw_ns"] for r in rs) else None
        uw = f"{100 * last['uw_complete'] / last['uw_samples']:.0f} %" if last["uw_samples"] else "-"
        pys = (f"{100 * last['py_stacks'] / max(1, last['taken']):.0f} % ({last['py_distinct']} distinct)"
               if kind.startswith("python") else "-")
        rows.append((kind, f"{per_run:.0f}", f"{per_taken:.0f} ({spread})", last["runs"], last["taken"],
                     last["workload"], f"{last['native_frames']:.1f} / {last['python_frames']:.1f}", pys, uw, f"{walk:.0f}" if walk is not None else "-",
                     f"{uwt:.0f}" if uwt is not None else "-"))
    cells = [hdr, *rows]
    widths = [max(len(str(r[i])) for r in cells) for i in range(len(hdr))]
    for j, r in enumerate(cells):
        print("  ".join(str(c).rjust(w) for c, w in zip(r, widths)))
        if j == 0:
            print("  ".join("-" * w for w in widths))
    print("\nns/sample: run time of the samples taken, per sample, median (min-max) over the runs; "
          "the goal for a sample with Python frames is <= 2000 ns")
    return 0


if __name__ == "__main__":
    sys.exit(main())
