#!/usr/bin/env python3
"""The daemon's RSS over a long run with busy Python services, at several rates at once.

One set of ``--services`` busy Python services (bench/python_bpf.py's: 2 ms of
work, 8 ms of sleep, the two interpreters alternately) runs for ``--minutes``;
one daemon per rate in ``--rates`` (default 19 and 99 Hz) runs beside them on
the shipped defaults otherwise, each started at nice -10 as the unit starts
it.  Every ``--every`` seconds the script prints each daemon's VmRSS, and at
the end a table: RSS at 1 minute, at the end, the peak (VmHWM), and the
daemon's memory by part from its status.  Run as root from a checkout:

    .venv/bin/python bench/daemon_rss.py [--services 32] [--minutes 30] [--rates 19,99]
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import python_bpf  # noqa: E402 -- services, /proc helpers
import startup  # noqa: E402 -- bench/startup.py: the daemon's config

VENV = ROOT / ".venv" / "bin"


def _hwm(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--services", type=int, default=32)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--rates", default="19,99")
    ap.add_argument("--every", type=float, default=60.0, help="seconds between two RSS lines (default 60)")
    ap.add_argument("--only-services", action="store_true",
                    help="[sampling] comms = the services' names: the daemons leave the host's other processes "
                         "(and each other) out, as on a host that runs only the services")
    a = ap.parse_args()
    from flamed.daemon.client import request  # noqa: PLC0415

    rates = [int(r) for r in a.rates.split(",") if r]
    with tempfile.TemporaryDirectory(prefix="flamed-bench-rss-") as t, contextlib.ExitStack() as stack:
        tmp = Path(t)
        stack.enter_context(python_bpf.services(tmp, a.services))
        daemons: dict[int, tuple[subprocess.Popen[bytes], Path]] = {}
        for rate in rates:
            cfg, sock = tmp / f"d{rate}.toml", tmp / f"d{rate}.sock"
            startup.write_config(cfg, sock, tmp / f"state-{rate}", rate,
                                 sampling={"comms": list(startup.SERVICE_COMMS)} if a.only_services else None)
            log = stack.enter_context(open(tmp / f"d{rate}.log", "wb"))
            d = subprocess.Popen(["nice", "-n", "-10", str(VENV / "python"), "-m", "flamed", "daemon", "--config",
                                  str(cfg)], stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd=ROOT)
            stack.callback(python_bpf.stop, d, timeout=60)
            daemons[rate] = (d, sock)
        t0 = time.monotonic()
        first: dict[int, float] = {}
        status: dict[int, dict[str, Any]] = {}
        print(f"{'min':>5} " + " ".join(f"{str(r) + ' Hz MB':>10}" for r in rates), flush=True)
        while time.monotonic() - t0 < a.minutes * 60:
            time.sleep(min(a.every, max(0.0, a.minutes * 60 - (time.monotonic() - t0))))
            row = []
            for rate, (d, _) in daemons.items():
                if d.poll() is not None:
                    raise SystemExit(f"the {rate} Hz daemon exited {d.returncode}; see {tmp / f'd{rate}.log'}")
                mb = python_bpf.rss(d.pid) / 2**20
                first.setdefault(rate, mb)
                row.append(f"{mb:>10.0f}")
            print(f"{(time.monotonic() - t0) / 60:>5.1f} " + " ".join(row), flush=True)
        for rate, (d, sock) in daemons.items():
            with contextlib.suppress(Exception):
                status[rate] = request(str(sock), {"request": "status"}, timeout=10)["status"]
        what = ", daemons sampling the services only" if a.only_services else ""
        print(f"\n{a.services} busy Python services, {a.minutes:g} min{what}")
        print("| rate | RSS at 1st line (MB) | RSS at end (MB) | peak (MB) | memory by part at end (MB) |")
        print("|---|---|---|---|---|")
        for rate, (d, _) in daemons.items():
            mem = status.get(rate, {}).get("memory", {})
            parts = ", ".join(f"{k} {v / 2**20:.0f}" for k, v in sorted(mem.items()))
            print(f"| {rate} Hz | {first.get(rate, 0):.0f} | {python_bpf.rss(d.pid) / 2**20:.0f} | "
                  f"{_hwm(d.pid) / 2**20:.0f} | {parts} |")
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # cleans up the services and daemons
    sys.exit(main())
