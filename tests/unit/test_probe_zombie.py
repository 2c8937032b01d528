"""probe() on a process that has exited but is not reaped yet (a zombie).

A zombie's /proc/PID/maps still opens but is empty, and its exe link is
unreadable: without a look at its state it read as "not a CPython process"
(verdict not_python) for as long as its parent did not wait -- what
bench/drain_scale.py's claim() saw for a workload that had died.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from flamed.sampling.cpython.process import Refusal, probe
from flamed.sampling.pysource import refusal_code


def _fake_proc(root: Path, pid: int, state: str) -> Path:
    d = root / str(pid)
    d.mkdir(parents=True)
    (d / "maps").write_text("")  # a zombie's maps: empty; no exe link
    fields = [state] + ["0"] * 50
    (d / "stat").write_text(f"{pid} (python3.12) {' '.join(fields)}\n")
    return root


def test_a_zombie_is_gone_not_not_python(tmp_path: Path) -> None:
    r = probe(4242, _fake_proc(tmp_path, 4242, "Z"))
    assert isinstance(r, Refusal)
    assert refusal_code(r.reason) == "gone", r.reason


def test_a_live_process_without_maps_is_still_not_python(tmp_path: Path) -> None:
    # A kernel thread: no maps, no exe, but alive.
    r = probe(4243, _fake_proc(tmp_path, 4243, "S"))
    assert isinstance(r, Refusal)
    assert refusal_code(r.reason) == "not_python", r.reason


def test_a_real_zombie_child() -> None:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        stat = Path(f"/proc/{p.pid}/stat")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and stat.read_bytes().rsplit(b")", 1)[1].split()[0] != b"Z":
            time.sleep(0.01)
        r = probe(p.pid)
        assert isinstance(r, Refusal)
        assert refusal_code(r.reason) == "gone", r.reason
    finally:
        p.wait(timeout=10)
