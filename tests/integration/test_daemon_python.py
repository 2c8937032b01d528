"""The daemon's mixed-mode processor: a real daemon, real BPF, real py-spy, a real Python workload.

The workload runs under its own comm (a symlink to the interpreter), and the
processor is told to include only that comm, so the test never profiles the
other Python processes of the machine.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from flamed.daemon.client import request
from flamed.folded import read_folded
from support import ROOT, wait_daemon_answers

pytestmark = [pytest.mark.bpf, pytest.mark.pyspy, pytest.mark.slow]

COMM = "flamedpyproc"


def test_daemon_joins_python_frames(tmp_path: Path, require_bpf: None, require_pyspy: str) -> None:
    interp = tmp_path / COMM
    os.symlink(os.path.realpath(sys.executable), interp)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cfg = tmp_path / "flamed.toml"
    cfg.write_text(f"""
[sampling]
frequency = 99
drain_interval = 1.0
[output]
state_dir = "{tmp_path / 'profiles'}"
rotate_interval = 60.0
[metrics]
address = "127.0.0.1:{port}"
[control]
socket = "{tmp_path / 'flamed.sock'}"
[log]
target = "stderr"
[processors.python]
source = "pyspy"
pyspy = "{require_pyspy}"
include_comm = "^{COMM}$"
window_s = 2.0
scan_interval = 1.0
""")
    sock = tmp_path / "flamed.sock"
    daemon = subprocess.Popen([sys.executable, "-m", "flamed", "daemon", "--config", str(cfg)],
                              stderr=subprocess.PIPE, text=True, cwd=ROOT)
    work: subprocess.Popen[bytes] | None = None
    try:
        wait_daemon_answers(sock, daemon, 120)
        time.sleep(2)  # the processor's uprobe and watcher start with the daemon
        work = subprocess.Popen([str(interp), str(ROOT / "tests" / "workloads" / "phases.py"),
                                 str(tmp_path / "phases.log"), "100", "40"])
        assert work.wait(timeout=120) == 0
        # Python samples are stored one py-spy window (+ a drain) after they were taken:
        # asked for until they are all there (2-3 s), 15 s at most.
        deadline = time.monotonic() + 15
        while True:
            buf = io.BytesIO()
            request(str(sock), {"request": "snapshot", "seconds": 120, "pid": [work.pid], "root": "none"}, buf,
                    timeout=60)
            p = read_folded(io.BytesIO(buf.getvalue()))
            stacks = {";".join(k): v for k, v in p.stacks.items()}
            sys_k = sum(v for k, v in stacks.items() if "syscall_phase (" in k and "do_syscall_64_[k]" in k)
            comp = sum(v for k, v in stacks.items() if "compute_phase (" in k)
            none = sum(v for k, v in stacks.items() if k.startswith("[python: no frame]"))
            if (sys_k > 20 and comp > 50 and none < 0.2 * p.total()) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert sys_k > 20 and comp > 50, sorted(stacks.items(), key=lambda kv: -kv[1])[:10]
        # most samples of the process carry Python frames
        assert none < 0.2 * p.total(), (none, p.total())
        st = subprocess.run([sys.executable, "-m", "flamed", "status", "--json", "--socket", str(sock)],
                            capture_output=True, text=True, timeout=30, cwd=ROOT)
        status = json.loads(st.stdout)
        proc = status["processors"]["python"]
        assert proc["active"] and proc["join_matched"] > 0 and proc["runs_calibrated"] >= 1, proc
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
        matched = [ln for ln in text.splitlines() if ln.startswith('flamed_python_samples_total{result="matched"}')]
        assert matched and float(matched[0].split()[-1]) > 0, text[-3000:]
        assert 'flamed_pyspy_failures_total{reason="permission"}' in text
        assert "flamed_pyspy_children " in text
        promtool = shutil.which("promtool")
        if promtool:
            chk = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True,
                                 timeout=30)
            # promtool lints names/help; only errors (not style warnings) would fail here
            assert "error" not in chk.stderr.lower(), chk.stderr
    finally:
        if work is not None and work.poll() is None:
            work.kill()
            work.wait()
        daemon.terminate()
        try:
            daemon.wait(timeout=30)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
    # no py-spy child of the daemon outlives it
    left = subprocess.run(["pgrep", "-f", f"py-spy record --pid {work.pid if work else 0} "],
                          capture_output=True, text=True).stdout.split()
    assert left == []


def test_daemon_reads_python_frames_in_bpf_at_once(tmp_path: Path, require_bpf: None, require_pyspy: str) -> None:
    """The default source (auto): CPython read by the BPF program, no py-spy for
    it, Python frames in the window the samples were taken in, the choice in
    flamed_python_processes{source="bpf"}."""
    interp = tmp_path / COMM
    os.symlink(os.path.realpath(sys.executable), interp)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cfg = tmp_path / "flamed.toml"
    cfg.write_text(f"""
[sampling]
frequency = 99
drain_interval = 0.5
[output]
state_dir = "{tmp_path / 'profiles'}"
rotate_interval = 60.0
[metrics]
address = "127.0.0.1:{port}"
[control]
socket = "{tmp_path / 'flamed.sock'}"
[log]
target = "stderr"
[processors.python]
pyspy = "{require_pyspy}"
include_comm = "^{COMM}$"
scan_interval = 1.0
""")
    sock = tmp_path / "flamed.sock"
    daemon = subprocess.Popen([sys.executable, "-m", "flamed", "daemon", "--config", str(cfg)],
                              stderr=subprocess.PIPE, text=True, cwd=ROOT)
    work: subprocess.Popen[bytes] | None = None
    try:
        wait_daemon_answers(sock, daemon, 120)
        work = subprocess.Popen([str(interp), str(ROOT / "tests" / "workloads" / "py_truth.py"), "6", "2"])
        # While it runs: its Python frames are in the last seconds already (no py-spy window to wait for).
        deadline = time.monotonic() + 30
        named = 0
        text = ""
        while time.monotonic() < deadline and work.poll() is None:
            time.sleep(1.0)
            buf = io.BytesIO()
            request(str(sock), {"request": "snapshot", "seconds": 2, "pid": [work.pid], "root": "none"}, buf,
                    timeout=30)
            p = read_folded(io.BytesIO(buf.getvalue()))
            named = sum(v for k, v in p.stacks.items() if any(f.startswith("step_") for f in k))
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
            if named > 20 and 'flamed_python_processes{reason="walked",source="bpf"} 1.0' in text:
                break
        assert named > 20, "no Python frames in the last 2 s while the workload runs"
        assert 'flamed_python_processes{reason="walked",source="bpf"} 1.0' in text, text[-3000:]
        pyspy = subprocess.run(["pgrep", "-f", f"py-spy record --pid {work.pid} "], capture_output=True, text=True)
        assert pyspy.stdout.split() == [], "py-spy was started for a process the BPF program reads"
        assert work.wait(timeout=60) == 0
        promtool = shutil.which("promtool")
        if promtool:
            chk = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True,
                                 timeout=30)
            assert "error" not in chk.stderr.lower(), chk.stderr
    finally:
        if work is not None and work.poll() is None:
            work.kill()
            work.wait()
        daemon.terminate()
        try:
            daemon.wait(timeout=30)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
