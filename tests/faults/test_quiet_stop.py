"""A stop prints flamed's own lines and nothing else, with or without tracefs.

bcc removes a uprobe through tracefs's uprobe_events and, from an atexit hook,
tries again: without tracefs (this machine) that printed
``open(/sys/kernel/tracing/uprobe_events): ...``, ``close perf event FD
failed`` and an ``Exception ignored in atexit callback`` traceback at every
stop of a daemon or a ``flamed record`` that loaded the py-spy clock.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from support import foreign_lines

#: What bcc printed at a stop before flamed detached its probes itself.
BCC_NOISE = re.compile(r"uprobe_events|kprobe_events|Failed to detach|Exception ignored|Traceback|"
                       r"perf event FD failed|PERF_EVENT_IOC_DISABLE")


def test_daemon_stop_prints_only_flamed_lines(require_bpf: None, require_pyspy: str, daemon_factory: Any) -> None:
    # Mixed mode on, with a busy Python process for py-spy to record: the daemon
    # loads the py-spy clock before its first py-spy, and that clock's uprobe is
    # what bcc failed to detach.
    busy = subprocess.Popen([sys.executable, "-c", "while True: sum(i * i for i in range(1000))"])
    try:
        d = daemon_factory(processors__python={"enabled": True, "source": "pyspy"})
        d.wait_for(lambda: "py-spy clock: uprobe on" in d.log(), 60, "the py-spy clock")
        d.wait_for(lambda: d.status()["windows"] >= 1, 60, "a first window")
        d.signal(signal.SIGTERM)
        assert d.wait_exit(60) == 0
    finally:
        busy.kill()
        busy.wait()
    log = d.log()
    assert "py-spy clock: uprobe on" in log, log[-3000:]  # the probe was there to detach
    assert "INFO stopped" in log.splitlines()[-1], log[-3000:]
    assert [ln for ln in log.splitlines() if BCC_NOISE.search(ln)] == [], log[-3000:]
    # flamed's own: its log lines and, run by hand, the client commands it prints when ready
    ready_block = re.compile(r"^flamed daemon ready; in another terminal:$|^  \S")
    assert [ln for ln in foreign_lines(log) if not ready_block.match(ln)] == [], log[-3000:]


def test_record_prints_only_its_own_lines(require_bpf: None, require_pyspy: str, tmp_path: Path) -> None:
    out = tmp_path / "rec.folded"
    workload = ("import time\nend = time.monotonic() + 1.0\n"
                "while time.monotonic() < end:\n    sum(i * i for i in range(1000))\n")
    r = subprocess.run([sys.executable, "-m", "flamed", "record", "-r", "99", "--pyspy", require_pyspy,
                        "-o", str(out), "--", sys.executable, "-c", workload],
                       capture_output=True, text=True, timeout=180, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert re.search(r"[1-9]\d* py-spy run\(s\) calibrated by uprobe", r.stderr), r.stderr
    assert out.stat().st_size > 0
    assert [ln for ln in r.stderr.splitlines() if BCC_NOISE.search(ln)] == [], r.stderr
    assert foreign_lines(r.stderr, re.compile(r"^flamed record: ")) == [], r.stderr
