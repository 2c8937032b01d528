#!/usr/bin/env python3
"""What unwinding native stacks from .eh_frame costs (root, bcc, gcc, bpftool).

Part A -- tables: for the largest binaries on the machine (libLLVM, CPython,
libstdc++, libc) the time to build the table from .eh_frame (median of
``--repeat``), its rows and FDEs, the bytes it takes on disk (the cache file)
and in the BPF map, and the time to read it back from the cache.

Part B -- the daemon, with ``[sampling] unwind`` off and on, at 19 and 99 Hz,
while a busy host runs: one copy per CPU of tests/workloads/unwind/chain.c
built -O2 -fomit-frame-pointer, plus a Python process (Debian's python3.11
when present) doing hashlib/zlib/json.  Per configuration over ``--seconds``:
daemon CPU (utime+stime from /proc), BPF CPU (run_time_ns of its programs
from ``bpftool prog show`` with kernel.bpf_stats_enabled=1; tail-called
programs are counted in the program that was entered), the memory of its
BPF maps (bytes_memlock from ``bpftool map show``), RSS, and the unwinder's
counters from the daemon's /metrics.  The peer is the same daemon without
unwinding, in the same run, interleaved.

Part C -- the other design, measured on the same workload in the same run:
copy the top of the user stack at each sample and unwind it in user space,
as `perf record --call-graph dwarf` (8 KiB per sample) then `perf script`
do.  Per rate: perf record's CPU, the bytes it writes per second, and the
CPU `perf script` takes to unwind and print what was recorded, per second
recorded.

    sudo .venv/bin/python bench/unwind.py [--seconds 30] [--rates "19 99"]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from daemon_cost import bpf_runtime, held, proc_cpu  # noqa: E402  (bench/daemon_cost.py)
from flamed.sampling.unwind import ehframe  # noqa: E402
from flamed.sampling.unwind.tables import TableCache  # noqa: E402

PY_WORK = (
    "import hashlib, json, time, zlib\n"
    "d = bytes(range(256)) * 2000\n"
    "end = time.time() + {secs}\n"
    "while time.time() < end:\n"
    "    hashlib.sha256(d * 4).digest(); zlib.compress(d, 6); json.dumps(list(range(2000)))\n"
)


def biggest_binaries() -> list[Path]:
    found = []
    for pattern in ("/usr/lib/x86_64-linux-gnu/libLLVM*.so.1", "/usr/lib/x86_64-linux-gnu/libstdc++.so.6",
                    "/usr/lib/x86_64-linux-gnu/libc.so.6", "/usr/bin/python3.11"):
        import glob

        for p in sorted(glob.glob(pattern)):
            rp = Path(p).resolve()
            if rp not in found:
                found.append(rp)
    pyenv = subprocess.run(["sh", "-c", "pyenv root 2>/dev/null"], capture_output=True, text=True).stdout.strip()
    if pyenv:
        for p in sorted(Path(pyenv, "versions").glob("3.1[23]*/lib/libpython3.1[23].so.1.0")):
            found.append(p.resolve())
    return found


def part_a(repeat: int) -> None:
    print("\n## A. unwind tables of the largest binaries (built from .eh_frame, cached by build id)\n")
    print("binary | size MB | FDEs | rows | build s (median) | cache file KB | BPF map KB | cache read ms")
    print("--- | --- | --- | --- | --- | --- | --- | ---")
    for path in biggest_binaries():
        info = ehframe.read_elf_info(str(path))
        times = []
        table = None
        for _ in range(repeat):
            t0 = time.perf_counter()
            table = ehframe.build_table(str(path), info)
            times.append(time.perf_counter() - t0)
        assert table is not None
        with tempfile.TemporaryDirectory() as d:
            TableCache(Path(d)).rows(str(path), info)
            f = next(Path(d).glob("*.uwt"))
            disk = f.stat().st_size
            reads = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                TableCache(Path(d)).rows(str(path), info)
                reads.append(time.perf_counter() - t0)
        rows = len(table.rows)
        print(f"{path.name} | {path.stat().st_size / 2**20:.1f} | {table.fdes} | {rows} | "
              f"{statistics.median(times):.2f} | {disk / 1024:.0f} | {rows * ehframe.ROW.size / 1024:.0f} | "
              f"{1000 * statistics.median(reads):.1f}")


# -- part B ------------------------------------------------------------------

def map_bytes(ids: set[int]) -> tuple[int, int]:
    """(all maps, the unwinder's maps) bytes_memlock."""
    out = subprocess.run(["bpftool", "-j", "map", "show"], capture_output=True, text=True, check=True).stdout
    total = uw = 0
    for m in json.loads(out):
        if m.get("id") in ids:
            b = int(m.get("bytes_memlock", 0))
            total += b
            if str(m.get("name", "")).startswith(("uw_", "ustacks")):
                uw += b
    return total, uw


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def metrics(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r'^(flamed_unwind_stacks_total)\{result="(\w+)"\} (\S+)', line)
        if m:
            out[m[2]] = float(m[3])
    return out


@contextlib.contextmanager
def daemon(tmp: Path, rate: int, unwind: bool, port: int) -> Iterator[subprocess.Popen[bytes]]:
    tag = f"{rate}-{int(unwind)}"
    cfg = tmp / f"bench-{tag}.toml"
    sock = tmp / f"flamed-{tag}.sock"
    cfg.write_text(f"""
[sampling]
frequency = {rate}
unwind = {"true" if unwind else "false"}
unwind_cache_dir = "{tmp / 'unwind'}"
[output]
state_dir = "{tmp / f'profiles-{tag}'}"
[metrics]
address = "127.0.0.1:{port}"
[control]
socket = "{sock}"
[log]
target = "stderr"
""")
    log = open(tmp / f"daemon-{tag}.log", "a")
    d = subprocess.Popen([str(ROOT / ".venv" / "bin" / "python"), "-m", "flamed", "daemon", "--config", str(cfg)],
                         stderr=log, cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while not sock.exists():
            if d.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"daemon did not start; see {tmp}/daemon-{tag}.log")
            time.sleep(0.2)
        time.sleep(12.0)  # past start-up and the first drain (tables of every running binary built)
        yield d
    finally:
        d.send_signal(signal.SIGTERM)
        try:
            d.wait(timeout=60)
        except subprocess.TimeoutExpired:
            d.kill()
            d.wait()
        log.close()


def measure(tmp: Path, rate: int, unwind: bool, seconds: float, port: int) -> list[str]:
    with daemon(tmp, rate, unwind, port) as d:
        progs = held(d.pid, "bpf-prog", "prog_id:")
        maps = held(d.pid, "bpf-map", "map_id:")
        m0 = metrics(port)
        cpu0, (b0, n0), t0 = proc_cpu(d.pid), bpf_runtime(progs), time.monotonic()
        time.sleep(seconds)
        cpu1, (b1, n1), t1 = proc_cpu(d.pid), bpf_runtime(progs), time.monotonic()
        time.sleep(11)  # one more drain for the counters
        m1 = metrics(port)
        mem_all, mem_uw = map_bytes(maps)
        r = rss(d.pid)
    el = t1 - t0
    stacks = {k: m1.get(k, 0) - m0.get(k, 0) for k in set(m0) | set(m1)}
    done = sum(stacks.values())
    complete = f"{100 * stacks.get('complete', 0) / done:.1f}" if done else "-"
    return [str(rate), "on" if unwind else "off", f"{100 * (cpu1 - cpu0) / el:.2f}", f"{100 * (b1 - b0) / 1e9 / el:.3f}",
            f"{(b1 - b0) / max(1, n1 - n0):.0f}", f"{100 * ((cpu1 - cpu0) + (b1 - b0) / 1e9) / el:.2f}",
            f"{mem_all / 2**20:.1f}", f"{mem_uw / 2**20:.1f}", f"{r / 2**20:.0f}", complete]


def part_b(seconds: float, rates: list[int], pairs: int) -> None:
    gcc = shutil.which("gcc")
    if gcc is None or shutil.which("bpftool") is None:
        raise SystemExit("bench/unwind.py: gcc and bpftool needed (packaging/setup.sh --test)")
    stats = Path("/proc/sys/kernel/bpf_stats_enabled")
    old = stats.read_text().strip()
    rows: list[list[str]] = []
    with tempfile.TemporaryDirectory(prefix="flamed-bench-") as t:
        tmp = Path(t)
        chain = tmp / "chain"
        subprocess.run([gcc, "-O2", "-fomit-frame-pointer", "-o", str(chain),
                        str(ROOT / "tests" / "workloads" / "unwind" / "chain.c")], check=True)
        total = (len(rates) * 2 * pairs) * (seconds + 40) + 60
        py = "/usr/bin/python3.11" if Path("/usr/bin/python3.11").exists() else sys.executable
        work = [subprocess.Popen([str(chain), str(total)]) for _ in range(os.cpu_count() or 1)]
        work.append(subprocess.Popen([py, "-c", PY_WORK.format(secs=total)]))
        stats.write_text("1")
        perf_rows: list[list[str]] = []
        try:
            port = 19760
            for rate in rates:
                for _ in range(pairs):
                    for unwind in (False, True):
                        port += 1
                        rows.append(measure(tmp, rate, unwind, seconds, port))
                    if shutil.which("perf"):
                        perf_rows.append(perf_dwarf(tmp, rate, seconds))
        finally:
            stats.write_text(old)
            for p in work:
                p.kill()
                p.wait()
    print(f"\n## B. daemon cost, unwinding off and on, {seconds:g} s each, load average {os.getloadavg()[0]:.2f}")
    print(f"workload: {os.cpu_count()} x chain.c (-O2 -fomit-frame-pointer) + one Python process (hashlib/zlib/json)\n")
    print("Hz | unwind | daemon %core | BPF %core | BPF ns/sample | daemon+BPF %core | BPF maps MiB | "
          "unwinder maps MiB | RSS MiB | stacks complete %")
    print("--- | --- | --- | --- | --- | --- | --- | --- | --- | ---")
    for r in rows:
        print(" | ".join(r))
    if perf_rows:
        print("\n## C. the stack-copy design: perf record --call-graph dwarf -a, then perf script, same workload\n")
        print("Hz | samples | perf record %core | MB written per s | perf script CPU s per s recorded | "
              "total %core")
        print("--- | --- | --- | --- | --- | ---")
        for r in perf_rows:
            print(" | ".join(r))


def perf_dwarf(tmp: Path, rate: int, seconds: float) -> list[str]:
    data = tmp / f"perf-{rate}.data"
    rec = subprocess.Popen(["perf", "record", "-q", "-a", "-F", str(rate), "--call-graph", "dwarf", "-o", str(data),
                            "--", "sleep", str(seconds)], stderr=subprocess.DEVNULL)
    _, status, ru = os.wait4(rec.pid, 0)
    rec_cpu = ru.ru_utime + ru.ru_stime
    size = data.stat().st_size
    t0 = os.times()
    out = subprocess.run(["perf", "script", "-i", str(data), "-F", "comm,ip,sym"], capture_output=True, text=True)
    t1 = os.times()
    script_cpu = (t1.children_user - t0.children_user) + (t1.children_system - t0.children_system)
    samples = out.stdout.count("\n\n")
    data.unlink()
    return [str(rate), str(samples), f"{100 * rec_cpu / seconds:.2f}", f"{size / seconds / 1e6:.2f}",
            f"{script_cpu / seconds:.3f}", f"{100 * (rec_cpu + script_cpu) / seconds:.2f}"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--rates", default="19 99")
    ap.add_argument("--pairs", type=int, default=1, help="(off, on) pairs per rate")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--skip-tables", action="store_true")
    ap.add_argument("--skip-daemon", action="store_true")
    args = ap.parse_args()
    print(f"# {os.cpu_count()} CPUs, kernel {os.uname().release}, load average {os.getloadavg()[0]:.2f}")
    if not args.skip_tables:
        part_a(args.repeat)
    if not args.skip_daemon:
        if os.geteuid() != 0:
            print("bench/unwind.py: part B needs root (BPF)", file=sys.stderr)
            return 1
        part_b(args.seconds, [int(r) for r in args.rates.split()], args.pairs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
