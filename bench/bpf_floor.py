#!/usr/bin/env python3
"""What the parts of a sample cost on this host, as the kernel counts them.

    sudo .venv/bin/python bench/bpf_floor.py [--seconds 4] [--repeat 3] [--parts empty,ustack,...]

bench/bpf_cost.py gives flamed's program per kind of sample; this gives the
floor under it: tiny perf-event programs, each doing one thing a sample does,
attached at 999 Hz on every CPU while two processes keep both CPUs busy
sweeping 32 MB arrays (so that, as in a real sample, the program finds its
data cold: the machine ran something else for a millisecond in between).
Each part's run time per run comes from kernel.bpf_stats_enabled (run time /
run count in the program's fdinfo), like bpf_cost.py.  Every program also
has the common prologue (the idle task turned away) and epilogue (a per-CPU
counter), so ``empty`` is the cost of running any program at all, and a
part's own cost is its row minus ``empty``.

  empty         nothing more
  identity      pid/tgid, comm and cgroup id (what every sample reads first)
  hash-miss     one lookup that misses in a hash map (flamed: watched, pyprocs, ...)
  hash-miss-4   four such lookups in four maps
  clock-2       two bpf_ktime_get_ns() (timing a part costs this)
  read-user     one 64-byte bpf_probe_read_user at the user stack pointer
  read-user-4   four of them, 512 bytes apart
  read-user-2k  one 2 KiB read (flamed's windows: frames, stack)
  ustack        bpf_get_stackid() of the user stack (the frame-pointer walk
                of a sample without unwinding)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

STATS = Path("/proc/sys/kernel/bpf_stats_enabled")

PARTS = {
    "empty": "",
    "identity": "u64 id = bpf_get_current_pid_tgid(); char c[16]; bpf_get_current_comm(&c, 16); "
                "acc += id + c[0] + bpf_get_current_cgroup_id();",
    "hash-miss": "u32 k = bpf_get_current_pid_tgid() >> 32; if (h1.lookup(&k)) acc++;",
    "hash-miss-4": "u32 k = bpf_get_current_pid_tgid() >> 32; if (h1.lookup(&k)) acc++; if (h2.lookup(&k)) acc++; "
                   "if (h3.lookup(&k)) acc++; if (h4.lookup(&k)) acc++;",
    "clock-2": "acc += bpf_ktime_get_ns(); acc += bpf_ktime_get_ns();",
    "read-user": "char b[64]; if (bpf_probe_read_user(b, 64, (void *)PT_REGS_SP(&ctx->regs)) == 0) acc += b[0];",
    "read-user-4": "char b[64]; u64 sp = PT_REGS_SP(&ctx->regs); "
                   "if (bpf_probe_read_user(b, 64, (void *)sp) == 0) acc += b[0]; "
                   "if (bpf_probe_read_user(b, 64, (void *)(sp + 512)) == 0) acc += b[1]; "
                   "if (bpf_probe_read_user(b, 64, (void *)(sp + 1024)) == 0) acc += b[2]; "
                   "if (bpf_probe_read_user(b, 64, (void *)(sp + 1536)) == 0) acc += b[3];",
    "read-user-2k": "u32 z = 0; struct big *b = scratch.lookup(&z); "
                    "if (b && bpf_probe_read_user(b->b, 2048, (void *)PT_REGS_SP(&ctx->regs)) == 0) acc += b->b[0];",
    "ustack": "acc += st.get_stackid(ctx, BPF_F_USER_STACK);",
}

TEXT = r"""
#include <uapi/linux/ptrace.h>
struct bpf_perf_event_data { struct pt_regs regs; __u64 sample_period; __u64 addr; };
struct big { char b[2048]; };
BPF_HASH(h1, u32, u64, 4096);
BPF_HASH(h2, u32, u64, 4096);
BPF_HASH(h3, u32, u64, 4096);
BPF_HASH(h4, u32, u64, 4096);
BPF_PERCPU_ARRAY(scratch, struct big, 1);
BPF_PERCPU_ARRAY(out, u64, 1);
BPF_STACK_TRACE(st, 4096);
int part(struct bpf_perf_event_data *ctx)
{
    u64 acc = 0;
    if ((u32)bpf_get_current_pid_tgid() == 0)
        return 0;
    BODY
    u32 zero = 0;
    u64 *o = out.lookup(&zero);
    if (o)
        *o += acc;
    return 0;
}
"""

#: Sweeps a 32 MB array with a stride of a cache line and a half: the CPU's caches hold the workload's data.
WORKLOAD = """
import array, sys, time
a = array.array("q", bytes(32 << 20))
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    s = 0
    for i in range(0, len(a), 13):
        s += a[i]
"""


def run_stats(fd: int) -> tuple[int, int]:
    info = dict(line.split(":\t", 1) for line in Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines()
                if ":\t" in line)
    return int(info.get("run_time_ns", "0")), int(info.get("run_cnt", "0"))


def measure(bcc: object, name: str, seconds: float) -> float:
    b = bcc.BPF(text=TEXT.replace("BODY", PARTS[name]))  # type: ignore[attr-defined]
    try:
        fd = b.load_func("part", bcc.BPF.PERF_EVENT).fd  # type: ignore[attr-defined]
        b.attach_perf_event(ev_type=bcc.PerfType.SOFTWARE, ev_config=bcc.PerfSWConfig.CPU_CLOCK,  # type: ignore[attr-defined]
                            fn_name="part", sample_freq=999)
        time.sleep(0.5)
        ns0, n0 = run_stats(fd)
        time.sleep(seconds)
        ns1, n1 = run_stats(fd)
    finally:
        b.cleanup()
    return (ns1 - ns0) / max(1, n1 - n0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--parts", default=",".join(PARTS))
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root (BPF, perf events, kernel.bpf_stats_enabled)")
    import bcc  # noqa: PLC0415 - Debian's python3-bpfcc, root only

    parts = [p for p in args.parts.split(",") if p]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise SystemExit(f"unknown parts: {', '.join(unknown)} (known: {', '.join(PARTS)})")
    total = (args.seconds + 1.5) * args.repeat * len(parts) + 30
    old = STATS.read_text()
    load = os.getloadavg()[0]
    work = [subprocess.Popen([sys.executable, "-c", WORKLOAD, f"{total:g}"]) for _ in range(os.cpu_count() or 2)]
    res: dict[str, list[float]] = {}
    try:
        STATS.write_text("1\n")
        time.sleep(1.0)
        for _ in range(args.repeat):
            for p in parts:
                res.setdefault(p, []).append(measure(bcc, p, args.seconds))
    finally:
        STATS.write_text(old)
        for w in work:
            w.kill()
            w.wait(timeout=10)
    print(f"load average at start: {load:.2f}; {os.cpu_count()} CPUs; 999 Hz, {args.seconds:g} s per run, "
          f"{args.repeat} runs, medians (min-max)\n")
    base = statistics.median(res["empty"]) if "empty" in res else 0.0
    rows = [("part", "ns per run", "minus empty")]
    for p in parts:
        m = statistics.median(res[p])
        rows.append((p, f"{m:.0f} ({min(res[p]):.0f}-{max(res[p]):.0f})",
                     "-" if p == "empty" or "empty" not in res else f"{m - base:+.0f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for j, r in enumerate(rows):
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
        if j == 0:
            print("  ".join("-" * w for w in widths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
