#!/usr/bin/env python3
"""Cost of off-CPU profiling (bpf/offcpu.bpf.c) at 1 k, 10 k and 50 k context
switches per second.  Run as root from the worktree:

    sudo .venv/bin/python bench/offcpu.py [--seconds 5] [--rates 1000,10000,50000]

The workload is a ping-pong of two processes over a pair of pipes, paced to
the wanted number of context switches per second (both processes together,
counted from their /proc/PID/status; the achieved rate is printed).  For each
rate, a BpfSampler in this process (99 Hz CPU sampling, pid filter on the two
processes) runs in these cases:

* ``off``: offcpu=False (the CPU sampler alone);
* ``selected``: offcpu=True, the ping-pong selected: every switch of it takes
  its stacks at switch-out (its waits are shorter than the 1 ms default
  threshold, so they are counted as OFF_BELOW only);
* ``selected-0``: the same with min_block_us=0: every wait counted;
* ``selected-every4``: the same with offcpu_every=4: one switch-out in 4
  remembered (at random), its wait counted 4 times;
* ``unselected``: offcpu=True but the pid filter names another process: what
  every other switch on the host costs (one map lookup, the filter).

Every run of flamed_offcpu is counted, on all switches of the host (the
``ns/run`` column), so on a busy shared host the ``unselected`` figure
includes everyone else's switches.

Figures: the BPF run time of flamed_offcpu and of flamed_sample (read from
the programs' fdinfo; run-time statistics on for the run through
BPF_ENABLE_STATS, whose fd keeps them on whatever another tool writes to
kernel.bpf_stats_enabled meanwhile), as % of one core, and the CPU time of
this process (its drains) as % of one core.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BPF_STATS_RUN_TIME = 0

PINGPONG = r"""
import os, sys, time
rate = float(sys.argv[1]); seconds = float(sys.argv[2])
a_r, b_w = os.pipe(); b_r, a_w = os.pipe()
pid = os.fork()
if pid == 0:
    while os.read(a_r, 1) == b"p":
        os.write(a_w, b"p")
    os._exit(0)
print(pid, flush=True)
# One round trip: about two switches per process.
trips = rate / 4.0
t0 = time.monotonic(); n = 0
while True:
    now = time.monotonic() - t0
    if now >= seconds:
        break
    due = int(now * trips) + 1
    while n < due:
        os.write(b_w, b"p"); os.read(b_r, 1); n += 1
    time.sleep(0.001)
os.write(b_w, b"q"); os.waitpid(pid, 0)
"""


def switches(pid: int) -> int:
    n = 0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                n += int(line.split()[1])
    except OSError:
        pass
    return n


def prog_time(fd: int) -> tuple[int, int]:
    ns = cnt = 0
    for line in Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines():
        if line.startswith("run_time_ns:"):
            ns = int(line.split()[1])
        elif line.startswith("run_cnt:"):
            cnt = int(line.split()[1])
    return ns, cnt


def case(name: str, rate: int, seconds: float, bpf_dir: Path | None = None) -> dict[str, Any]:
    from flamed.sampling.bpf import BpfSampler, BpfSamplerOptions

    offcpu = name != "off"
    every = int(name.removeprefix("selected-every")) if name.startswith("selected-every") else 1
    s = BpfSampler(BpfSamplerOptions(frequency=99, pids=frozenset(), offcpu=offcpu, offcpu_every=every,
                                     offcpu_min_us=0 if name == "selected-0" else 1000, bpf_dir=bpf_dir))
    s.start()
    try:
        funcs = s._program.bpf.funcs
        fds = {n: funcs[n.encode()].fd for n in ("flamed_sample", "flamed_offcpu") if n.encode() in funcs}
        child = subprocess.Popen([sys.executable, "-c", PINGPONG, str(rate), str(seconds + 1)],
                                 stdout=subprocess.PIPE, text=True)
        assert child.stdout is not None
        peer = int(child.stdout.readline())
        if name == "unselected":
            s.add_pid(os.getppid())  # an idle process: the ping-pong is not selected
        else:
            s.add_pid(child.pid)
            s.add_pid(peer)
        time.sleep(0.5)
        s.drain()
        sw0 = switches(child.pid) + switches(peer)
        p0 = {n: prog_time(fd) for n, fd in fds.items()}
        c0, t0 = os.times(), time.monotonic()
        end = t0 + seconds
        while time.monotonic() < end:
            time.sleep(0.5)
            s.drain()
        t1, c1 = time.monotonic(), os.times()
        p1 = {n: prog_time(fd) for n, fd in fds.items()}
        sw1 = switches(child.pid) + switches(peer)
        child.wait(30)
        st = s.stats().offcpu_total
    finally:
        s.close()
    wall = t1 - t0
    out: dict[str, Any] = {"case": name, "rate": rate, "switches_s": (sw1 - sw0) / wall,
                           "self_cpu_pct": 100 * ((c1.user - c0.user) + (c1.system - c0.system)) / wall}
    for n in fds:
        out[f"{n}_pct"] = 100 * (p1[n][0] - p0[n][0]) / 1e9 / wall
        runs = p1[n][1] - p0[n][1]
        out[f"{n}_ns_per_run"] = (p1[n][0] - p0[n][0]) / runs if runs else 0.0
    out["recorded"] = st["OFF_STARTS"]
    out["below"] = st["OFF_BELOW"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rates", default="1000,10000,50000")
    ap.add_argument("--cases", default="off,unselected,selected,selected-0,selected-every4")
    ap.add_argument("--bpf-dir", type=Path, default=None, help="another bpf/ directory (ablations)")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import ctypes as ct

    from bcc.libbcc import lib

    enable = lib.bpf_enable_stats
    enable.argtypes, enable.restype = [ct.c_int], ct.c_int
    stats_fd = enable(BPF_STATS_RUN_TIME)
    if stats_fd < 0:
        raise SystemExit("BPF_ENABLE_STATS refused: run as root on a kernel >= 5.8")
    try:
        print(f"load average at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
        print(f"{'rate':>6} {'case':<16} {'switch/s':>9} {'offcpu %core':>12} {'ns/run':>7} "
              f"{'sample %core':>12} {'drain %core':>11} {'recorded':>9} {'below':>8}")
        for rate in (int(r) for r in args.rates.split(",")):
            for name in args.cases.split(","):
                r = case(name, rate, args.seconds, args.bpf_dir)
                print(f"{rate:>6} {name:<16} {r['switches_s']:>9.0f} {r.get('flamed_offcpu_pct', 0.0):>12.3f} "
                      f"{r.get('flamed_offcpu_ns_per_run', 0.0):>7.0f} {r['flamed_sample_pct']:>12.3f} "
                      f"{r['self_cpu_pct']:>11.2f} {r['recorded']:>9} {r['below']:>8}", flush=True)
    finally:
        os.close(stats_fd)


if __name__ == "__main__":
    main()
