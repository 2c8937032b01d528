#!/usr/bin/env python3
"""The daemon's fixed cost on an idle host: CPU and wakeups per thread.

Per rate, the daemon runs with packaging/flamed.dev.toml (mixed mode as
configured there) and a private state directory, socket and metrics port.
Once it has started (socket present, then a settling pause past the bcc
compile), the script reads utime+stime of every thread (/proc/PID/task/*/stat)
and its voluntary and involuntary context switches (/proc/PID/task/*/status)
at the start and end of SECONDS, and prints CPU % of a core and wakeups per
second (voluntary switches: each one is a block that later woke) per thread
name.  Nothing else is started; run it on a host where nothing else runs, or
read the load average it prints.  Before/after figures come from two runs on
two commits.

    sudo .venv/bin/python bench/idle_cost.py [--seconds 60] [--rates "19 99"]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TICK = os.sysconf("SC_CLK_TCK")


def threads(pid: int) -> dict[int, tuple[str, float, int, int]]:
    """tid -> (name, CPU seconds, voluntary, involuntary context switches)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except OSError:
            continue  # the thread ended between listdir and read
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        f = stat.rsplit(")", 1)[1].split()
        kv = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        out[int(tid)] = (name, (int(f[11]) + int(f[12])) / TICK,
                         int(kv["voluntary_ctxt_switches"]), int(kv["nonvoluntary_ctxt_switches"]))
    return out


def thread_names(pid: int) -> dict[int, str]:
    """tid -> Python thread name, from ``py-spy dump`` (every thread's comm is "python")."""
    spy = shutil.which("py-spy") or str(ROOT / ".venv" / "bin" / "py-spy")
    try:
        out = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return {int(m[1]): m[2] for m in re.finditer(r'^Thread (\d+) \([^)]*\): "([^"]*)"', out, re.M)}


def measure(tmp: Path, rate: int, seconds: float, settle: float) -> list[tuple[object, ...]]:
    sock = tmp / f"flamed-{rate}.sock"
    log = open(tmp / f"daemon-{rate}.log", "a")
    d = subprocess.Popen([str(ROOT / ".venv" / "bin" / "python"), "-m", "flamed", "daemon",
                          "--config", str(ROOT / "packaging" / "flamed.dev.toml"),
                          "--state-dir", str(tmp / f"profiles-{rate}"), "--socket", str(sock),
                          "--metrics-address", "127.0.0.1:0", "--frequency", str(rate)],
                         stderr=log, stdout=log, cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while not sock.exists():
            if d.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"daemon did not start; see {tmp}/daemon-{rate}.log")
            time.sleep(0.2)
        time.sleep(settle)  # past start-up (bcc compile, first scans), which is not the fixed cost
        t0, a = time.monotonic(), threads(d.pid)
        time.sleep(seconds)
        t1, b = time.monotonic(), threads(d.pid)
        names = thread_names(d.pid)
    finally:
        d.send_signal(signal.SIGTERM)
        try:
            d.wait(timeout=60)
        except subprocess.TimeoutExpired:
            d.kill()
            d.wait()
        log.close()
    el = t1 - t0
    per: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0, 0])
    for tid, (comm, cpu, vol, inv) in b.items():
        name = names.get(tid, comm)
        _, cpu0, vol0, inv0 = a.get(tid, (comm, 0.0, 0, 0))  # a thread started during the run counts whole
        row = per[name]
        row[0] += 1
        row[1] += cpu - cpu0
        row[2] += vol - vol0
        row[3] += inv - inv0
    rows: list[tuple[object, ...]] = []
    for name, (n, cpu, vol, inv) in sorted(per.items(), key=lambda kv: -kv[1][2]):
        rows.append((rate, name if n == 1 else f"{name} (x{n:g})", f"{100 * cpu / el:.3f}",
                     f"{vol / el:.1f}", f"{inv / el:.1f}"))
    tot_cpu = sum(r[1] for r in per.values())
    tot_vol = sum(r[2] for r in per.values())
    tot_inv = sum(r[3] for r in per.values())
    rows.append((rate, "**all threads**", f"{100 * tot_cpu / el:.3f}", f"{tot_vol / el:.1f}", f"{tot_inv / el:.1f}"))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--rates", default="19 99")
    ap.add_argument("--settle", type=float, default=5.0, help="seconds after start-up before measuring")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench/idle_cost.py: needs root (BPF)", file=sys.stderr)
        return 1
    rows: list[tuple[object, ...]] = []
    with tempfile.TemporaryDirectory(prefix="flamed-idle-") as t:
        for rate in [int(r) for r in args.rates.split()]:
            rows += measure(Path(t), rate, args.seconds, args.settle)
    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True).stdout.strip()
    print(f"flamed daemon idle cost, {args.seconds:g} s per rate, commit {rev}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    hdr = ("rate Hz", "thread", "CPU %core", "wakeups/s", "involuntary/s")
    print(" | ".join(hdr))
    print(" | ".join("---" for _ in hdr))
    for r in rows:
        print(" | ".join(str(x) for x in r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
