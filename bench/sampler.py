#!/usr/bin/env python3
"""Benchmark of flamed's BPF sampler (root, bcc, gcc).

Part A -- drain + symbolize of >= 100,000 unique stacks: four copies of
tests/workloads/busy.c in ``paths`` mode (random recursion, up to 2^26
distinct stacks) sampled at 999 Hz on every CPU into a large stack map for
``--unique-seconds``; the workloads are SIGSTOPped (alive, so /proc still
has their maps, but off the CPU) and one drain is timed, wall and CPU.  The
first window runs with cold symbol caches, the second with warm ones.

Part B -- cost while sampling at 19 and 99 Hz, the daemon's drain interval
scaled down: two ``busy`` workloads keep both CPUs busy for ``--rate-seconds``
per rate, with a drain every ``--drain-interval`` s.  Sampler CPU is this
process's user+sys time; BPF time is the program's run_time_ns from
``bpftool prog show`` with ``kernel.bpf_stats_enabled=1`` (restored after).

The peer, in the same run and on the same workloads: bcc's
``profile-bpfcc -f -a`` (Debian bpfcc-tools).  In part A it samples for the
same time, then SIGINT makes it read, symbolize and print everything; its
"drain" is the time from the SIGINT to its exit, CPU from /proc and wait4.
It counts in a hash of bcc's default 10240 entries, so it keeps far fewer
stacks: compare the time per stack.  In part B its program's run time is
measured the same way (it does nothing in user space while sampling).

    sudo .venv/bin/python bench/sampler.py [--unique-seconds 70] [--rate-seconds 30]

The machine is shared: the table prints the load average next to the figures.
Wall times include waiting for the CPU; the CPU column is what flamed used.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flamed.sampling.bpf import BpfSampler, BpfSamplerOptions  # noqa: E402


def build(tmp: Path) -> Path:
    out = tmp / "flamed_busy"
    subprocess.run(["gcc", "-O0", "-g", "-fno-omit-frame-pointer", "-o", str(out),
                    str(ROOT / "tests" / "workloads" / "busy.c")], check=True)
    return out


@contextmanager
def workloads(argv: list[str], n: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    ps = [subprocess.Popen(argv, stdout=subprocess.DEVNULL) for _ in range(n)]
    try:
        yield ps
    finally:
        for p in ps:
            p.kill()
        for p in ps:
            p.wait(timeout=10)


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


def prog_id(fd: int) -> int:
    for line in Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines():
        if line.startswith("prog_id:"):
            return int(line.split()[1])
    raise RuntimeError("no prog_id in fdinfo")


def prog_runtime(pid: int) -> tuple[int, int]:
    """(run_time_ns, run_cnt) of BPF program ``pid``."""
    out = subprocess.run(["bpftool", "-j", "prog", "show", "id", str(pid)], check=True,
                         capture_output=True, text=True).stdout
    d = json.loads(out)
    return int(d.get("run_time_ns", 0)), int(d.get("run_cnt", 0))


PEER = "/usr/sbin/profile-bpfcc"


def _prog_fds(pid: int) -> list[int]:
    """Ids of the perf-event BPF programs process ``pid`` holds."""
    ids = []
    for fd in Path(f"/proc/{pid}/fdinfo").iterdir():
        try:
            text = fd.read_text()
        except OSError:
            continue
        if "prog_type:\t7\n" in text:  # BPF_PROG_TYPE_PERF_EVENT
            ids += [int(ln.split()[1]) for ln in text.splitlines() if ln.startswith("prog_id:")]
    return ids


def _proc_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextmanager
def peer(args: list[str], out: Path) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """profile-bpfcc running with its program attached: (process, prog id)."""
    with open(out, "wb") as f:
        p = subprocess.Popen([PEER, *args], stdout=f, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        ids: list[int] = []
        while not ids and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.2)
            ids = _prog_fds(p.pid)
        if not ids:
            raise RuntimeError("profile-bpfcc did not attach")
        time.sleep(0.5)  # attach follows load
        yield p, ids[0]
    finally:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)


def peer_dump(binary: Path, seconds: float, tmp: Path) -> list[str]:
    out = tmp / "peer.folded"
    with workloads([str(binary), "paths", str(seconds + 120), "26"], 4) as ps, \
            peer(["-F", "999", "-f", "-a", "--stack-storage-size", "524288", "100000"], out) as (p, _id):
        time.sleep(seconds)
        for w in ps:
            w.send_signal(signal.SIGSTOP)
        load = loadavg()
        c0 = _proc_cpu(p.pid)
        t0 = time.perf_counter()
        p.send_signal(signal.SIGINT)
        _pid, _status, ru = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t0
        p.returncode = 0
        cpu = ru.ru_utime + ru.ru_stime - c0
    lines = [ln for ln in out.read_bytes().splitlines() if ln.strip()]
    samples = sum(int(ln.rsplit(b" ", 1)[1]) for ln in lines if ln.rsplit(b" ", 1)[-1].isdigit())
    return ["profile-bpfcc", f"{samples}", "-", "-", f"{len(lines)}", "-", "-", f"{wall:.2f}", f"{cpu:.2f}",
            "-", load]


def peer_rate(binary: Path, rate: int, seconds: float, tmp: Path) -> list[str]:
    with workloads([str(binary), "busy", str(seconds + 120)], 2), \
            peer(["-F", str(rate), "-f", "-a", "100000"], tmp / "peer-rate.folded") as (p, pid):
        r0, n0 = prog_runtime(pid)
        c0, t0 = _proc_cpu(p.pid), time.perf_counter()
        time.sleep(seconds)
        wall, cpu = time.perf_counter() - t0, _proc_cpu(p.pid) - c0
        r1, n1 = prog_runtime(pid)
    runs = n1 - n0
    return [f"{rate}", "profile-bpfcc", f"{runs}", f"{runs / wall:.0f}", f"{100 * cpu / wall:.3f}",
            f"{100 * (r1 - r0) / 1e9 / wall:.3f}", f"{(r1 - r0) / runs:.0f}" if runs else "-", "-", loadavg()]


def part_a(binary: Path, seconds: float, windows: int, unwind: bool = False) -> list[list[str]]:
    rows = []
    opts = BpfSamplerOptions(frequency=999, stack_storage_size=524288, stack_depth=48, max_entries=262144,
                             unwind=unwind, unwind_depth=48, unwind_stack_entries=262144)
    with BpfSampler(opts) as s, workloads([str(binary), "paths", str(windows * (seconds + 30)), "26"], 4) as ps:
        s.drain()  # start clean, after the compile
        for i in range(windows):
            time.sleep(seconds)
            for p in ps:
                p.send_signal(signal.SIGSTOP)
            load = loadavg()
            c0, t0 = cpu_seconds(), time.perf_counter()
            w = s.drain()
            wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
            st = s.stats()
            for p in ps:
                p.send_signal(signal.SIGCONT)
            rows.append([
                ("flamed, cold" if i == 0 else "flamed, warm") + (", unwound" if unwind else ""), f"{w.samples}",
                f"{st.last_keys}", f"{st.last_stack_ids + st.last_unwound_stacks}",
                f"{len(w.counts)}", f"{st.last_drain_seconds - st.last_symbolize_seconds:.2f}",
                f"{st.last_symbolize_seconds:.2f}", f"{wall:.2f}", f"{cpu:.2f}",
                f"{w.lost['user_stack_eexist'] + w.lost['kernel_stack_eexist']}", load,
            ])
    return rows


def part_b(binary: Path, rate: int, seconds: float, drain_interval: float, unwind: bool = False) -> list[str]:
    with BpfSampler(BpfSamplerOptions(frequency=rate, unwind=unwind)) as s, \
            workloads([str(binary), "busy", str(seconds + 30)], 2):
        pid = prog_id(s._program.prog_fd)  # noqa: SLF001 -- the bench needs the program's id
        # Warm up: the first drain loads kallsyms and the symbols of every
        # process on the host; a daemon pays that once, not per window.
        time.sleep(drain_interval)
        s.drain()
        r0, n0 = prog_runtime(pid)
        c0, t0 = cpu_seconds(), time.perf_counter()
        drains: list[float] = []
        samples = 0
        end = t0 + seconds
        while True:
            time.sleep(max(0.0, min(drain_interval, end - time.perf_counter())))
            w = s.drain()
            samples += w.samples
            drains.append(s.stats().last_drain_seconds)
            if time.perf_counter() >= end:
                break
        wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
        r1, n1 = prog_runtime(pid)
    runs = n1 - n0
    bpf_ns = r1 - r0
    return [
        f"{rate}", f"flamed ({s.event})", f"{samples}", f"{samples / wall:.0f}",
        f"{100 * cpu / wall:.3f}", f"{100 * bpf_ns / 1e9 / wall:.3f}",
        f"{bpf_ns / runs:.0f}" if runs else "-", f"{max(drains) * 1000:.1f}", loadavg(),
    ]


def table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join([fmt.format(*head), fmt.format(*("-" * w for w in widths)), *(fmt.format(*r) for r in rows)])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--unique-seconds", type=float, default=70.0, help="sampling time per window of part A")
    ap.add_argument("--windows", type=int, default=2, help="windows of part A (first cold, then warm)")
    ap.add_argument("--rate-seconds", type=float, default=30.0, help="sampling time per rate of part B")
    ap.add_argument("--drain-interval", type=float, default=5.0)
    ap.add_argument("--skip-unique", action="store_true")
    ap.add_argument("--skip-rates", action="store_true")
    ap.add_argument("--no-peer", action="store_true", help="leave out bcc's profile-bpfcc")
    ap.add_argument("--unwind", action="store_true",
                    help="flamed's rows also with user stacks unwound from .eh_frame (bpf/unwind.bpf.c)")
    args = ap.parse_args()
    if os.geteuid() != 0 or shutil.which("gcc") is None or shutil.which("bpftool") is None:
        print("bench/sampler.py needs root, gcc and bpftool", file=sys.stderr)
        return 2
    print(f"# {os.cpu_count()} CPUs, kernel {os.uname().release}, load average {loadavg()}")
    with tempfile.TemporaryDirectory() as tmp:
        binary = build(Path(tmp))
        peer_ok = Path(PEER).exists() and not args.no_peer
        if not args.skip_unique:
            rows = part_a(binary, args.unique_seconds, args.windows)
            if args.unwind:
                rows += part_a(binary, args.unique_seconds, args.windows, unwind=True)
            if peer_ok:
                rows.append(peer_dump(binary, args.unique_seconds, Path(tmp)))
            print(f"\n## A. drain + symbolize, 999 Hz, {args.unique_seconds:.0f} s windows, 4 'paths' workloads")
            print(table(["sampler", "samples", "bpf keys", "stack ids", "stacks", "read s", "symbolize s",
                         "drain wall s", "drain cpu s", "eexist", "load"], rows))
        if not args.skip_rates:
            stats_path = Path("/proc/sys/kernel/bpf_stats_enabled")
            before = stats_path.read_text().strip()
            stats_path.write_text("1")
            try:
                rows = []
                for rate in (19, 99):
                    rows.append(part_b(binary, rate, args.rate_seconds, args.drain_interval))
                    if args.unwind:
                        row = part_b(binary, rate, args.rate_seconds, args.drain_interval, unwind=True)
                        rows.append([row[0], row[1] + ", unwound", *row[2:]])
                    if peer_ok:
                        rows.append(peer_rate(binary, rate, args.rate_seconds, Path(tmp)))
            finally:
                stats_path.write_text(before)
            print(f"\n## B. cost while sampling, {args.rate_seconds:.0f} s per rate, drain every "
                  f"{args.drain_interval:g} s, 2 busy workloads")
            print(table(["Hz", "sampler", "samples", "samples/s", "sampler cpu %", "bpf cpu %", "ns/run",
                         "max drain ms", "load"], rows))
            print("(% of one core; sampler cpu = this process's user+sys while sampling and draining)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
