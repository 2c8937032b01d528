"""Mixed-mode faults: process churn, pid reuse, and every way py-spy can fail.

The workloads run in a cgroup of their own, and the daemon samples (BPF
filter) and watches (mixed-mode filter) only that cgroup, so the counts
before and after are ours, not those of other programs on the machine.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support import SCALE, need, scaled, write_config
from daemonproc import check_state_dir
from test_daemon_faults import record_figure

pytestmark = [pytest.mark.bpf, pytest.mark.pyspy, pytest.mark.slow]

CGROUP2 = next((p for p in ("/sys/fs/cgroup/unified", "/sys/fs/cgroup") if os.path.exists(f"{p}/cgroup.procs")
                and os.path.exists(f"{p}/cgroup.controllers")), None)


@pytest.fixture
def cgroup() -> Iterator[str]:
    need(CGROUP2 is not None, "a cgroup v2 hierarchy")
    assert CGROUP2 is not None
    path = f"{CGROUP2}/flamed-fault-{os.getpid()}-{int(time.time() * 1000) % 100000}"
    os.mkdir(path)
    try:
        yield path
    finally:
        # Kill whatever is left in it, then remove it.
        for _ in range(50):
            try:
                pids = [int(x) for x in Path(path, "cgroup.procs").read_text().split()]
            except OSError:
                pids = []
            if not pids:
                break
            for p in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGKILL)
            time.sleep(0.1)
        with contextlib.suppress(OSError):
            os.rmdir(path)


def in_cgroup(path: str) -> Any:
    def enter() -> None:
        Path(path, "cgroup.procs").write_text(str(os.getpid()))
        os.setsid()

    return enter


def daemon_children(pid: int) -> dict[str, int]:
    """Children of ``pid`` by comm."""
    out: dict[str, int] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            st = Path(f"/proc/{d}/status").read_text()
        except OSError:
            continue
        m = re.search(r"^PPid:\s+(\d+)", st, re.M)
        if m and int(m.group(1)) == pid:
            comm = re.search(r"^Name:\s+(.*)$", st, re.M)
            name = comm.group(1) if comm else "?"
            out[name] = out.get(name, 0) + 1
    return out


def steady(d: Any, samples: int = 8, every: float = 0.25) -> dict[str, Any]:
    """:func:`resources` at its lowest over two seconds (two py-spy windows).

    py-spy runs in windows: the run that ends overlaps the next one for a moment
    (two children, their pipes), so one reading can be high; a leak raises the floor.
    """
    rs = []
    for _ in range(samples):
        rs.append(resources(d))
        time.sleep(every)
    low = min(rs, key=lambda r: r["fds"])
    return {k: (min(r[k] for r in rs) if isinstance(rs[0][k], (int, float)) else low[k]) for k in rs[0]}


def resources(d: Any) -> dict[str, Any]:
    """What could leak: fds, threads and children of the daemon, watched processes, caches."""
    kinds: dict[str, int] = {}
    links: list[str] = []
    for fd in os.listdir(f"/proc/{d.pid}/fd"):
        try:
            link = os.readlink(f"/proc/{d.pid}/fd/{fd}")
        except OSError:
            continue
        kind = link.split(":", 1)[0] if ":" in link and not link.startswith("/") else "file"
        if kind == "anon_inode":
            kind = link  # anon_inode:bpf-map, anon_inode:[perf_event], ...
        kinds[kind] = kinds.get(kind, 0) + 1
        links.append(link)
    fds = sum(kinds.values())
    # Pipes belong to py-spy children (their output), which come and go by window.
    fixed_fds = fds - kinds.get("pipe", 0)
    threads = len(os.listdir(f"/proc/{d.pid}/task"))
    kids = daemon_children(d.pid)
    st = d.status()
    py = st["processors"].get("python", {})
    return {
        "fds": fds, "fds_not_pipes": fixed_fds, "pipes": kinds.get("pipe", 0), "threads": threads,
        "pyspy_children": kids.get("py-spy", 0),
        "watched": len(py.get("processes", [])), "pyspy_running": py.get("pyspy_running", 0),
        "symbol_cache_processes": (st.get("symbol_caches") or {}).get("processes"),
        "rss_mb": round(d.rss_bytes() / 2**20, 1),
        "fd_kinds": dict(sorted(kinds.items())), "fd_links": sorted(re.sub(r"\d+", "N", x) for x in links),
    }


LONG = r"""
import sys, time
def long_lived_work():
    s = 0
    for i in range(30000):
        s += i * i
    return s
end = time.time() + float(sys.argv[1])
while time.time() < end:
    long_lived_work()
    time.sleep(0.002)
"""

SHORT = r"""
import sys, time
def short_lived_work():
    s = 0
    for i in range(3000):
        s += i
    return s
end = time.time() + float(sys.argv[1])
while time.time() < end:
    short_lived_work()
"""


def _mixed_daemon(daemon_factory: Any, cg: str, log_level: str = "info", name: str = "daemon", **python: Any) -> Any:
    rel = cg.removeprefix(CGROUP2 or "")
    # These are faults of the py-spy path: Python frames from py-spy, not from the BPF walker.
    opts = {"enabled": True, "source": "pyspy", "window_s": 1.0, "include_cgroup": re.escape(rel) + "$",
            "scan_interval": 1.0}
    opts.update(python)
    return daemon_factory(name=name, sampling={"frequency": 99, "drain_interval": 1.0, "cgroups": [cg]},
                          output={"rotate_interval": 5.0}, processors__python=opts,
                          log={"target": "stderr", "level": log_level})


@pytest.mark.timeout(300 + int(0.3 * scaled(1000, 100)))
def test_churn_leaks_nothing(require_bpf: None, require_pyspy: str, daemon_factory: Any, cgroup: str) -> None:
    # 1000 at FLAMED_FAULT_SCALE=1; 100 in the suite (250 took ~6 s more of a 20-minute budget
    # than 150, 150 ~3 s more than 100: a leak per process shows as well in 100)
    n_short = scaled(1000, 100) if SCALE >= 1 else 100
    span = 60.0 * n_short / 1000
    d = _mixed_daemon(daemon_factory, cgroup)
    # A first Python process, watched by py-spy until it exits: the daemon sets up
    # the py-spy clock (a BPF program) before its first py-spy and keeps it, so the
    # baseline is taken after that.
    warm = subprocess.Popen([sys.executable, "-c", LONG, "4"], preexec_fn=in_cgroup(cgroup))
    try:
        d.wait_for(lambda: steady(d, samples=2)["pyspy_children"] == 1, 40, "py-spy on a first process")
    finally:
        warm.wait(30)
    d.wait_for(lambda: steady(d, samples=4)["pyspy_children"] == 0 and resources(d)["watched"] == 0, 30,
               "the first process gone")
    time.sleep(2)
    idle = steady(d)  # the daemon with no Python process to watch
    longs = [subprocess.Popen([sys.executable, "-c", LONG, str(span + 90)], preexec_fn=in_cgroup(cgroup))
             for _ in range(3)]
    try:
        d.wait_for(lambda: steady(d, samples=4)["pyspy_children"] == 3 and resources(d)["watched"] == 3, 40,
                   "py-spy on the three long-lived processes")
        time.sleep(2)
        before = steady(d)
        # Churn: n_short Python processes, 50-300 ms each, started evenly over `span` seconds.
        started = 0
        t0 = time.monotonic()
        live: list[subprocess.Popen[bytes]] = []
        import random

        rng = random.Random(7)
        while started < n_short:
            due = t0 + span * started / n_short
            now = time.monotonic()
            if now < due:
                time.sleep(min(0.05, due - now))
            live.append(subprocess.Popen([sys.executable, "-c", SHORT, f"{rng.uniform(0.05, 0.3):.3f}"],
                                         preexec_fn=in_cgroup(cgroup)))
            started += 1
            live = [p for p in live if p.poll() is None]
            assert time.monotonic() - t0 < span * 3 + 60, "spawning fell far behind"
        churn_s = time.monotonic() - t0
        for p in live:
            p.wait(30)
        during = d.status()["processors"]["python"]
        # Let exits, windows and the /proc scan settle.
        def settled() -> bool:
            r = steady(d, samples=4)
            return r["pyspy_children"] <= before["pyspy_children"] and r["watched"] == before["watched"]

        d.wait_for(settled, 30, "py-spy children and watched processes back to the long-lived three")
        time.sleep(3)
        after = steady(d)
        # Then the long ones exit too: everything goes.
        for p in longs:
            p.kill()
            p.wait(10)
        d.wait_for(lambda: steady(d, samples=4)["pyspy_children"] == 0 and resources(d)["watched"] == 0, 30,
                   "no py-spy child once every Python process exited")
        time.sleep(3)
        empty = steady(d)
        head, payload = d.request({"request": "snapshot", "seconds": 600, "format": "folded"})
    finally:
        for p in longs:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)
    assert after["pyspy_children"] == before["pyspy_children"] == 3, (before, after)
    assert after["watched"] == before["watched"] == 3, (before, after)
    # Once every Python process has exited, the daemon holds exactly what it held before any
    # ran: no fd, thread, child or cache entry left behind by 1,000 processes.  (While the
    # long-lived ones run, their own symbol caches may open their libraries lazily, so
    # "after" may exceed "before" by files of theirs: recorded, not a leak.)
    import collections

    extra = collections.Counter(empty["fd_links"]) - collections.Counter(idle["fd_links"])
    assert empty["fds"] <= idle["fds"], (idle["fd_kinds"], empty["fd_kinds"], extra)
    assert empty["threads"] <= idle["threads"], (idle, empty)
    assert after["pipes"] <= 3 * after["pyspy_children"] + 3, (before, after)
    assert after["threads"] <= before["threads"] + 1, (before, after)
    assert empty["pyspy_children"] == 0 and empty["watched"] == 0, empty
    caches_before = before["symbol_cache_processes"]
    caches_after = after["symbol_cache_processes"]
    if caches_before is not None and caches_after is not None:
        # Only the long-lived three may keep a symbol cache; none once they exit too.
        assert caches_after <= caches_before, (before, after)
        assert not empty["symbol_cache_processes"], empty
    # The short-lived processes were really sampled (so the churn exercised the caches).
    assert b"short_lived_work" in payload or head["weight"] > 0
    assert d.alive()
    d.signal(signal.SIGTERM)
    assert d.wait_exit(60) == 0
    check_state_dir(d.state_dir)
    def brief(r: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in r.items() if k != "fd_links"}

    record_figure("churn", {"short_lived": n_short, "churn_seconds": round(churn_s, 1), "long_lived": 3,
                            "idle": brief(idle), "before": brief(before), "after": brief(after),
                            "all_exited": brief(empty),
                            "pyspy_started": during.get("pyspy_started"),
                            "watcher_left_out": during.get("watcher_left_out")})


# ---------------------------------------------------------------------------
# pid reuse

REUSE_C = r"""
#include <unistd.h>
volatile unsigned long sink;
__attribute__((noinline)) void FUNCNAME(void) { for (volatile int i = 0; i < 3000000; i++) sink += i; }
int main(void) { for (int i = 0; i < 40000; i++) FUNCNAME(); return 0; }
"""


def _spawn_with_pid(want: int, argv: list[str], cg: str, tries: int = 200) -> subprocess.Popen[bytes] | None:
    """Start ``argv`` as pid ``want`` (ns_last_pid); None if other forks keep taking it."""
    for _ in range(tries):
        Path("/proc/sys/kernel/ns_last_pid").write_text(str(want - 1))
        p = subprocess.Popen(argv, preexec_fn=in_cgroup(cg))
        if p.pid == want:
            return p
        p.kill()
        p.wait(5)
    return None


def test_pid_reuse_does_not_attach_old_symbols(require_bpf: None, daemon_factory: Any, cgroup: str,
                                               tmp_path: Path) -> None:
    gcc = shutil.which("gcc")
    need(gcc is not None, "gcc (Debian gcc, libc6-dev)")
    bins = {}
    for name in ("alpha_old_process", "omega_new_process"):  # same length: same layout, same addresses
        src = tmp_path / f"{name}.c"
        src.write_text(REUSE_C.replace("FUNCNAME", name))
        out = tmp_path / name
        subprocess.run([str(gcc), "-O0", "-no-pie", "-fno-omit-frame-pointer", "-o", str(out), str(src)],
                       check=True, timeout=60)
        bins[name] = out
    nm = {n: subprocess.run(["nm", str(b)], capture_output=True, text=True).stdout for n, b in bins.items()}
    addr = {n: re.search(rf"^([0-9a-f]+) T {n}$", t, re.M).group(1) for n, t in nm.items()}  # type: ignore[union-attr]
    assert addr["alpha_old_process"] == addr["omega_new_process"], addr
    d = daemon_factory(sampling={"frequency": 199, "drain_interval": 0.5, "cgroups": [cgroup]},
                       output={"rotate_interval": 5.0})
    old = subprocess.Popen([str(bins["alpha_old_process"])], preexec_fn=in_cgroup(cgroup))
    pid = old.pid
    try:
        d.wait_for(lambda: b"alpha_old_process" in d.request(
            {"request": "snapshot", "seconds": 5, "pid": pid})[1], 30, "the old process's frames")
        old.kill()
        old.wait(10)
        new = _spawn_with_pid(pid, [str(bins["omega_new_process"])], cgroup)
        if new is None:
            pytest.skip(f"could not get pid {pid} again (busy machine)")
        try:
            t_new = time.time_ns()
            d.wait_for(lambda: b"omega_new_process" in d.request(
                {"request": "snapshot", "next": 1.0, "pid": pid})[1], 30, "the new process's frames")
            time.sleep(1.0)
            head, payload = d.request({"request": "snapshot", "next": 1.5, "pid": pid, "format": "folded"})
        finally:
            new.kill()
            new.wait(10)
    finally:
        with contextlib.suppress(ProcessLookupError):
            old.kill()
    assert head["start_ns"] >= t_new - 1_000_000_000
    assert b"omega_new_process" in payload, payload[:500]
    assert b"alpha_old_process" not in payload, "the new process under a reused pid got the old one's symbols"
    record_figure("pid_reuse", {"pid": pid, "stale_symbols": 0})


# ---------------------------------------------------------------------------
# py-spy failures

FAKE_PYSPY = r"""#!/bin/sh
# py-spy stand-in: behaves by the comm of the target.  Real py-spy for the others.
pid=""; prev=""
for a in "$@"; do [ "$prev" = "--pid" ] && pid=$a; prev=$a; done
comm=$(cat /proc/$pid/comm 2>/dev/null)
case "$comm" in
  pyhang*) trap '' INT TERM; while :; do sleep 1; done ;;
  pyperm*) echo "Error: Permission Denied (os error 13)" >&2; exit 1 ;;
  *) exec REAL "$@" ;;
esac
"""

NAMED = r"""
import ctypes, sys, time, os
ctypes.CDLL(None).prctl(15, sys.argv[1].encode(), 0, 0, 0)
def named_busy_work():
    s = 0
    for i in range(20000):
        s += i * i
    return s
end = time.time() + 120
while time.time() < end:
    named_busy_work()
    os.stat("/")
"""

BACKOFF = re.compile(r"py-spy on pid (\d+) failed \((\w+)\).*?retry in ([0-9.]+)s")


def _backoffs(log: str) -> dict[int, list[tuple[str, float]]]:
    out: dict[int, list[tuple[str, float]]] = {}
    for m in BACKOFF.finditer(log):
        out.setdefault(int(m.group(1)), []).append((m.group(2), float(m.group(3))))
    return out


def test_pyspy_failures_keep_native_stacks_count_and_back_off(require_bpf: None, require_pyspy: str,
                                                              daemon_factory: Any, cgroup: str,
                                                              tmp_path: Path) -> None:
    fake = tmp_path / "py-spy"
    fake.write_text(FAKE_PYSPY.replace("REAL", require_pyspy))
    fake.chmod(0o755)
    # Unsupported interpreter: a native program whose name says Python (the watcher takes it, py-spy cannot).
    unsupported = tmp_path / "python3.11"
    shutil.copy("/usr/bin/yes", unsupported)
    # retries log at debug; the py-spy that hangs is killed (a timeout) 2 s after it is told to stop
    d = _mixed_daemon(daemon_factory, cgroup, pyspy=str(fake), log_level="debug", stop_timeout_s=2.0)
    procs: dict[str, subprocess.Popen[bytes]] = {}
    killer_stop = threading.Event()
    kills = [0]
    try:
        for name in ("pyhang", "pyperm", "pykill"):
            procs[name] = subprocess.Popen([sys.executable, "-c", NAMED, name], preexec_fn=in_cgroup(cgroup))
        procs["unsupported"] = subprocess.Popen([str(unsupported)], stdout=subprocess.DEVNULL,
                                                preexec_fn=in_cgroup(cgroup))

        def killer() -> None:
            # Kill py-spy whenever it runs on pykill: a crash, every time.
            target = str(procs["pykill"].pid)
            while not killer_stop.wait(0.3):
                for dd in os.listdir("/proc"):
                    if not dd.isdigit():
                        continue
                    try:
                        cmd = Path(f"/proc/{dd}/cmdline").read_bytes().split(b"\0")
                    except OSError:
                        continue
                    if b"record" in cmd and target.encode() in cmd and any(c.endswith(b"py-spy") for c in cmd[:2]):
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(int(dd), signal.SIGKILL)
                            kills[0] += 1

        kt = threading.Thread(target=killer)
        kt.start()

        def reasons() -> dict[str, int]:
            py = d.status()["processors"]["python"]
            return {k.removeprefix("pyspy_failed_"): v for k, v in py.items() if k.startswith("pyspy_failed_")}

        want = ("timeout", "permission", "crash", "unsupported_interpreter")
        d.wait_for(lambda: all(reasons().get(r, 0) >= 1 for r in want) and
                   len([1 for v in _backoffs(d.log()).values() if len(v) >= 2]) >= 3, 100,
                   "every py-spy failure reason counted and retried")
        got = reasons()
        text = d.metrics_text()
        weights = {}
        for name, p in procs.items():
            head, payload = d.request({"request": "snapshot", "seconds": 30, "pid": p.pid, "format": "folded"})
            weights[name] = head["weight"]
            assert head["weight"] > 0, f"{name}: no native/kernel stacks recorded while py-spy fails"
            if name != "unsupported":
                assert b"_[k]" in payload or b"PyEval" in payload or b"python" in payload, payload[:300]
    finally:
        killer_stop.set()
        for p in procs.values():
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)
    # Retried with backoff: each failing target's delays double (up to the cap).
    back = _backoffs(d.log())
    doubled = 0
    for pid, seq in back.items():
        delays = [s for _, s in seq]
        if len(delays) >= 2:
            assert all(b >= a for a, b in zip(delays, delays[1:])), (pid, seq)
            doubled += delays[1] >= 2 * delays[0] * 0.99
    assert doubled >= 3, back
    # Counted in metrics too, by reason.
    for r in want:
        assert f'reason="{r}"' in text or f"pyspy_failed_{r}" in text, f"metric for {r} missing"
    assert kills[0] >= 1
    # Missing binary: a daemon whose py-spy does not exist still records the Python process natively.
    d.signal(signal.SIGTERM)
    assert d.wait_exit(60) == 0
    d2 = _mixed_daemon(daemon_factory, cgroup, pyspy=str(tmp_path / "no-such-py-spy"), name="d2")
    p = subprocess.Popen([sys.executable, "-c", NAMED, "pymissing"], preexec_fn=in_cgroup(cgroup))
    try:
        d2.wait_for(lambda: d2.request({"request": "snapshot", "seconds": 10, "pid": p.pid})[0]["weight"] > 0, 30,
                    "native stacks of the Python process without py-spy")
        py2 = d2.status()["processors"]["python"]
        missing_metric = d2.metric("flamed_pyspy_failures_total", {"reason": "missing_binary"})
        assert "py-spy not found" in d2.log() or "no-such-py-spy" in d2.log(), d2.log()[-1500:]
        assert py2.get("pyspy_started", 0) == 0, py2  # no futile spawning
        missing = {"status_missing_binary": py2.get("pyspy_failed_missing_binary", 0), "metric": missing_metric}
    finally:
        p.kill()
        p.wait(10)
    record_figure("pyspy_failures", {"reasons_counted": got, "native_weight_per_target": weights,
                                     "pyspy_killed_by_test": kills[0], "missing_binary": missing,
                                     "backoff_delays": {str(k): [s for _, s in v][:5] for k, v in back.items()}})
    if not (missing["metric"] or missing["status_missing_binary"]):
        # Known gap (docs/reliability.md): with no py-spy at all, mixed mode warns once at start
        # but counts nothing per process, so no metric shows the reason.
        pytest.xfail("py-spy missing: native stacks kept and a warning logged, but no reason counted in metrics")


# ---------------------------------------------------------------------------
# SIGTERM while Python processes are profiled


def _written_stacks(state: Path, skip: set[Path] | frozenset[Path] = frozenset()) -> dict[tuple[str, ...], int]:
    from daemonproc import profile_files
    from flamed.fileio import open_input
    from flamed.folded import read_folded

    out: dict[tuple[str, ...], int] = {}
    for f in profile_files(state):
        if f in skip:
            continue
        with open_input(f) as fh:
            for stack, n in read_folded(fh).stacks.items():
                out[stack] = out.get(stack, 0) + int(n)
    return out


def _sigterm_accounting(d: Any, rc: int) -> tuple[int, dict[str, Any]]:
    """After a SIGTERM: every sample the program counted is in a file (or a
    counted loss), and the daemon's own stop-time accounting says the same.
    (BPF count, the state directory's totals.)"""
    from test_daemon_faults import bpf_total_from_log

    log = d.log()
    assert rc == 0, log[-3000:]
    tot = check_state_dir(d.state_dir)
    counted = bpf_total_from_log(log)
    assert counted is not None, log[-2000:]
    written = tot["weight"] + tot["lost"].get("map_full", 0)
    assert counted == written, (counted, tot, log[-2000:])
    m = re.findall(r"stopping: .* went into windows \((\d+) written", log)
    assert m and int(m[-1]) == tot["weight"], log[-2000:]
    return counted, tot


def _stop_busy(busy: list[subprocess.Popen[bytes]]) -> None:
    for p in busy:
        with contextlib.suppress(ProcessLookupError):
            p.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(10)


def test_sigterm_with_python_processes_writes_every_sample(require_bpf: None, require_pyspy: str,
                                                           daemon_factory: Any, cgroup: str) -> None:
    from daemonproc import BUSY

    # A long py-spy window: at SIGTERM most Python samples wait for a trace that
    # py-spy only writes when it stops.
    d = _mixed_daemon(daemon_factory, cgroup, window_s=30.0)
    busy = [subprocess.Popen([sys.executable, "-c", BUSY], preexec_fn=in_cgroup(cgroup)) for _ in range(2)]
    try:
        d.wait_for(lambda: resources(d)["pyspy_running"] == 2, 60, "py-spy on both busy processes")
        d.wait_for(lambda: d.status()["processors"]["python"].get("pending_events", 0) > 200, 60,
                   "Python samples waiting for their py-spy trace")
        pending = d.status()["processors"]["python"]["pending_events"]
        d.signal(signal.SIGTERM)
        rc = d.wait_exit(90)
    finally:
        _stop_busy(busy)
    # Every counted sample written, the pending Python ones too.
    counted, tot = _sigterm_accounting(d, rc)
    # ... and they carry Python frames (py-spy's last trace is joined before the last file).
    stacks = _written_stacks(d.state_dir)
    python = sum(n for s, n in stacks.items() if any(f.startswith("<genexpr> (") for f in s))
    assert python >= pending // 2, (python, pending)
    record_figure("sigterm_python", {"bpf_samples": counted, "written_weight": tot["weight"],
                                     "pending_at_sigterm": pending, "with_python_frames": python,
                                     "difference": counted - tot["weight"] - tot["lost"].get("map_full", 0)})


def test_sigterm_with_bpf_python_processes_writes_every_sample(require_bpf: None, daemon_factory: Any,
                                                               cgroup: str) -> None:
    """The default source: Python frames read by the program; a SIGTERM while
    they are sampled writes every counted sample, with its Python frames."""
    from daemonproc import BUSY

    d = _mixed_daemon(daemon_factory, cgroup, source="bpf")
    busy = [subprocess.Popen([sys.executable, "-c", BUSY], preexec_fn=in_cgroup(cgroup)) for _ in range(2)]
    try:
        for p in busy:
            d.wait_for(lambda p=p: _python_share(d, p.pid)[0] > 20, 60, f"Python frames of {p.pid}")
        # What was sampled before the processes were described (their first
        # few hundred ms, longer on a loaded host) goes to a file now: the
        # Python frames are checked in what the SIGTERM writes.
        from daemonproc import profile_files

        d.request({"request": "flush"})
        before = set(profile_files(d.state_dir))
        time.sleep(1.5)  # a drain interval and a half: samples taken since the last drain are pending
        d.signal(signal.SIGTERM)
        rc = d.wait_exit(90)
    finally:
        _stop_busy(busy)
    counted, tot = _sigterm_accounting(d, rc)
    stacks = _written_stacks(d.state_dir, skip=before)
    weight = sum(stacks.values())
    # Only the cgroup is sampled: every written sample is one of the busy processes'.
    python = sum(n for s, n in stacks.items() if any(re.search(r" \(<string>:\d+\)$", f) for f in s))
    assert python >= 0.9 * weight and python > 40, (python, weight, tot["weight"])
    record_figure("sigterm_python_bpf", {"bpf_samples": counted, "written_weight": tot["weight"],
                                         "with_python_frames": python,
                                         "difference": counted - tot["weight"] - tot["lost"].get("map_full", 0)})


# ---------------------------------------------------------------------------
# Reloads while Python processes are profiled


def _python_share(d: Any, pid: int, seconds: float = 2.0) -> tuple[int, int]:
    """(samples with Python frames, samples) of ``pid`` in the last ``seconds``."""
    _, payload = d.request({"request": "snapshot", "seconds": seconds, "pid": [pid], "root": "none",
                            "format": "folded"})
    py = total = 0
    for line in payload.decode(errors="replace").splitlines():
        stack, _, n = line.rpartition(" ")
        total += int(n)
        if "<genexpr> (" in stack:
            py += int(n)
    return py, total


def _reloads_ok(d: Any) -> float:
    try:
        return d.metric("flamed_config_reloads_total", {"result": "ok"})
    except OSError:  # a scrape in flight while [metrics] moves the server is cut: ask again
        return -1


#: One change per section of the config file, applied by SIGHUP in this order.
RELOADS: list[tuple[str, str, Any]] = [
    ("processors.python", "rate", 50),
    ("processors.python", "window_s", 2.0),
    ("sampling", "frequency", 97),
    ("output", "rotate_interval", 4.0),
    ("retention", "max_files", 500),
    ("snapshot", "ring_seconds", 300.0),
    ("metrics", "address", "127.0.0.2:0"),  # rebinds on another loopback address
    ("control", "client_timeout", 4.0),
    ("log", "level", "debug"),
]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("source", ["pyspy", "bpf"])
def test_reload_of_every_section_keeps_python_frames(require_bpf: None, require_pyspy: str,
                                                     daemon_factory: Any, cgroup: str, source: str) -> None:
    """Both sources: py-spy children are reconfigured; the BPF walker's
    descriptions must survive a [sampling] reload that replaces the program."""
    from daemonproc import BUSY

    # Python samples are stored one py-spy window after they were taken: a short window.
    d = _mixed_daemon(daemon_factory, cgroup, window_s=1.0, source=source)
    busy = subprocess.Popen([sys.executable, "-c", BUSY], preexec_fn=in_cgroup(cgroup))
    figures: list[dict[str, Any]] = []
    try:
        def python_frames() -> tuple[int, int] | None:
            py, total = _python_share(d, busy.pid)
            return (py, total) if total and py >= total // 2 else None

        before = d.wait_for(python_frames, 60, "Python frames in the busy process's samples")
        figures.append({"reload": "none (start)", "python": before[0], "samples": before[1]})
        # An invalid processor value is refused as a whole: the running mixed mode goes on.
        import copy

        bad = copy.deepcopy(d.config)
        bad["processors.python"]["rate"] = 1000
        write_config(d.cfg_path, bad)
        d.signal(signal.SIGHUP)
        d.wait_for(lambda: d.metric("flamed_config_reloads_total", {"result": "error"}) == 1, 60,
                   "the refused reload counted")
        line = [ln for ln in d.log().splitlines() if "keeping the running one" in ln][-1]
        assert "processors.python.rate" in line, line
        t_bad = time.time_ns()
        d.wait_for(lambda: d.status()["last_drain_ns"] > t_bad + 2_000_000_000, 30, "2 s of windows")
        got = d.wait_for(python_frames, 60, "Python frames after the refused reload")
        figures.append({"reload": "processors.python.rate = 1000 (refused)", "python": got[0], "samples": got[1]})
        # The BPF walker's part is in the program and the Python processor: the
        # other sections' reloads (the same code for both sources) run once,
        # under py-spy.
        # In the suite, the sections whose reload leaves the sampler and the Python
        # processor alone (retention, snapshot, control) are left to FLAMED_FAULT_SCALE=1:
        # ~3 s each of a 20-minute budget.
        reloads = (RELOADS if SCALE >= 1 else [r for r in RELOADS if r[0] not in ("retention", "snapshot", "control")])
        if source != "pyspy":
            reloads = [r for r in reloads if r[0] in ("sampling", "processors.python")]
        for n, (section, key, value) in enumerate(reloads, start=1):
            d.config.setdefault(section, {})[key] = value
            write_config(d.cfg_path, d.config)
            d.signal(signal.SIGHUP)
            d.wait_for(lambda n=n: _reloads_ok(d) >= n, 60, f"reload {n} ({section}.{key}) counted")
            assert d.metric("flamed_config_reloads_total", {"result": "error"}) == 1, d.log()[-2000:]
            # Only windows drained after the reload count: wait for fresh ones with Python frames.
            t_reload = time.time_ns()
            d.wait_for(lambda: d.status()["last_drain_ns"] > t_reload + 2_000_000_000, 30, "2 s of windows")
            got = d.wait_for(python_frames, 60, f"Python frames after reloading {section}.{key}")
            figures.append({"reload": f"{section}.{key} = {value!r}", "python": got[0], "samples": got[1]})
        st = d.status()["processors"]["python"]
        if source == "pyspy":
            assert st["processes"] == [busy.pid], st
        else:
            assert daemon_children(d.pid).get("py-spy", 0) == 0, "py-spy started for a walked process"
            # A process that starts after the sampler was replaced is walked by the new one.
            # Once, its claim went to the closed sampler, which never answered: after
            # CLAIM_WAIT_S it was "undecided" and got py-spy (every new process, until a restart).
            late = subprocess.Popen([sys.executable, "-c", BUSY], preexec_fn=in_cgroup(cgroup))
            try:
                def decided() -> dict[str, float] | None:
                    text = d.metrics_text()
                    got = {r: d.metric("flamed_python_processes", {"reason": r}, text)
                           for r in ("walked", "undecided")}
                    return got if got["walked"] + got["undecided"] >= 2 else None

                got = d.wait_for(decided, 60, "the process started after the reloads decided")
                assert got == {"walked": 2, "undecided": 0}, got
                assert daemon_children(d.pid).get("py-spy", 0) == 0, "py-spy started for a new process"
            finally:
                late.kill()
                late.wait(10)
    finally:
        busy.kill()
        busy.wait(10)
    log = d.log()
    assert "py-spy not found" not in log, log[-2000:]
    record_figure("reload_sections_python" + ("" if source == "pyspy" else "_bpf"), figures)
