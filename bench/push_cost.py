#!/usr/bin/env python3
"""What pushing every window to Pyroscope costs the daemon: CPU and bytes per window.

A real daemon (BPF sampler, every process of the host) at RATE Hz pushes each
window to a local ingest endpoint in this script, which answers 200 at once
and counts bodies.  The daemon's own counters give the push thread's CPU time
(encoding + sending, ``flamed_push_cpu_seconds_total``) and the body bytes;
divided by the windows sent.  Per format (pprof, folded).  The unique stacks
per window (what the cost grows with) are printed too: on a busier host,
expect more.

    sudo .venv/bin/python bench/push_cost.py [--rate 99] [--drain 10] [--windows 12]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", line)
        if m:
            total += float(m.group(1))
    return total


def run(fmt: str, rate: int, drain: float, windows: int) -> dict[str, float]:
    got = {"n": 0, "bytes": 0}

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a: object) -> None:
            pass

        def do_POST(self) -> None:  # noqa: N802
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            got["n"] += 1
            got["bytes"] += len(body)
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "flamed.toml"
        cfg.write_text(f"""
[sampling]
frequency = {rate}
drain_interval = {drain}
[output]
state_dir = "{tmp}/state"
rotate_interval = {max(60.0, drain)}
[metrics]
address = "127.0.0.1:0"
[control]
socket = "{tmp}/flamed.sock"
[log]
target = "stderr"
[processors.python]
enabled = false
[pyroscope]
server_address = "http://127.0.0.1:{srv.server_address[1]}"
format = "{fmt}"
""")
        d = subprocess.Popen([sys.executable, "-m", "flamed", "daemon", "--config", str(cfg)], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            sys.path.insert(0, str(ROOT))
            from flamed.daemon.client import request

            status: dict[str, object] = {}
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                try:
                    status = request(f"{tmp}/flamed.sock", {"request": "status"}, open(os.devnull, "wb"),
                                     timeout=5)["status"]
                    break
                except Exception:  # noqa: BLE001 - not up yet
                    time.sleep(0.2)
            addr = status["metrics"]
            import urllib.request

            stacks: list[float] = []
            while got["n"] < windows + 1 and time.monotonic() < deadline + windows * drain * 2:
                time.sleep(drain / 2)
                with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as r:
                    stacks.append(metric(r.read().decode(), "flamed_drain_unique_stacks"))
            with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as r:
                text = r.read().decode()
        finally:
            os.killpg(d.pid, signal.SIGKILL)
            d.wait(30)
            srv.shutdown()
    sent = metric(text, "flamed_push_windows_total")
    return {"windows": sent, "cpu_ms_per_window": 1000 * metric(text, "flamed_push_cpu_seconds_total") / sent,
            "bytes_per_window": metric(text, "flamed_push_sent_bytes_total") / sent,
            "unique_stacks_per_window": sum(stacks) / max(1, len(stacks))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=int, default=99)
    ap.add_argument("--drain", type=float, default=10.0)
    ap.add_argument("--windows", type=int, default=12)
    args = ap.parse_args()
    print(f"# {args.rate} Hz, {args.drain:g} s windows, load {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs")
    for fmt in ("pprof", "folded"):
        r = run(fmt, args.rate, args.drain, args.windows)
        print(f"{fmt:7s} " + json.dumps({k: round(v, 2) for k, v in r.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
