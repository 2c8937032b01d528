#!/usr/bin/env python3
"""Wall-clock profiles of a request-like service that mostly waits:
``flamed record --mode wall`` against ``py-spy record --idle``, on the same
program in the same run, and both against what the program measured itself.

    sudo .venv/bin/python bench/wall_vs_pyspy.py [--runs 3] [--seconds 4] [--python PY]

tests/workloads/requests_wait.py serves requests on two threads: each request
computes ~1 ms (``cpu_work``), sleeps 4 ms (``sleep_wait``), reads a socket
answered 4 ms later (``recv_wait``) and takes a lock held half of the time
(``lock_wait``); it prints the wall seconds each function took.  For each tool
the table gives each function's share of the four functions' total, the
median over the runs (tools alternate, flamed first), and the largest
difference from the program's own figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKLOAD = ROOT / "tests" / "workloads" / "requests_wait.py"
FUNCTIONS = ("cpu_work", "sleep_wait", "recv_wait", "lock_wait")


def shares_of_folded(text: str) -> dict[str, float]:
    """Each function's share of the four, from folded text (innermost of them per stack)."""
    got = dict.fromkeys(FUNCTIONS, 0.0)
    for line in text.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        for f in reversed(frames):
            name = f.split(" (", 1)[0]
            if name in got:
                got[name] += int(n)
                break
    total = sum(got.values())
    return {k: (v / total if total else 0.0) for k, v in got.items()}


def shares_of_truth(stdout: str) -> dict[str, float]:
    line = next(ln for ln in reversed(stdout.splitlines()) if ln.startswith('{"wall_s"'))
    spent = json.loads(line)["wall_s"]
    total = sum(spent.get(k, 0.0) for k in FUNCTIONS)
    return {k: spent.get(k, 0.0) / total for k in FUNCTIONS}


def run_flamed(py: str, seconds: float, tmp: Path) -> tuple[dict[str, float], dict[str, float]]:
    out = tmp / "flamed.folded"
    r = subprocess.run([sys.executable, "-m", "flamed", "record", "--mode", "wall", "-o", str(out), "--",
                        py, str(WORKLOAD), str(seconds)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    if r.returncode != 0:
        raise SystemExit(f"flamed record failed: {r.stderr}")
    return shares_of_folded(out.read_text()), shares_of_truth(r.stdout)


def run_pyspy(pyspy: str, py: str, seconds: float, tmp: Path) -> tuple[dict[str, float], dict[str, float]]:
    out = tmp / "pyspy.folded"
    r = subprocess.run([pyspy, "record", "--idle", "--format", "raw", "--rate", "100", "-o", str(out), "--",
                        py, str(WORKLOAD), str(seconds)], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise SystemExit(f"py-spy record failed: {r.stderr}")
    return shares_of_folded(out.read_text()), shares_of_truth(r.stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--python", default=shutil.which("python3") or sys.executable)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench/wall_vs_pyspy.py: needs root (BPF, py-spy attaching)", file=sys.stderr)
        return 2
    pyspy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if pyspy is None:
        print("bench/wall_vs_pyspy.py: py-spy not found", file=sys.stderr)
        return 2
    results: dict[str, list[tuple[dict[str, float], dict[str, float]]]] = {"flamed": [], "py-spy": []}
    with tempfile.TemporaryDirectory(prefix="flamed-wall-") as t:
        tmp = Path(t)
        for i in range(args.runs):
            results["flamed"].append(run_flamed(args.python, args.seconds, tmp))
            results["py-spy"].append(run_pyspy(pyspy, args.python, args.seconds, tmp))
            print(f"run {i + 1}/{args.runs} done", file=sys.stderr)
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    print(f"wall-clock shares of the four functions, {args.runs} runs of {args.seconds:g} s, {args.python}, "
          f"commit {rev}, load {os.getloadavg()[0]:.1f}")
    print(f"{'tool':8s} " + " ".join(f"{f:>11s}" for f in FUNCTIONS) + "  max |error|")
    for tool, runs in results.items():
        med = {f: statistics.median(r[0][f] for r in runs) for f in FUNCTIONS}
        truth = {f: statistics.median(r[1][f] for r in runs) for f in FUNCTIONS}
        err = max(abs(r[0][f] - r[1][f]) for r in runs for f in FUNCTIONS)
        print(f"{tool:8s} " + " ".join(f"{med[f]:11.3f}" for f in FUNCTIONS) + f"  {err:.3f}")
        print(f"{'  truth':8s} " + " ".join(f"{truth[f]:11.3f}" for f in FUNCTIONS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
