#!/usr/bin/env python3
"""Cost of Python frames: the BPF walker (source = "auto") against py-spy (source = "pyspy").

One run, the same workloads for both paths.  Run as root from the worktree:

    sudo .venv/bin/python bench/python_bpf.py [--quick] [--json out.json]

Daemon cases: N Python "services" (each ~20 % busy: 2 ms of work, then 8 ms
asleep; pyenv's 3.11 and Debian's 3.11 alternately, started through symlinks
named flbench-* so that include_comm keeps py-spy to them and off the other
Python processes of a shared host) run while a real daemon
(``.venv/bin/python -m flamed daemon --config FILE``, private state dir,
socket and metrics port) samples at RATE Hz.  Once it answers on its socket
(and, for py-spy, once every service has its py-spy child), the run settles,
then CPU is measured over --measure seconds: utime+stime of the daemon and of
every descendant (py-spy), plus the daemon's cutime/cstime (children reaped
during the run: py-spy restarts every window), as % of one core.  RSS is the
daemon's VmRSS, and that plus its children's, at the end.  The py-spy case
also turns [sampling] python_frames off: that is the old path, before the
walker.

BPF time per Python sample: a BpfSampler in this process, python=True and
python=False, at 999 Hz on tests/workloads/py_truth.py, with
kernel.bpf_stats_enabled=1 (restored afterwards): run_time_ns / run_cnt of
its perf-event program for each.  The walk's cost per Python sample is the
extra run time of the python=True run over what its run count would have
cost at the python=False rate, divided by its samples with Python frames.

The host may be shared and has few CPUs: the load average at the start is
printed; --repeat N gives medians.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from support import wait_daemon_answers  # noqa: E402

VENV_PY = ROOT / ".venv" / "bin" / "python"
INTERPRETERS = ("/root/.pyenv/versions/3.11.7/bin/python3.11", "/usr/bin/python3.11")
TICK = os.sysconf("SC_CLK_TCK")
STATS = Path("/proc/sys/kernel/bpf_stats_enabled")
SERVICE = r"""
import sys, time
BUSY, IDLE = float(sys.argv[1]), float(sys.argv[2])
def work():
    end = time.perf_counter() + BUSY
    n = 0
    while time.perf_counter() < end:
        n += 1
def serve():
    while True:
        work()
        time.sleep(IDLE)
serve()
"""
#: Seconds of work and of sleep of each service (--busy-ms, --sleep-ms).
DUTY = [0.002, 0.008]
_PY_FRAME = re.compile(r"^(\S+) \(.*\.py:\d+\)$")


# -- /proc -------------------------------------------------------------------
def _stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def children_of(pid: int) -> list[int]:
    out = []
    for tid in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else ():
        with contextlib.suppress(OSError):
            out += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
    return out


def descendants(pid: int) -> list[int]:
    seen: list[int] = []
    todo = children_of(pid)
    while todo and len(seen) < 10_000:
        c = todo.pop()
        if c not in seen:
            seen.append(c)
            todo += children_of(c)
    return seen


def tree_cpu(pid: int) -> float:
    """CPU seconds of ``pid`` (with its reaped children) and of its live descendants."""
    s = _stat(pid)
    if s is None:
        return 0.0
    total = sum(int(s[i]) for i in (11, 12, 13, 14))  # utime stime cutime cstime
    for d in descendants(pid):
        ds = _stat(d)
        if ds is not None:
            total += int(ds[11]) + int(ds[12])  # its own reaped children end up in pid's cutime via it
    return total / TICK


def rss(pid: int) -> int:
    with contextlib.suppress(OSError, StopIteration):
        line = next(ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith("VmRSS:"))
        return int(line.split()[1]) * 1024
    return 0


def pyspy_children(pid: int) -> list[int]:
    out = []
    for c in descendants(pid):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{c}/comm").read_text().strip() == "py-spy":
                out.append(c)
    return out


def stop(p: subprocess.Popen[Any], sig: int = signal.SIGTERM, timeout: float = 30.0) -> None:
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(sig)
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


# -- workloads and daemon ------------------------------------------------------
def _v2_root() -> Path:
    sys.path.insert(0, str(ROOT))
    from flamed.sampling.cgroups import find_v2_hierarchy

    h, why = find_v2_hierarchy()
    if h is None:
        raise SystemExit(f"bench/python_bpf.py: --isolated needs cgroup v2: {why}")
    return h.path


@contextlib.contextmanager
def services(tmp: Path, n: int, isolated: bool = False) -> Iterator[list[int]]:
    """``n`` Python services, the two interpreters alternately; killed when the block ends.

    ``isolated``: each one as PID 1 of its own PID namespace (``unshare``) in
    its own cgroup (``flamed-bench-PID/svc-I.scope`` under the v2 root), as a
    container runtime starts them."""
    cg_top = _v2_root() / f"flamed-bench-{os.getpid()}" if isolated else None
    script = tmp / "service.py"
    script.write_text(SERVICE)
    names = []
    for i, exe in enumerate(INTERPRETERS):
        link = tmp / f"flbench-{'ab'[i]}"
        if not link.exists():
            link.symlink_to(exe)
        names.append(link)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i in range(n):
            cmd = [str(names[i % 2]), "-S", str(script), str(DUTY[0]), str(DUTY[1])]
            if cg_top is not None:
                cg = cg_top / f"svc-{i}.scope"
                cg.mkdir(parents=True, exist_ok=True)
                cmd = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "sh", "-c",
                       f'echo 0 > "{cg}/cgroup.procs" && exec "$@"', "sh", *cmd]
            procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL))
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
        for p in procs:
            p.wait()
        if cg_top is not None:
            deadline = time.monotonic() + 10
            for d in sorted(cg_top.glob("svc-*"), reverse=True) + [cg_top]:
                while d.exists() and time.monotonic() < deadline:
                    try:
                        d.rmdir()
                    except OSError:
                        time.sleep(0.05)  # its processes are still exiting


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def daemon(tmp: Path, tag: str, source: str, rate: int) -> Iterator[subprocess.Popen[bytes]]:
    cfg, sock, state = tmp / f"{tag}.toml", tmp / f"{tag}.sock", tmp / f"state-{tag}"
    cfg.write_text(f"""
[sampling]
frequency = {rate}
python_frames = {"false" if source == "pyspy" else "true"}
[output]
state_dir = "{state}"
[metrics]
address = "127.0.0.1:{free_port()}"
[control]
socket = "{sock}"
[log]
target = "stderr"
[processors.python]
source = "{source}"
include_comm = "^flbench-"
""")
    log = open(tmp / f"{tag}.log", "wb")
    d = subprocess.Popen([str(VENV_PY), "-m", "flamed", "daemon", "--config", str(cfg)],
                         stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd=ROOT)
    try:
        try:
            wait_daemon_answers(sock, d, timeout=120)
        except AssertionError as e:
            raise SystemExit(f"{tag}: {e}; see {tmp / (tag + '.log')}") from None
        yield d
    finally:
        kids = descendants(d.pid) if d.poll() is None else []
        stop(d, timeout=60)
        for k in kids:  # the daemon stops its py-spy children; this is for when it did not
            with contextlib.suppress(ProcessLookupError):
                os.kill(k, signal.SIGKILL)
        log.close()


def daemon_case(tmp: Path, source: str, rate: int, n: int, settle: float, measure: float) -> dict[str, Any]:
    tag = f"{source}-{rate}-{n}-{time.monotonic_ns()}"
    isolated = source == "auto-isolated"
    with services(tmp, n, isolated), daemon(tmp, tag, "auto" if isolated else source, rate) as d:
        if source == "pyspy":
            # py-spy starts once a drain (10 s) has seen the process busy.
            deadline = time.monotonic() + 60
            while len(pyspy_children(d.pid)) < n and time.monotonic() < deadline:
                time.sleep(0.5)
        time.sleep(settle)
        c0, t0 = tree_cpu(d.pid), time.monotonic()
        spies = 0
        while time.monotonic() - t0 < measure:
            time.sleep(min(1.0, max(0.0, measure - (time.monotonic() - t0))))
            spies = max(spies, len(pyspy_children(d.pid)))
        c1, t1 = tree_cpu(d.pid), time.monotonic()
        own = rss(d.pid)
        total = own + sum(rss(c) for c in descendants(d.pid))
        if d.poll() is not None:
            raise SystemExit(f"{tag}: the daemon exited {d.returncode} during the run")
    return {"source": source, "rate": rate, "processes": n, "seconds": round(t1 - t0, 2),
            "cpu_pct_core": 100 * (c1 - c0) / (t1 - t0), "rss_mb": own / 2**20,
            "rss_with_children_mb": total / 2**20, "pyspy_children": spies}


# -- BPF time per sample, in process ------------------------------------------
def prog_ids(pid: int) -> set[int]:
    ids = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{fd}") != "anon_inode:bpf-prog":
                continue
            for line in Path(f"/proc/{pid}/fdinfo/{fd}").read_text().splitlines():
                if line.startswith("prog_id:"):
                    ids.add(int(line.split()[1]))
    return ids


def prog_stats(ids: set[int]) -> tuple[int, int]:
    out = subprocess.run(["bpftool", "-j", "prog", "show"], capture_output=True, text=True, check=True).stdout
    ns = cnt = 0
    for prog in json.loads(out):
        if prog.get("id") in ids and prog.get("name") == "flamed_sample":
            ns += int(prog.get("run_time_ns", 0))
            cnt += int(prog.get("run_cnt", 0))
    return ns, cnt


def sampler_case(python: bool, seconds: float) -> dict[str, Any]:
    from flamed.sampling.bpf import BpfSampler, BpfSamplerOptions  # noqa: PLC0415 - needs root and bcc

    # python_timing: the program itself adds up the ns of each walk (two clock reads a sample).
    s = BpfSampler(BpfSamplerOptions(frequency=999, python=python, python_timing=python))
    child: subprocess.Popen[bytes] | None = None
    try:
        s.start()
        ids = prog_ids(os.getpid())
        s.drain()
        ns0, cnt0 = prog_stats(ids)
        child = subprocess.Popen([INTERPRETERS[0], str(ROOT / "tests" / "workloads" / "py_truth.py"),
                                  f"{seconds:g}", "2"], stdout=subprocess.DEVNULL)
        child.wait(timeout=seconds + 60)
        ns1, cnt1 = prog_stats(ids)
        time.sleep(0.2)  # the priming thread names the last stacks
        w = s.drain()
        pys = s.stats().python_total
    finally:
        if child is not None:
            stop(child, signal.SIGKILL)
        s.close()
    mine = [(st, n) for (tgid, _tid, _comm, st), n in w.counts.items() if tgid == child.pid]
    return {"python": python, "run_time_ns": ns1 - ns0, "run_cnt": cnt1 - cnt0,
            "ns_per_run": (ns1 - ns0) / max(1, cnt1 - cnt0),
            "workload_samples": sum(n for _, n in mine),
            "python_samples": sum(n for st, n in mine if any(_PY_FRAME.match(f) for f in st)),
            # every described process's walks (this workload's and any other CPython's on the host)
            "walks": pys.get("PY_SAMPLES", 0), "walk_ns": pys.get("PY_NS", 0)}


# -- report ----------------------------------------------------------------------
def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def table(hdr: tuple[str, ...], rows: list[tuple[object, ...]]) -> None:
    cells = [hdr, *[tuple(str(c) for c in r) for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(hdr))]
    for j, r in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
        if j == 0:
            print("  ".join("-" * w for w in widths))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settle", type=float, default=5.0, help="seconds after readiness before measuring (5)")
    ap.add_argument("--measure", type=float, default=20.0, help="seconds of each measurement (20)")
    ap.add_argument("--rates", default="19,99", help="rates of the 8-process case (19,99)")
    ap.add_argument("--counts", default="1,8,32", help="process counts at 19 Hz, BPF path (1,8,32)")
    ap.add_argument("--pyspy-counts", default="1,8", help="process counts at 19 Hz, py-spy path (1,8)")
    ap.add_argument("--walk-seconds", type=float, default=5.0, help="each in-process 999 Hz run (5)")
    ap.add_argument("--repeat", type=int, default=1, help="runs of every case; the table shows medians")
    ap.add_argument("--quick", action="store_true", help="about a minute: settle 2 s, measure 5 s, "
                    "counts 1,8 (py-spy 8), walk runs of 3 s")
    ap.add_argument("--isolated", action="store_true",
                    help="also the BPF path with each service in its own PID namespace and cgroup "
                         "(as containers run them), at 19 Hz with 8 services")
    ap.add_argument("--no-walk", action="store_true", help="skip the in-process BPF time per sample runs")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--busy-ms", type=float, default=2.0, help="each service's work per cycle (2 ms)")
    ap.add_argument("--sleep-ms", type=float, default=8.0,
                    help="each service's sleep per cycle (8 ms): 32 services of 2+8 ms are 6.4 cores of demand; "
                         "0.3+9.7 ms makes 32 of them fit in one")
    args = ap.parse_args()
    DUTY[:] = [args.busy_ms / 1000, args.sleep_ms / 1000]
    # SIGTERM (timeout(1), a CI kill) must run the finally blocks that stop the
    # daemon, the services and py-spy, and restore bpf_stats_enabled.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.quick:
        args.settle, args.measure, args.walk_seconds = 2.0, 5.0, 3.0
        args.counts, args.pyspy_counts, args.rates = "1,8", "8", "19,99"
    if os.geteuid() != 0:
        print("bench/python_bpf.py: needs root (BPF, py-spy)", file=sys.stderr)
        return 1
    for exe in INTERPRETERS:
        if not os.access(exe, os.X_OK):
            print(f"bench/python_bpf.py: {exe} missing", file=sys.stderr)
            return 1
    rates = [int(r) for r in args.rates.split(",") if r]
    counts = {"auto": [int(c) for c in args.counts.split(",") if c],
              "pyspy": [int(c) for c in args.pyspy_counts.split(",") if c]}
    cases: list[tuple[str, int, int]] = []
    if args.isolated:
        cases.append(("auto-isolated", 19, 8))
    for source in ("auto", "pyspy"):
        for rate in rates:
            if source == "auto" or counts["pyspy"]:
                cases.append((source, rate, 8))
        for n in counts[source]:
            if (source, 19, n) not in cases:
                cases.append((source, 19, n))
    load = os.getloadavg()
    print(f"# bench/python_bpf.py: {os.cpu_count()} CPUs, load average at start "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; settle {args.settle:g} s, measure {args.measure:g} s, "
          f"repeat {args.repeat}; services {args.busy_ms:g} ms busy / {args.sleep_ms:g} ms asleep", flush=True)
    runs: list[dict[str, Any]] = []
    walk: list[dict[str, Any]] = []
    old_stats = STATS.read_text().strip()
    with tempfile.TemporaryDirectory(prefix="flamed-bench-pybpf-") as t:
        tmp = Path(t)
        try:
            STATS.write_text("1")
            for _ in range(args.repeat):
                # Interleaved, so that the host's load drifts over both paths alike.
                for source, rate, n in cases:
                    r = daemon_case(tmp, source, rate, n, args.settle, args.measure)
                    print(f"#   {source} {rate} Hz {n} proc: {r['cpu_pct_core']:.2f} % of a core", flush=True)
                    runs.append(r)
                for python in (() if args.no_walk else (False, True)):
                    walk.append(sampler_case(python, args.walk_seconds))
        finally:
            STATS.write_text(old_stats)
    print()
    print("daemon + children CPU (% of one core) and RSS; medians over --repeat")
    rows = []
    summary = []
    for source, rate, n in cases:
        rs = [r for r in runs if (r["source"], r["rate"], r["processes"]) == (source, rate, n)]
        row = {"source": source, "rate": rate, "processes": n,
               "cpu_pct_core": med([r["cpu_pct_core"] for r in rs]),
               "rss_mb": med([r["rss_mb"] for r in rs]),
               "rss_with_children_mb": med([r["rss_with_children_mb"] for r in rs]),
               "pyspy_children": max(r["pyspy_children"] for r in rs)}
        summary.append(row)
        rows.append((source, rate, n, f"{row['cpu_pct_core']:.2f}", f"{row['rss_mb']:.0f}",
                     f"{row['rss_with_children_mb']:.0f}", row["pyspy_children"]))
    table(("source", "Hz", "procs", "CPU %core", "RSS MB", "RSS+children MB", "py-spy"), rows)
    goal = next((r["cpu_pct_core"] for r in summary if (r["source"], r["rate"], r["processes"]) == ("auto", 19, 8)),
                None)
    if goal is not None:
        print(f"goal: BPF path <= 1 % of a core at 19 Hz, 8 processes: {goal:.2f} % "
              f"({'met' if goal <= 1.0 else 'NOT met'})")
    print()
    if not walk:
        return 0
    off = [w for w in walk if not w["python"]]
    on = [w for w in walk if w["python"]]
    base = med([w["ns_per_run"] for w in off])
    per_py = med([(w["run_time_ns"] - w["run_cnt"] * base) / max(1, w["python_samples"]) for w in on])
    print(f"BPF program flamed_sample, in process, 999 Hz, py_truth.py (2 threads, {args.walk_seconds:g} s)")
    table(("python", "ns/run", "runs", "workload samples", "with Python frames"),
          [(w["python"], f"{w['ns_per_run']:.0f}", w["run_cnt"], w["workload_samples"], w["python_samples"])
           for w in walk])
    print(f"difference per Python sample (upper bound): {per_py:.0f} ns")
    timed = med([w["walk_ns"] / w["walks"] for w in on if w["walks"]])
    print(f"walk time per Python sample, timed in the program: {timed:.0f} ns "
          f"(goal <= 2000 ns: {'met' if timed <= 2000 else 'NOT met'})")
    if args.json:
        Path(args.json).write_text(json.dumps({"load_average": load, "args": vars(args), "summary": summary,
                                               "runs": runs, "walk": walk, "walk_ns_difference": per_py,
                                               "walk_ns_timed": timed},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
