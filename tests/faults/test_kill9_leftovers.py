"""kill -9 of a daemon running py-spy: its trace files stay under its runtime directory, not /tmp,
and the next daemon removes them (only those whose owner is gone)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from daemonproc import BUSY
from test_mixed_faults import _mixed_daemon, _stop_busy, cgroup, in_cgroup, resources  # noqa: F401 - cgroup: fixture

pytestmark = [pytest.mark.bpf, pytest.mark.pyspy, pytest.mark.slow]


def tmp_pyspy_dirs() -> set[str]:
    return {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("flamed-pyspy-")}


def ours(names: set[str], pids: set[int]) -> set[str]:
    """Those of ``names`` our daemons made: named after one of ``pids``, or not named after any
    (other tests running beside this one make theirs, named after their own pid)."""
    out = set()
    for n in names:
        m = re.match(r"^flamed-pyspy-(\d+)-", n)
        if m is None or int(m.group(1)) in pids:
            out.add(n)
    return out


def test_kill9_leftovers_are_under_the_runtime_dir_and_removed_at_next_start(
        require_bpf: None, require_pyspy: str, daemon_factory: Any, cgroup: str, tmp_path: Path) -> None:  # noqa: F811
    in_tmp_before = tmp_pyspy_dirs()
    pids: set[int] = set()
    runtime = tmp_path / "run" / "pyspy"
    # An unrelated live process's directory (this test's pid) must survive the cleanup.
    runtime.mkdir(parents=True)
    alive = runtime / f"flamed-pyspy-{os.getpid()}-keepme12"
    alive.mkdir()
    d = _mixed_daemon(daemon_factory, cgroup, window_s=30.0)
    busy = [subprocess.Popen([sys.executable, "-c", BUSY], preexec_fn=in_cgroup(cgroup))]
    try:
        d.wait_for(lambda: resources(d)["pyspy_running"] == 1, 60, "py-spy on the busy process")
        mine = runtime / f"flamed-pyspy-{d.pid}"
        d.wait_for(lambda: [p for p in runtime.iterdir() if p.name.startswith(mine.name + "-")], 10,
                   "the daemon's py-spy work directory under its runtime directory")
        first_pid = d.pid
        pids.add(first_pid)
        d.kill9()
        left = [p for p in runtime.iterdir() if p.name.startswith(f"flamed-pyspy-{first_pid}-")]
        assert len(left) == 1 and any(left[0].iterdir()), "kill -9 left no py-spy files to clean up"
        # The next daemon (same configuration) removes what the dead one left, and only that.
        d2 = _mixed_daemon(daemon_factory, cgroup, name="daemon2", window_s=30.0)
        pids.add(d2.pid)
        d2.wait_for(lambda: not left[0].exists(), 60, "the stale py-spy directory to be removed")
        assert alive.exists(), "a live process's directory was removed"
        assert "work directory left by processes that no longer run" in d2.log(), d2.log()[-2000:]
        d2.signal(signal.SIGTERM)
        assert d2.wait_exit(90) == 0
        # A clean stop removes its own directory.
        assert not [p for p in runtime.iterdir() if p.name.startswith(f"flamed-pyspy-{d2.pid}-")]
    finally:
        _stop_busy(busy)
    assert ours(tmp_pyspy_dirs() - in_tmp_before, pids) == set(), "py-spy files in /tmp"
