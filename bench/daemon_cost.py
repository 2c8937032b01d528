#!/usr/bin/env python3
"""The daemon's cost while a fixed CPU-bound workload runs (driven by bench/daemon.sh).

Per rate, two measurements.  Cost: the workload (a C loop doing a fixed
amount of work, one copy per CPU, so every CPU is busy and sampled) runs for
SECONDS with the daemon sampling at that rate (defaults otherwise: drain every
10 s, a file per 60 s; mixed mode off, to measure the daemon itself).  Daemon
CPU is utime+stime of its process from /proc/PID/stat over that period; BPF
time is the delta of run_time_ns of this daemon's programs (``bpftool prog
show``, with kernel.bpf_stats_enabled=1, restored afterwards); RSS is VmRSS at
the end and VmHWM (peak).  "daemon+BPF % of all CPUs" is the share of the
machine's CPU time they took from the workload: the slowdown they can cause.

Slowdown: ``--pairs`` times, one batch without the daemon, then the daemon
started and one batch with it; the median and range of the per-pair ratios
of the workload's CPU time (wait4 rusage) and wall time.  The machine may be
shared: the load average is printed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK_C = r"""
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static volatile unsigned long sink;
__attribute__((noinline)) void work(unsigned long n) { for (unsigned long i = 0; i < n; i++) sink += i * i; }
int main(int argc, char **argv) {
    unsigned long n = strtoul(argv[1], 0, 10);
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    work(n);
    clock_gettime(CLOCK_MONOTONIC, &b);
    printf("%.6f\n", (b.tv_sec - a.tv_sec) + (b.tv_nsec - a.tv_nsec) / 1e9);
    return 0;
}
"""
TICK = os.sysconf("SC_CLK_TCK")


def build(tmp: Path) -> Path:
    src = tmp / "work.c"
    src.write_text(WORK_C)
    exe = tmp / "flamed_work"
    subprocess.run(["gcc", "-O1", "-fno-omit-frame-pointer", "-o", str(exe), str(src)], check=True)
    return exe


def run_batch(exe: Path, n: int, copies: int) -> list[tuple[float, float]]:
    """(wall seconds, CPU seconds) of each copy; CPU time (wait4 rusage) is what a
    loaded, shared machine distorts least: waiting for a CPU does not count."""
    procs = [subprocess.Popen([str(exe), str(n)], stdout=subprocess.PIPE, text=True) for _ in range(copies)]
    out = []
    for p in procs:
        assert p.stdout is not None
        wall = float(p.stdout.read())
        _, _, ru = os.wait4(p.pid, 0)
        p.returncode = 0
        out.append((wall, ru.ru_utime + ru.ru_stime))
    return out


def calibrate(exe: Path, target: float) -> int:
    n = 50_000_000
    t = run_batch(exe, n, 1)[0][1]
    return max(1, int(n * target / t))


def proc_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def proc_mem(pid: int) -> tuple[int, int, int]:
    """VmRSS, RssAnon (the daemon's own memory; the rest is mostly libLLVM/libclang code) and VmHWM."""
    kv = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = line.partition(":")
        kv[k] = v.strip()
    return tuple(int(kv[k].split()[0]) * 1024 for k in ("VmRSS", "RssAnon", "VmHWM"))  # type: ignore[return-value]


def held(pid: int, kind: str = "bpf-prog", key: str = "prog_id:") -> set[int]:
    """Ids of the BPF objects (``bpf-prog``: programs, ``bpf-map`` with key
    ``map_id:``: maps) whose fds ``pid`` holds (other flamed daemons may run too)."""
    ids = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") != f"anon_inode:{kind}":
                continue
            for line in Path(f"/proc/{pid}/fdinfo/{fd}").read_text().splitlines():
                if line.startswith(key):
                    ids.add(int(line.split()[1]))
        except OSError:
            continue
    return ids


def prog_ids(pid: int) -> set[int]:
    """Ids of the BPF programs ``pid`` holds."""
    return held(pid)


def bpf_runtime(ids: set[int]) -> tuple[int, int]:
    out = subprocess.run(["bpftool", "-j", "prog", "show"], capture_output=True, text=True, check=True).stdout
    ns = cnt = 0
    for prog in json.loads(out):
        if prog.get("id") in ids:
            ns += int(prog.get("run_time_ns", 0))
            cnt += int(prog.get("run_cnt", 0))
    return ns, cnt


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--rates", default="19 99")
    ap.add_argument("--run-seconds", type=float, default=5.0, help="length of one workload run")
    ap.add_argument("--pairs", type=int, default=6, help="(without, with) pairs for the slowdown")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench/daemon.sh: needs root (BPF)", file=sys.stderr)
        return 1
    for tool in ("gcc", "bpftool"):
        if shutil.which(tool) is None:
            print(f"bench/daemon.sh: {tool} missing (packaging/setup.sh --test)", file=sys.stderr)
            return 1
    copies = os.cpu_count() or 1
    old_stats = Path("/proc/sys/kernel/bpf_stats_enabled").read_text().strip()
    rows, slow = [], []
    with tempfile.TemporaryDirectory(prefix="flamed-bench-") as t:
        tmp = Path(t)
        exe = build(tmp)
        n = calibrate(exe, args.run_seconds)
        Path("/proc/sys/kernel/bpf_stats_enabled").write_text("1")
        try:
            for rate in [int(r) for r in args.rates.split()]:
                rows.append(measure(tmp, exe, n, copies, rate, args.seconds))
                slow.append(slowdown(tmp, exe, n, copies, rate, args.pairs))
        finally:
            Path("/proc/sys/kernel/bpf_stats_enabled").write_text(old_stats)
    print()
    print(f"flamed daemon cost, {args.seconds:g} s per rate, {copies} CPUs, workload: {copies} x fixed C loop "
          f"(~{args.run_seconds:g} s per run), load average {os.getloadavg()[0]:.2f}")
    hdr = ("rate Hz", "daemon CPU %core", "BPF %core", "BPF ns/run", "BPF runs",
           "daemon+BPF % of all CPUs", "RSS MB", "anon RSS MB", "peak RSS MB")
    table(hdr, rows)
    print()
    print("workload slowdown with the daemon, per (without, with) pair of batches; median and range")
    table(("rate Hz", "pairs", "CPU time %", "CPU range", "wall %", "wall range"), slow)
    return 0


@contextlib.contextmanager
def running_daemon(tmp: Path, rate: int) -> Iterator[subprocess.Popen[bytes]]:
    """The daemon at ``rate`` Hz (default config otherwise, mixed mode off), until the block ends."""
    cfg = tmp / f"bench-{rate}.toml"
    sock = tmp / f"flamed-{rate}.sock"
    cfg.write_text(f"""
[sampling]
frequency = {rate}
[output]
state_dir = "{tmp / f'profiles-{rate}'}"
[metrics]
address = "127.0.0.1:0"
[control]
socket = "{sock}"
[log]
target = "stderr"
[processors.python]
enabled = false
""")
    log = open(tmp / f"daemon-{rate}.log", "a")
    d = subprocess.Popen([str(ROOT / ".venv" / "bin" / "python"), "-m", "flamed", "daemon", "--config", str(cfg)],
                         stderr=log, cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while not sock.exists():
            if d.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"daemon did not start; see {tmp}/daemon-{rate}.log")
            time.sleep(0.2)
        time.sleep(1.0)  # past start-up (bcc compile), which is not steady-state cost
        yield d
    finally:
        d.send_signal(signal.SIGTERM)
        try:
            d.wait(timeout=60)
        except subprocess.TimeoutExpired:
            d.kill()
            d.wait()
        log.close()


def table(hdr: tuple[str, ...], rows: list[tuple[object, ...]]) -> None:
    print(" | ".join(hdr))
    print(" | ".join("---" for _ in hdr))
    for r in rows:
        print(" | ".join(str(x) for x in r))


def measure(tmp: Path, exe: Path, n: int, copies: int, rate: int, seconds: float) -> tuple[object, ...]:
    with running_daemon(tmp, rate) as d:
        ids = prog_ids(d.pid)
        if not ids:
            raise SystemExit("the daemon holds no BPF program")
        cpu0, (bpf0, cnt0), t0 = proc_cpu(d.pid), bpf_runtime(ids), time.monotonic()
        runs = 0
        while time.monotonic() - t0 < seconds:
            run_batch(exe, n, copies)
            runs += 1
        cpu1, (bpf1, cnt1), t1 = proc_cpu(d.pid), bpf_runtime(ids), time.monotonic()
        rss, anon, hwm = proc_mem(d.pid)
    el = t1 - t0
    daemon_core = (cpu1 - cpu0) / el
    bpf_core = (bpf1 - bpf0) / 1e9 / el
    return (rate, f"{100 * daemon_core:.2f}", f"{100 * bpf_core:.3f}",
            f"{(bpf1 - bpf0) / max(1, cnt1 - cnt0):.0f}", cnt1 - cnt0,
            f"{100 * (daemon_core + bpf_core) / copies:.2f}",
            f"{rss / 2**20:.0f}", f"{anon / 2**20:.0f}", f"{hwm / 2**20:.0f}")


def slowdown(tmp: Path, exe: Path, n: int, copies: int, rate: int, pairs: int) -> tuple[object, ...]:
    """``pairs`` back-to-back (without, with) batches, the daemon started for each "with".

    Pairing adjacent runs cancels the slow drift of a VM's CPU speed, which
    is larger than the effect; the spread of the per-pair ratios says how far
    the median can be trusted.
    """
    cpu_r, wall_r = [], []
    for _ in range(pairs):
        base = run_batch(exe, n, copies)
        with running_daemon(tmp, rate):
            with_d = run_batch(exe, n, copies)
        bc, wc = statistics.mean(x[1] for x in base), statistics.mean(x[1] for x in with_d)
        bw, ww = statistics.mean(x[0] for x in base), statistics.mean(x[0] for x in with_d)
        cpu_r.append(100 * (wc / bc - 1))
        wall_r.append(100 * (ww / bw - 1))
    return (rate, pairs, f"{statistics.median(cpu_r):+.2f}", f"{min(cpu_r):+.2f} .. {max(cpu_r):+.2f}",
            f"{statistics.median(wall_r):+.2f}", f"{min(wall_r):+.2f} .. {max(wall_r):+.2f}")


if __name__ == "__main__":
    sys.exit(main())
