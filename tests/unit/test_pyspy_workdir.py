"""py-spy work directories: named after their owner, stale ones (owner gone) removed at the next start."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from flamed.pyspy.supervisor import private_workdir, remove_stale_workdirs


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_private_workdir_is_named_after_this_process_and_removes_dead_owners_only(tmp_path: Path) -> None:
    parent = tmp_path / "run" / "pyspy"
    parent.mkdir(parents=True)
    stale = parent / f"flamed-pyspy-{dead_pid()}-abcd1234"
    stale.mkdir()
    (stale / "pyspy-1-1.err").write_text("")
    live = parent / f"flamed-pyspy-{os.getppid()}-live0000"
    live.mkdir()
    other = parent / "flamed-pyspy-notours"  # no owner pid in the name: not ours to judge
    other.mkdir()
    d = private_workdir(str(parent))
    assert Path(d).parent == parent and Path(d).name.startswith(f"flamed-pyspy-{os.getpid()}-")
    assert not stale.exists() and live.exists() and other.exists()
    # This process's own directory is never stale.
    assert remove_stale_workdirs(str(parent)) == [] and Path(d).exists()


def test_private_workdir_creates_its_parent(tmp_path: Path) -> None:
    d = private_workdir(str(tmp_path / "a" / "b"))
    assert Path(d).is_dir() and oct(os.stat(tmp_path / "a" / "b").st_mode & 0o777) == "0o700"
