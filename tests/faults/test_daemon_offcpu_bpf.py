"""The daemon's off-CPU profiles with the real BPF program and a Python workload that naps.

The workload sleeps in ``napping()`` and measures its own sleep; the off-CPU
files, ``snapshot --kind offcpu`` and the pull endpoint read by ``go tool
pprof`` must put that time (at least 80 % of it, at most a little more) under
``napping``.  The daemon follows only the workload's comm, so the machine's
other tasks do not weigh on the test.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from daemonproc import metric_value
from support import need

from flamed.folded import read_folded
from flamed.model import Stack

pytestmark = [pytest.mark.bpf, pytest.mark.slow]

COMM = "flamednap"
NAPS, NAP_S = 8, 0.25

WORKLOAD = textwrap.dedent(f"""
    import sys, time

    def napping():
        t0 = time.monotonic()
        time.sleep({NAP_S})
        return time.monotonic() - t0

    slept = sum(napping() for _ in range({NAPS}))
    with open(sys.argv[1], "w") as f:
        f.write(repr(slept))
""")


def napping_us(stacks: dict[Stack, Any]) -> float:
    return float(sum(w for s, w in stacks.items() if any(f.startswith("napping (") for f in s)))


def test_daemon_records_where_python_sleeps(tmp_path: Path, require_bpf: None, daemon_factory: Any) -> None:
    go = shutil.which("go")
    need(go is not None, "go (Debian golang-go) for `go tool pprof`")
    promtool = shutil.which("promtool")
    need(promtool is not None, "promtool (Debian prometheus)")
    assert go is not None and promtool is not None
    interp = tmp_path / COMM
    os.symlink(os.path.realpath(sys.executable), interp)
    script = tmp_path / "nap.py"
    script.write_text(WORKLOAD)
    d = daemon_factory(sampling={"frequency": 99, "drain_interval": 1.0, "comms": [COMM], "off_cpu": True,
                                 "off_cpu_min_us": 1000},
                       output={"rotate_interval": 60.0, "root_frame": "pid"})
    addr = d.status()["metrics"]
    env = dict(os.environ, PPROF_TMPDIR=str(tmp_path / "pprof"), HOME=str(tmp_path), PPROF_BINARY_PATH="/nonexistent")
    # go tool pprof pulls the next 6 s of off-CPU time while the workload naps
    pull = subprocess.Popen([go, "tool", "pprof", "-top", "-unit=ms", f"http://{addr}/debug/pprof/offcpu?seconds=6"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        d.wait_for(lambda: metric_value(d.metrics_text(), "flamed_pprof_waiting") >= 1, 30, "the pull to start")
        slept_file = tmp_path / "slept"
        work = subprocess.run([str(interp), str(script), str(slept_file)], timeout=60)
        assert work.returncode == 0
        out, _ = pull.communicate(timeout=120)
    finally:
        if pull.poll() is None:
            pull.kill()
            pull.wait(10)
    assert pull.returncode == 0, out
    slept_us = float(slept_file.read_text()) * 1e6
    assert slept_us >= NAPS * NAP_S * 1e6
    # go tool pprof reads it as off-CPU time: the type, a time unit, the function
    assert re.search(r"^Type: off_cpu$", out, re.M), out
    m = re.search(r"^\s*(?:[\d.]+ms|0)\s+[\d.]+%\s+[\d.]+%\s+([\d.]+)ms\s+[\d.]+%\s+napping$", out, re.M)
    assert m, out
    cum_us = float(m.group(1)) * 1e3
    assert 0.8 * slept_us <= cum_us <= 1.1 * slept_us, (cum_us, slept_us, out)

    # the files: the flush closes the period into both kinds of file
    head, _ = d.request({"request": "flush"})
    assert head["file"]
    st = d.status()
    latest = st["offcpu"]["latest"]
    assert latest and os.path.basename(latest).startswith("offcpu-"), st["offcpu"]
    files = sorted(p for p in d.state_dir.glob("offcpu-*.folded") if not p.is_symlink())
    total = 0.0
    for p in files:
        meta = json.loads(p.with_suffix(".json").read_text())
        assert meta["kind"] == "offcpu" and meta["unit"] == "microseconds"
        total += napping_us(read_folded(io.BytesIO(p.read_bytes()), strict=True).stacks)
    assert 0.8 * slept_us <= total <= 1.1 * slept_us, (total, slept_us)
    # snapshot --kind offcpu over the socket, through the CLI
    r = subprocess.run([sys.executable, "-m", "flamed", "snapshot", "--socket", d.socket_path, "--kind", "offcpu",
                        "--seconds", "120", "--comm", f"^{COMM}$"], capture_output=True, timeout=60,
                       cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 0, r.stderr
    snap = napping_us(read_folded(io.BytesIO(r.stdout)).stacks)
    assert 0.8 * slept_us <= snap <= 1.1 * slept_us, (snap, slept_us)
    # the metrics: waits recorded, switches seen; valid exposition
    text = d.metrics_text()
    check = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    # each nap ended in the window it began in (recorded) or in a later one (carried across a drain)
    assert sum(metric_value(text, "flamed_offcpu_waits_total", {"result": r}) for r in ("recorded", "carried")) >= NAPS
    assert metric_value(text, "flamed_offcpu_switches_total") >= NAPS
    assert metric_value(text, "flamed_offcpu_seconds_total") * 1e6 >= 0.8 * slept_us
    for reason in ("start_full", "map_full", "carry_full"):
        assert metric_value(text, "flamed_offcpu_waits_dropped_total", {"reason": reason}) == 0, text
    d.signal(signal.SIGTERM)
    assert d.wait_exit(60) == 0
