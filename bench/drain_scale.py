#!/usr/bin/env python3
"""Drain + symbolize at 10 k, 50 k and 100 k distinct stacks per window, native and Python.

For each kind of workload and each size, a BpfSampler in this process with
the daemon's choice of programs (``python`` and ``unwind`` on, as the shipped
``[sampling]`` has them; ``--no-unwind`` for frame-pointer stacks only) and
maps large enough for the size samples at 999 Hz on every CPU until the
window holds about that many distinct (task, stack) keys; the workloads are
then SIGSTOPped (alive, so /proc still has their maps and memory, but off
the CPU) and one drain -- ``BpfSampler.drain()``, what the daemon calls per
window -- is timed, wall and CPU.  The first window of each sampler runs with
cold caches (a new sampler: no symbol table, code object or address cached),
the next ``--warm`` ones with warm caches (the daemon's steady state), each
with new random stacks.

* native: two copies of tests/workloads/busy.c in ``paths`` mode (random
  recursion through two functions, up to 2^26 distinct stacks), built
  ``-O0 -fno-omit-frame-pointer``.
* python: two copies of a generated program under a CPython that links
  libpython (``--python``, default pyenv's 3.12): random recursion through 64
  generated functions, 8-20 deep, so nearly every sample is a new Python
  stack.  Both are started, stopped, and
  described to the sampler while stopped (see :func:`claim`).

How long a window must run for a size is estimated from a short first
window per kind (distinct stacks per second); the table gives the sizes
reached.  Columns: ``read`` is flip + batch reads of the maps, ``symbolize``
the rest of the drain; ``drain cpu`` the draining thread's CPU; ``bg cpu``
this process's CPU while the window was sampled (the priming thread names
the code objects of every new Python stack as the program reports it, so
part of a Python stack's cost is paid there, before the drain); ``rss`` this
process's VmRSS after the drain (it includes bcc's compiler, ~100 MB, which
the daemon has too), ``+rss`` its growth since the sampler started.

``--daemon``: also a real daemon (``python -m flamed daemon``, private state,
socket and metrics port) with the same maps and a drain interval chosen for
each size, on the same workloads left running: after ``--daemon-windows``
windows, its VmRSS, the snapshot ring's stacks and its own drain histogram
(``flamed_drain_duration_seconds``, mean over its windows).

The peer: bcc's ``profile-bpfcc`` on the native workloads, as in
bench/sampler.py part A (its "drain" is SIGINT to exit: read, symbolize,
print).  py-spy keeps no window to drain (it symbolizes each sample as it
takes it), so the Python rows have none.

    sudo .venv/bin/python bench/drain_scale.py [--sizes 10000,50000,100000] [--kinds native,python]
        [--warm 2] [--daemon] [--no-peer] [--no-unwind] [--profile FILE]

The machine is shared and has 2 CPUs: the load average is printed with each
row; warm rows are medians of ``--warm`` windows (each one is printed with
``-v``).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import glob
import json
import os
import re
import resource
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
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from flamed.sampling.bpf import BpfSampler, BpfSamplerOptions  # noqa: E402

PEER = "/usr/sbin/profile-bpfcc"
#: Python frames kept per stack: the workload's stacks are at most ~25 deep,
#: and 32 keeps the Python stack maps at ~50 MB of kernel memory for 131 k
#: entries (the daemon's default depth, 128, would be ~200 MB per generation).
PY_DEPTH = 32

PY_WORKLOAD = r'''
import random, sys, time
N = 64
UNTIL = time.monotonic() + float(sys.argv[1])
src = []
for i in range(N):
    src.append(f"""
def f{i}(d, r):
    if d == 0:
        return leaf()
    return F[r.getrandbits(6)](d - 1, r)
""")
exec("\n".join(src), globals())
F = [globals()[f"f{i}"] for i in range(N)]

def leaf():
    n = 0
    for i in range(20000):  # ~1 ms: most samples land here, under a random path
        n += i * i
    return n

def main():
    r = random.Random()
    while time.monotonic() < UNTIL:
        F[r.getrandbits(6)](r.randint(8, 20), r)

print("ready", flush=True)
main()
'''


# -- processes ----------------------------------------------------------------
def loadavg() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


def rss_kb(pid: int | str = "self") -> tuple[int, int]:
    """(VmRSS, VmHWM) in KiB."""
    vals = {}
    for ln in Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = ln.partition(":")
        if k in ("VmRSS", "VmHWM"):
            vals[k] = int(v.split()[0])
    return vals.get("VmRSS", 0), vals.get("VmHWM", 0)


def cpu_self() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def default_python() -> str:
    root = subprocess.run(["pyenv", "root"], capture_output=True, text=True).stdout.strip() \
        if shutil.which("pyenv") else "/root/.pyenv"
    found = sorted(glob.glob(f"{root or '/root/.pyenv'}/versions/3.12*/bin/python3.12"))
    return found[-1] if found else "/usr/bin/python3.11"


@contextlib.contextmanager
def workloads(argv: list[str], n: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    # A session of their own: they are SIGSTOPped while the sampler starts, and
    # a process group with stopped members that becomes orphaned (the shell
    # that started this bench exits first) gets SIGHUP from the kernel, which
    # killed them (exit status -1) and read as a refused workload.
    ps = [subprocess.Popen(argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True)
          for _ in range(n)]
    try:
        for p in ps:
            assert p.stdout is not None
            line = p.stdout.readline()
            if line.strip() != b"ready":  # it died starting: a zombie probes as "gone"
                raise SystemExit(f"workload {p.pid} did not start ({line!r}, exit status {p.wait(timeout=30)})")
        yield ps
    finally:
        for p in ps:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
        for p in ps:
            p.wait(timeout=30)


def signal_all(ps: list[subprocess.Popen[bytes]], sig: int) -> None:
    for p in ps:
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(sig)


def build_busy(tmp: Path) -> Path:
    out = tmp / "flamed_busy"
    subprocess.run(["gcc", "-O0", "-g", "-fno-omit-frame-pointer", "-o", str(out),
                    str(ROOT / "tests" / "workloads" / "busy.c")], check=True)
    return out


def workload_argv(kind: str, tmp: Path, python: str, seconds: float) -> list[str]:
    if kind == "native":
        return [str(tmp / "flamed_busy"), "paths", f"{seconds:.0f}", "26"]
    script = tmp / "pypaths.py"
    script.write_text(PY_WORKLOAD)
    return [python, str(script), f"{seconds:.0f}"]


def options(size: int, unwind: bool, pids: frozenset[int] | None = None) -> BpfSamplerOptions:
    """The daemon's programs, maps for ``size`` distinct stacks with room to spare."""
    cap = 1 << max(14, (int(size * 1.3) - 1).bit_length())
    return BpfSamplerOptions(
        pids=pids,
        frequency=999, stack_storage_size=4 * cap, stack_depth=48, max_entries=2 * cap,
        python=True, python_depth=PY_DEPTH, python_stack_entries=cap,
        unwind=unwind, unwind_depth=48, unwind_stack_entries=cap,
    )


# -- one sampler, several windows ------------------------------------------------
@dataclasses.dataclass
class Row:
    kind: str
    cache: str
    target: int
    samples: int
    keys: int
    stacks: int
    python_stacks: int
    read_s: float
    sym_s: float
    wall_s: float
    cpu_s: float
    bg_cpu_s: float
    window_s: float
    rss_mb: float
    rss_growth_mb: float
    load: str


def settle(limit: float = 5.0) -> None:
    """Wait until this process is idle: the priming thread names the code
    objects of every new Python stack the program reported (counted as ``bg
    cpu``), and its backlog must not run inside the timed drain."""
    end = time.monotonic() + limit
    last = cpu_self()
    while time.monotonic() < end:
        time.sleep(0.1)
        now = cpu_self()
        if now - last < 0.005:
            return
        last = now


def windows(kind: str, argv: list[str], size: int, seconds: float, warm: int, unwind: bool,
            system_wide: bool = False, profile: cProfile.Profile | None = None, verbose: bool = False) -> list[Row]:
    rows: list[Row] = []
    with workloads(argv, 2) as ps:
        # Stopped until the sampler has described them: a layout check walks
        # the threads from user space, and a thread recursing at random
        # changes its frames under the walk, which fails the check (three
        # failures refuse the process).
        signal_all(ps, signal.SIGSTOP)
        with BpfSampler(options(size, unwind, None if system_wide else frozenset(p.pid for p in ps))) as s:
            if kind == "python":
                try:
                    claim(s, [p.pid for p in ps])
                except SystemExit:
                    # How a workload that died ended (a negative status: the signal).
                    print(f"# workload exit statuses: {[p.poll() for p in ps]}", file=sys.stderr, flush=True)
                    raise
            signal_all(ps, signal.SIGCONT)
            rows = _windows(s, ps, kind, size, seconds, warm, profile, verbose)
    return rows


def claim(s: BpfSampler, pids: list[int]) -> None:
    """Have the walker describe ``pids`` (stopped) now; refuse to go on without.

    A "not_python" is asked again until the deadline (each ask probes the
    process anew); the probe's own words and the process's state are
    printed when it stays.  (The refusals this bench used to see were
    workloads killed by SIGHUP while stopped: see :func:`workloads`.)"""
    from flamed.sampling.cpython.process import probe  # noqa: PLC0415

    deadline = time.monotonic() + 20
    for pid in pids:
        said = False
        while True:
            ok, why = s.python_claim(pid)
            if ok:
                break
            if ok is False and not said:
                try:
                    state = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0].decode()
                except OSError:
                    state = "reaped"
                # stderr: a --one child's stdout is its result
                print(f"# pid {pid} (state {state}) refused at first ({why}); the probe says: {probe(pid)}",
                      file=sys.stderr, flush=True)
                said = True
            if (ok is False and why != "not_python") or time.monotonic() > deadline:
                raise SystemExit(f"the BPF walker does not read pid {pid}: {why or 'not ready'}")
            time.sleep(0.05)


def _windows(s: BpfSampler, ps: list[subprocess.Popen[bytes]], kind: str, size: int, seconds: float, warm: int,
             profile: cProfile.Profile | None, verbose: bool) -> list[Row]:
    rows: list[Row] = []
    time.sleep(0.5)
    s.drain()  # what ran before the window: the compile, the workloads' start
    base_rss = rss_kb()[0]
    for i in range(1 + warm):
        signal_all(ps, signal.SIGCONT)
        c0, t0 = cpu_self(), time.monotonic()
        time.sleep(seconds)
        signal_all(ps, signal.SIGSTOP)
        win = time.monotonic() - t0
        settle()
        bg = cpu_self() - c0
        load = loadavg()
        if profile is not None and i > 0:
            profile.enable()  # the warm drains
        t1 = time.perf_counter()
        w = s.drain()
        wall = time.perf_counter() - t1
        if profile is not None:
            profile.disable()
        st = s.stats()
        pystacks = len({k for k in w.counts if any(f.endswith(")") and ".py:" in f for f in k[3])})
        rss = rss_kb()[0]
        row = Row(kind, "cold" if i == 0 else "warm", size, w.samples, st.last_keys, len(w.counts), pystacks,
                  st.last_drain_seconds - st.last_symbolize_seconds, st.last_symbolize_seconds, wall,
                  st.last_drain_cpu_seconds, bg, win, rss / 1024, (rss - base_rss) / 1024, load)
        rows.append(row)
        if verbose:
            print(f"#   {row}", flush=True)
        del w
    return rows


def one(kind: str, argv: list[str], size: int, seconds: float, warm: int, unwind: bool, system_wide: bool,
        profile: str | None) -> list[Row]:
    """:func:`windows` in a new process (so that its RSS is that size's alone)."""
    cmd = [sys.executable, __file__, "--one", json.dumps([kind, argv, size, seconds, warm, unwind, system_wide,
                                                          profile])]
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        out, _ = child.communicate(timeout=(warm + 1) * (seconds + 120))
    finally:
        if child.poll() is None:  # interrupted: SIGTERM lets it stop its workloads
            child.terminate()
            child.wait(timeout=60)
    if child.returncode != 0:
        raise SystemExit(f"bench/drain_scale.py --one exited {child.returncode}")
    return [Row(**r) for r in json.loads(out.strip().splitlines()[-1])]


def _one(spec: str) -> int:
    kind, argv, size, seconds, warm, unwind, system_wide, profile = json.loads(spec)
    prof = cProfile.Profile(time.thread_time) if profile else None  # the draining thread's CPU
    rows = windows(kind, argv, size, seconds, warm, unwind, system_wide, prof)
    if prof is not None:
        prof.dump_stats(f"{profile}.{kind}.{size}")
    print(json.dumps([dataclasses.asdict(r) for r in rows]))
    return 0


def rate(kind: str, argv: list[str], unwind: bool, system_wide: bool, seconds: float) -> float:
    """Distinct stacks per second of ``kind``'s workloads."""
    r = one(kind, argv, 20000, seconds, 0, unwind, system_wide, None)[0]
    return r.stacks / r.window_s


# -- the peer ----------------------------------------------------------------------
def peer_row(argv: list[str], size: int, seconds: float, system_wide: bool) -> list[str]:
    out = Path(tempfile.mkstemp(prefix="flamed-peer-")[1])
    try:
        with workloads(argv, 2) as ps, open(out, "wb") as f:
            which = [] if system_wide else ["-p", ",".join(str(p.pid) for p in ps)]
            # Its hash holds 10240 entries unless told otherwise; tell it, as flamed's maps are sized.
            p = subprocess.Popen([PEER, "-F", "999", "-f", "-a", *which, "--stack-storage-size", str(4 * size),
                                  "100000"], stdout=f, stderr=subprocess.DEVNULL)
            try:
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline and p.poll() is None and not _bpf_prog(p.pid):
                    time.sleep(0.2)
                time.sleep(0.5)
                time.sleep(seconds)
                signal_all(ps, signal.SIGSTOP)
                load = loadavg()
                t0 = time.perf_counter()
                p.send_signal(signal.SIGINT)
                _pid, _st, ru = os.wait4(p.pid, 0)
                wall = time.perf_counter() - t0
                p.returncode = 0
            finally:
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=30)
        lines = [ln for ln in out.read_bytes().splitlines() if ln.strip()]
    finally:
        out.unlink()
    samples = sum(int(ln.rsplit(b" ", 1)[1]) for ln in lines if ln.rsplit(b" ", 1)[-1].isdigit())
    # Its CPU is its whole life (start-up compile included); it does nothing in
    # user space while sampling, so wall after SIGINT is the figure to compare.
    return ["native", "profile-bpfcc", f"{size}", f"{samples}", f"{len(lines)}", "-", "-", "-", f"{wall:.2f}",
            f"({ru.ru_utime + ru.ru_stime:.2f})", f"{1e6 * wall / max(1, len(lines)):.1f}", "-", "-", load]


def _bpf_prog(pid: int) -> bool:
    for fd in Path(f"/proc/{pid}/fdinfo").iterdir():
        with contextlib.suppress(OSError):
            if "prog_type:\t7\n" in fd.read_text():
                return True
    return False


# -- a real daemon ------------------------------------------------------------------
def daemon_row(kind: str, argv: list[str], size: int, interval: float, nwin: int, unwind: bool,
               system_wide: bool, tmp: Path) -> list[str]:
    from support import wait_daemon_answers  # noqa: PLC0415

    from startup import write_config  # noqa: PLC0415 -- bench/startup.py: the benches' daemon config

    o = options(size, unwind)
    cfg = tmp / f"d-{kind}-{size}.toml"
    state, sock = tmp / f"state-{kind}-{size}", tmp / f"d-{kind}-{size}.sock"
    with workloads(argv, 2) as ps:
        sampling: dict[str, Any] = {
            "frequency": 999, "drain_interval": round(interval, 1), "nice": os.nice(0),
            "stack_map_size": o.stack_storage_size, "stack_depth": o.stack_depth, "counts_map_size": o.max_entries,
            "python_depth": o.python_depth, "python_stack_map_size": o.python_stack_entries, "unwind": unwind,
            "unwind_depth": o.unwind_depth, "unwind_stack_map_size": o.unwind_stack_entries, "unwind_cache_dir": "",
        }
        if not system_wide:
            sampling["pids"] = [p.pid for p in ps]
        port = write_config(cfg, sock, state, sampling=sampling,
                            output={"rotate_interval": max(60.0, round(interval, 1))})
        log = open(tmp / f"d-{kind}-{size}.log", "wb")
        d = subprocess.Popen([sys.executable, "-m", "flamed", "daemon", "--config", str(cfg)], cwd=ROOT,
                             stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        try:
            wait_daemon_answers(sock, d, timeout=180)
            deadline = time.monotonic() + interval * (nwin + 3) + 60
            # The first window after start-up is partial (and cold): the figures are of the next ones.
            drains0 = _metric(port, "flamed_drains_total")
            while time.monotonic() < deadline and d.poll() is None \
                    and _metric(port, "flamed_drains_total") < drains0 + 1:
                time.sleep(0.5)
            m0 = _metrics(port)
            while time.monotonic() < deadline and d.poll() is None \
                    and _metric(port, "flamed_drains_total") < m0.get("flamed_drains_total", 0) + nwin:
                time.sleep(0.5)
            if d.poll() is not None:
                raise SystemExit(f"the daemon exited {d.returncode}; see {log.name}")
            # The counter moves before the window's file is written and the heap
            # trimmed: RSS is read between drains, a tenth of an interval later.
            time.sleep(min(max(interval / 10, 3.0), 15.0))
            rss, hwm = rss_kb(d.pid)
            m = _metrics(port)
        finally:
            if d.poll() is None:
                d.send_signal(signal.SIGTERM)
                try:
                    d.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    d.kill()
                    d.wait()
            log.close()
    n = m.get("flamed_drain_duration_seconds_count", 0.0) - m0.get("flamed_drain_duration_seconds_count", 0.0)
    total = m.get("flamed_drain_duration_seconds_sum", 0.0) - m0.get("flamed_drain_duration_seconds_sum", 0.0)
    mean = total / n if n else float("nan")
    def part(name: str) -> str:  # flamed_memory_bytes{part=...}, MB
        key = 'flamed_memory_bytes{part="' + name + '"}'
        return f"{m.get(key, float('nan')) / 2**20:.0f}"

    return [kind, "daemon", f"{size}", f"{interval:.0f}", f"{m.get('flamed_drain_unique_stacks', 0):.0f}",
            f"{n:.0f}", f"{mean:.2f}", f"{m.get('flamed_ring_stacks', 0):.0f}", f"{rss / 1024:.0f}",
            f"{hwm / 1024:.0f}", part("anon"), part("compiler"), part("bpf_maps"), loadavg()]


def _metrics(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for ln in text.splitlines():
        m = re.match(r"^([a-z_]+)(\{[^}]*\})? ([0-9.e+-]+|NaN)$", ln)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def _metric(port: int, name: str) -> float:
    try:
        return _metrics(port).get(name, 0.0)
    except OSError:
        return 0.0


# -- report ----------------------------------------------------------------------------
def table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join([fmt.format(*head), fmt.format(*("-" * w for w in widths)), *(fmt.format(*r) for r in rows)])


def summarize(rows: list[Row]) -> list[list[str]]:
    out = []
    keys = list(dict.fromkeys((r.kind, r.target, r.cache) for r in rows))
    for kind, target, cache in keys:
        rs = [r for r in rows if (r.kind, r.target, r.cache) == (kind, target, cache)]

        def med(f: str) -> float:
            return statistics.median(getattr(r, f) for r in rs)

        per = 1e6 * med("wall_s") / max(1.0, med("stacks"))
        out.append([kind, f"flamed, {cache}" + (f" (x{len(rs)})" if len(rs) > 1 else ""), f"{target}",
                    f"{med('samples'):.0f}", f"{med('stacks'):.0f}", f"{med('python_stacks'):.0f}",
                    f"{med('read_s'):.2f}", f"{med('sym_s'):.2f}", f"{med('wall_s'):.2f}", f"{med('cpu_s'):.2f}",
                    f"{per:.1f}", f"{100 * med('bg_cpu_s') / med('window_s'):.0f}", f"{med('rss_mb'):.0f}",
                    ",".join(r.load for r in rs)])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10000,50000,100000")
    ap.add_argument("--kinds", default="native,python")
    ap.add_argument("--warm", type=int, default=2, help="warm windows after the cold one, per size (2)")
    ap.add_argument("--python", default=None, help="the CPython of the Python workload (pyenv's 3.12)")
    ap.add_argument("--no-unwind", action="store_true", help="frame-pointer user stacks only")
    ap.add_argument("--no-peer", action="store_true", help="leave out bcc's profile-bpfcc")
    ap.add_argument("--daemon", action="store_true", help="also a real daemon per size (see above)")
    ap.add_argument("--daemon-windows", type=int, default=3, help="windows timed after the first (3)")
    ap.add_argument("--daemon-sizes", default="", help="sizes with a daemon row (default: every size)")
    ap.add_argument("--daemon-only", action="store_true", help="only the daemon rows (with --daemon)")
    ap.add_argument("--daemon-kinds", default="", help="kinds with a daemon row (default: every kind)")
    ap.add_argument("--nice", type=int, default=-10,
                    help="nice of this process and its workloads (-10): on a shared host they get the CPU, so a "
                         "window reaches its size sooner and the drain waits less for a CPU")
    ap.add_argument("--profile", help="cProfile of the warm drains, written here (pstats)")
    ap.add_argument("--system-wide", action="store_true",
                    help="sample every process, not only the workloads (on a shared host the others' stacks "
                         "are drained too, and vary from run to run)")
    ap.add_argument("-v", "--verbose", action="store_true")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # finally blocks stop the workloads
    if args.one:
        return _one(args.one)
    if os.geteuid() != 0 or shutil.which("gcc") is None:
        print("bench/drain_scale.py needs root and gcc", file=sys.stderr)
        return 2
    os.nice(args.nice - os.nice(0))  # inherited by the workloads, samplers and daemons started below
    sizes = [int(x) for x in args.sizes.split(",") if x]
    dsizes = {int(x) for x in args.daemon_sizes.split(",") if x} or set(sizes)
    kinds = [k for k in args.kinds.split(",") if k]
    dkinds = {k for k in args.daemon_kinds.split(",") if k} or set(kinds)
    python = args.python or default_python()
    unwind = not args.no_unwind
    print(f"# {os.cpu_count()} CPUs, kernel {os.uname().release}, load average {loadavg()}; "
          f"python workload: {python}; unwind {'on' if unwind else 'off'}; nice {os.nice(0)}; "
          f"{'every process' if args.system_wide else 'the workloads only (pid filter)'}", flush=True)
    rows: list[Row] = []
    extra: list[list[str]] = []
    drows: list[list[str]] = []
    with tempfile.TemporaryDirectory(prefix="flamed-drainscale-") as t:
        tmp = Path(t)
        build_busy(tmp)
        for kind in kinds:
            longest = 2 * (max(sizes) / 500 + 60) * (2 + args.warm)
            argv = workload_argv(kind, tmp, python, longest)
            per_s = rate(kind, argv, unwind, args.system_wide, 4.0)
            print(f"# {kind}: ~{per_s:.0f} distinct stacks/s", flush=True)
            for size in sizes:
                secs = size / per_s
                if not args.daemon_only:
                    got = one(kind, argv, size, secs, args.warm, unwind, args.system_wide, args.profile)
                    if args.verbose:
                        for r in got:
                            print(f"#   {r}", flush=True)
                    rows += got
                    print(table(HEAD, summarize([r for r in rows if (r.kind, r.target) == (kind, size)])), flush=True)
                if kind == "native" and not args.no_peer and not args.daemon_only and Path(PEER).exists():
                    extra.append(peer_row(argv, size, secs, args.system_wide))
                if args.daemon and size in dsizes and kind in dkinds:
                    drows.append(daemon_row(kind, argv, size, secs, args.daemon_windows, unwind, args.system_wide, tmp))
    if rows or extra:
        print()
        print(f"## drain + symbolize, 999 Hz on {os.cpu_count()} CPUs, 2 workloads per kind, one sampler per size")
        print(table(HEAD, summarize(rows) + extra))
        print("(us/stack = drain wall / distinct stacks; bg cpu % = this process's CPU while the window was "
              "sampled, % of one core)")
    if drows:
        print()
        print(f"## real daemon, workloads running: its drains after the first (partial) window, RSS at the end")
        print(table(["kind", "", "size", "interval s", "stacks (last)", "drains", "mean drain s", "ring stacks",
                     "rss MB", "hwm MB", "anon MB", "compiler MB", "bpf maps MB", "load"], drows))
    return 0


HEAD = ["kind", "sampler", "target", "samples", "stacks", "py stacks", "read s", "symbolize s", "drain wall s",
        "drain cpu s", "us/stack", "bg cpu %", "rss MB", "load"]

if __name__ == "__main__":
    raise SystemExit(main())
