#!/usr/bin/env python3
"""Start-up and footprint: ``flamed record`` against py-spy and perf, and the daemon.

Part 1, ``record``: each tool runs the same 1 s CPU-bound Python command
(``python3 target.py STAMP``: it writes CLOCK_MONOTONIC at its first line,
then loops for 1 s), ``--runs`` times, the tools alternated.  Printed per
tool, medians (min-max): the time from the tool's exec to the target's first
line ("to target"), the whole run's wall time, and the tool's peak RSS
(wait4's ru_maxrss: the largest of the tool and the children it waited for;
the target itself is ~10 MB).  Tools: ``flamed record`` (mixed mode, the
defaults; its compiled programs in the cache, as from the second run on),
the same with an empty cache each run ("no cache": a first start, clang
compiles), ``flamed record --no-unwind``, ``py-spy record``, ``perf record
-g``, and ``flamed record`` through a daemon (started first, on the shipped
defaults, and running during all the runs: its own sampling slows the others
a little, as it would on a host that runs it).

Part 2, the daemon: for each count of busy Python services (``--services``,
default 0 8 32; each loops 2 ms and sleeps 8 ms, as bench/python_bpf.py's),
the daemon on the shipped defaults (19 Hz, drain every 10 s, the BPF walker
and the unwinder on) is started at nice -10 as the unit starts it, and printed: the time until its control
socket answers (ready), the start-up by phase from ``status``, RSS at ready
and after ``--settle`` seconds, and its CPU (tree: daemon and py-spy
children) per 10 s span over ``--settle`` seconds.  Each count runs twice
(``--caches``): with no compiled-program cache (the compile runs in a child
process at every start) and with the cache filled (no compile).  On a
shared host the daemon also describes and names whatever else runs there
(other people's tests start processes and compile programs at any time),
which shows in any span; ``--only-services`` sets ``[sampling] comms`` to
the services' names, so that the figures are the daemon's work for the
services alone.

Run as root from a checkout whose ``.venv`` ``make test`` made.  The machine
may be shared: the load average is printed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
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
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

import python_bpf  # noqa: E402 -- bench/python_bpf.py: services, /proc helpers

VENV = ROOT / ".venv" / "bin"
#: The tools' environment: byte code written and read as an installed flamed
#: has it (a wheel or the .deb compiles it at install); a shell that sets
#: PYTHONDONTWRITEBYTECODE would have every run compile flamed's ~70 modules.
BASE_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
TARGET = """
import sys, time
with open(sys.argv[1], "w") as f:
    f.write(str(time.monotonic_ns()))
end = time.monotonic() + 1.0
def work():
    return sum(i * i for i in range(1000))
while time.monotonic() < end:
    work()
"""


def run_tool(argv: list[str], stamp: Path, env: dict[str, str] | None = None) -> dict[str, float]:
    stamp.unlink(missing_ok=True)
    t0 = time.monotonic_ns()
    p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         env=env)
    _, status, ru = os.wait4(p.pid, 0)
    t1 = time.monotonic_ns()
    p.returncode = os.waitstatus_to_exitcode(status)
    err = p.stderr.read().decode("utf-8", "replace") if p.stderr else ""
    if p.returncode != 0 or not stamp.exists():
        raise SystemExit(f"{argv[0]} failed ({p.returncode}): {err[-2000:]}")
    started = int(stamp.read_text())
    return {"to_target_s": (started - t0) / 1e9, "wall_s": (t1 - t0) / 1e9, "rss_mb": ru.ru_maxrss / 1024}


def record_part(runs: int, tmp: Path) -> None:
    target = tmp / "target.py"
    target.write_text(TARGET)
    stamp = tmp / "stamp"
    py = "python3"
    tools: dict[str, list[str]] = {
        "flamed record": [str(VENV / "flamed"), "record", "-o", str(tmp / "f.folded"), "--", py, str(target), str(stamp)],
        "flamed record, no cache": [str(VENV / "flamed"), "record", "-o", str(tmp / "f.folded"), "--", py,
                                    str(target), str(stamp)],
        "flamed record --no-unwind": [str(VENV / "flamed"), "record", "--no-unwind", "-o", str(tmp / "f2.folded"),
                                      "--", py, str(target), str(stamp)],
        "py-spy record": [str(VENV / "py-spy"), "record", "-f", "raw", "-o", str(tmp / "p.txt"), "--", py,
                          str(target), str(stamp)],
        "perf record -g": ["perf", "record", "-q", "-g", "-o", str(tmp / "perf.data"), "--", py, str(target),
                           str(stamp)],
    }
    got: dict[str, list[dict[str, float]]] = {k: [] for k in tools}
    got["flamed record via a daemon"] = []
    # The compiled programs' cache ($XDG_CACHE_HOME/flamed/bpf): the bench's own, filled by one
    # untimed run of each flamed variant; "no cache" gets an empty one every run (a first start).
    warm = dict(BASE_ENV, XDG_CACHE_HOME=str(tmp / "xdg-warm"))
    for name in ("flamed record", "flamed record --no-unwind"):
        run_tool(tools[name], stamp, warm)
    with running_daemon(tmp) as sock:
        tools["flamed record via a daemon"] = [str(VENV / "flamed"), "record", "--socket", str(sock), "-o",
                                               str(tmp / "d.folded"), "--", py, str(target), str(stamp)]
        for i in range(runs):
            for name, argv in tools.items():
                env = warm
                if name == "flamed record, no cache":
                    env = dict(BASE_ENV, XDG_CACHE_HOME=tempfile.mkdtemp(dir=tmp, prefix="xdg-cold-"))
                got[name].append(run_tool(argv, stamp, env))
            print(f"  record: run {i + 1}/{runs} done", file=sys.stderr)

    def cell(xs: list[float], fmt: str) -> str:
        return f"{statistics.median(xs):{fmt}} ({min(xs):{fmt}}-{max(xs):{fmt}})"

    print(f"\n## record: a 1 s Python command, {runs} runs each, medians (min-max); "
          f"load {os.getloadavg()[0]:.2f}")
    print(f"| {'tool':28} | {'to target (s)':20} | {'wall (s)':20} | {'peak RSS (MB)':20} |")
    print(f"|{'-' * 30}|{'-' * 22}|{'-' * 22}|{'-' * 22}|")
    for name, rs in got.items():
        print(f"| {name:28} | {cell([r['to_target_s'] for r in rs], '.2f'):20} | "
              f"{cell([r['wall_s'] for r in rs], '.2f'):20} | {cell([r['rss_mb'] for r in rs], '.0f'):20} |")


def write_config(cfg: Path, sock: Path, state: Path, frequency: int | None = None, *,
                 sampling: dict[str, Any] | None = None, output: dict[str, Any] | None = None) -> int:
    """A daemon config on the shipped defaults (but for ``frequency`` and the
    ``sampling`` and ``output`` keys given), its files under ``state``; returns
    its metrics port."""
    port = python_bpf.free_port()
    samp = {**({"frequency": frequency} if frequency else {}), **(sampling or {})}
    head = "[sampling]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in samp.items()) if samp else ""
    cfg.write_text(f"""{head}
[output]
state_dir = "{state}"
{"".join(f"{k} = {json.dumps(v)}{chr(10)}" for k, v in (output or {}).items())}
[metrics]
address = "127.0.0.1:{port}"
[control]
socket = "{sock}"
[log]
target = "stderr"
""")
    return port


@contextlib.contextmanager
def running_daemon(tmp: Path) -> Iterator[Path]:
    """A daemon on the shipped defaults; its control socket while it runs."""
    from flamed.daemon.client import request  # noqa: PLC0415 - needs the checkout on sys.path

    cfg, sock = tmp / "rd.toml", tmp / "rd.sock"
    write_config(cfg, sock, tmp / "state-rd")
    log = open(tmp / "rd.log", "wb")
    d = subprocess.Popen([str(VENV / "python"), "-m", "flamed", "daemon", "--config", str(cfg)],
                         stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while True:
            if d.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"daemon not ready; see {tmp / 'rd.log'}")
            try:
                request(str(sock), {"request": "status"}, timeout=2.0)
                break
            except Exception:  # noqa: BLE001 -- not listening yet
                time.sleep(0.05)
        yield sock
    finally:
        python_bpf.stop(d, timeout=60)
        log.close()


#: The services' comm (python_bpf.services starts them through links of these names).
SERVICE_COMMS = ("flbench-a", "flbench-b")


def daemon_case(tmp: Path, n: int, settle: float, frequency: int | None = None, cache: str = "",
                only_services: bool = False) -> dict[str, Any]:
    """``cache``: the compiled programs' directory ("": none, every start compiles);
    ``only_services``: sample the services' comms only."""
    from flamed.daemon.client import request  # noqa: PLC0415 - needs the checkout on sys.path

    tag = f"d{n}-{time.monotonic_ns()}"
    cfg, sock = tmp / f"{tag}.toml", tmp / f"{tag}.sock"
    sampling: dict[str, Any] = {"bpf_cache_dir": cache}
    if only_services:
        sampling["comms"] = list(SERVICE_COMMS)
    write_config(cfg, sock, tmp / f"state-{tag}", frequency, sampling=sampling)
    with python_bpf.services(tmp, n):
        time.sleep(1.0 if n else 0)  # the services are up and busy
        log = open(tmp / f"{tag}.log", "wb")
        t0 = time.monotonic()
        # As the unit starts it (Nice=-10); it takes [sampling] nice (5) itself once ready.
        d = subprocess.Popen(["nice", "-n", "-10", str(VENV / "python"), "-m", "flamed", "daemon", "--config",
                              str(cfg)], stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd=ROOT)
        try:
            status: dict[str, Any] | None = None
            while status is None and time.monotonic() - t0 < 300:
                if d.poll() is not None:
                    raise SystemExit(f"daemon exited {d.returncode}; see {tmp / (tag + '.log')}")
                if sock.exists():
                    try:
                        status = request(str(sock), {"request": "status"}, timeout=2.0)["status"]
                    except Exception:  # noqa: BLE001 -- bound, not listening yet
                        pass
                if status is None:
                    time.sleep(0.02)
            ready = time.monotonic() - t0
            if status is None:
                raise SystemExit(f"daemon not ready in 300 s; see {tmp / (tag + '.log')}")
            rss_ready = python_bpf.rss(d.pid) / 2**20
            spans: list[float] = []
            c0, s0 = python_bpf.tree_cpu(d.pid), time.monotonic()
            while time.monotonic() - t0 < ready + settle:
                time.sleep(max(0.0, min(10.0, s0 + 10.0 - time.monotonic())))
                c1, s1 = python_bpf.tree_cpu(d.pid), time.monotonic()
                spans.append(100 * (c1 - c0) / (s1 - s0))
                c0, s0 = c1, s1
            rss_end = python_bpf.rss(d.pid) / 2**20
            rss_peak = _vm_hwm(d.pid) / 2**20
            status = request(str(sock), {"request": "status"}, timeout=5.0)["status"]
        finally:
            python_bpf.stop(d, timeout=60)
            log.close()
    st = status.get("startup", {})
    return {"n": n, "program": status.get("program_from", "?"),
            "ready_s": ready, "compile_s": st.get("sampler_compile_s", float("nan")),
            "rss_ready": rss_ready, "rss_end": rss_end, "rss_peak": rss_peak, "spans": spans,
            "memory": status.get("memory", {})}


def _vm_hwm(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def daemon_part(counts: list[int], settle: float, tmp: Path, frequency: int | None = None,
                caches: tuple[str, ...] = ("none", "warm"), only_services: bool = False) -> None:
    rows = []
    warm = str(tmp / "bpf-cache")
    for n in counts:
        for c in caches:
            print(f"  daemon: {n} services, {c} cache ...", file=sys.stderr)
            if c == "warm" and not Path(warm).is_dir():
                daemon_case(tmp, 0, 0.0, frequency, cache=warm, only_services=only_services)  # fills it
            rows.append(daemon_case(tmp, n, settle, frequency, cache=warm if c == "warm" else "",
                                    only_services=only_services))
    what = ", sampling the services only" if only_services else ""
    print(f"\n## daemon on the shipped defaults ({frequency or 19} Hz{what}); load {os.getloadavg()[0]:.2f}")
    print("| services | program | ready (s) | compile+verify (s) | RSS at ready (MB) | RSS after "
          f"{settle:.0f} s (MB) | CPU per 10 s span, % of a core (max) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        sp = r["spans"]
        spans = " ".join(f"{x:.1f}" for x in sp[:12])
        if len(sp) > 12:
            rest = sorted(sp[12:])
            spans += f" ... then median {rest[len(rest) // 2]:.1f}"
        print(f"| {r['n']} | {r['program']} | {r['ready_s']:.2f} | {r['compile_s']:.2f} | {r['rss_ready']:.0f} | "
              f"{r['rss_end']:.0f} (peak {r['rss_peak']:.0f}) | {spans} (max {max(sp or [0]):.1f}) |")
    for r in rows:
        mem = ", ".join(f"{k} {v / 2**20:.0f}" for k, v in sorted(r["memory"].items()))
        print(f"memory by part at the end, {r['n']} services, program {r['program']} (MB): {mem}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5, help="runs of each record tool (default 5)")
    ap.add_argument("--services", type=int, nargs="*", default=[0, 8, 32],
                    help="busy Python services per daemon run (default 0 8 32)")
    ap.add_argument("--settle", type=float, default=120.0,
                    help="seconds each daemon runs after ready (default 120)")
    ap.add_argument("--frequency", type=int, default=None, help="daemon sampling rate (default: the shipped 19 Hz)")
    ap.add_argument("--caches", nargs="*", choices=["none", "warm"], default=["none", "warm"],
                    help="daemon runs without the compiled programs' cache (every start compiles, in a "
                         "child) and/or with it filled (default both)")
    ap.add_argument("--only-services", action="store_true",
                    help="daemon: [sampling] comms = the services' names (leaves other processes of a shared host out)")
    ap.add_argument("--skip-record", action="store_true")
    ap.add_argument("--skip-daemon", action="store_true")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench/startup.py: run as root (BPF, py-spy, perf)", file=sys.stderr)
        return 2
    # Every tool and daemon started here gets BASE_ENV's byte-code setting.
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    subprocess.run([str(VENV / "python"), "-m", "compileall", "-q", str(ROOT / "flamed")], check=True)
    with tempfile.TemporaryDirectory(prefix="flamed-bench-startup-") as t:
        tmp = Path(t)
        if not args.skip_record:
            record_part(args.runs, tmp)
        if not args.skip_daemon and args.services:
            daemon_part(args.services, args.settle, tmp, args.frequency, tuple(args.caches), args.only_services)
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(main())
