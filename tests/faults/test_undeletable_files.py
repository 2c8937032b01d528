"""A profile file that cannot be deleted (immutable: `chattr +i`, as an
administrator keeping one file as evidence would do) neither stops the daemon
nor the deletions that keep its directory bounded.

Retention and a full disk pass over it to the next oldest file; the refusal is
logged once and counted in flamed_delete_errors_total.  Until then the first
such refusal escaped the retention and killed the daemon (at a rotation, a
reload or at start), and on a full disk every write failed with EPERM.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemonproc import DaemonProc, check_state_dir, profile_files, tmpfs

pytestmark = pytest.mark.concurrent

HOST = "testhost"
OLD = f"{HOST}-20200101T000000Z"


def _chattr(flag: str, path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["chattr", flag, str(path)], capture_output=True, text=True, timeout=30)


@contextlib.contextmanager
def immutable_old_file(state: Path) -> Iterator[Path]:
    """An old profile file of this host (with its sidecar) in ``state``, made immutable; mutable again after."""
    if shutil.which("chattr") is None:
        pytest.skip("missing: chattr (e2fsprogs)")
    state.mkdir(exist_ok=True)
    folded = state / f"{OLD}.folded"
    data = b"kept-1;main;spin 3\n"
    folded.write_bytes(data)
    (state / f"{OLD}.json").write_text(json.dumps({
        "file": folded.name, "format": "folded", "host": HOST, "samples": 3, "weight": 3, "stacks": 1, "lost": {},
        "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}))
    r = _chattr("+i", folded)
    if r.returncode != 0:
        pytest.skip(f"missing: the immutable flag on this file system ({r.stderr.strip()})")
    try:
        yield folded
    finally:
        _chattr("-i", folded)


def _config(state: Path, **retention: Any) -> dict[str, Any]:
    return {
        "sampling": {"sampler": "fake", "frequency": 200, "drain_interval": 0.1},
        "output": {"state_dir": str(state), "rotate_interval": 0.1, "host": HOST, "fsync": False},
        "retention": {"max_files": 0, "max_bytes": 0, "max_age": 0, **retention},
    }


def test_retention_passes_over_a_file_it_cannot_delete(daemon_factory: Any, tmp_path: Path) -> None:
    state = tmp_path / "state"
    with immutable_old_file(state) as kept:
        d: DaemonProc = daemon_factory(**_config(state, max_files=3))
        # Several rotations, each with retention over the limit, the oldest file refusing.
        d.wait_for(lambda: d.metric("flamed_retention_deletions_total", {"reason": "max_files"}) >= 5, 30,
                   "retention deleting the files after the one it cannot delete")
        text = d.metrics_text()
        assert d.metric("flamed_delete_errors_total", {"errno": "EPERM"}, text) >= 1
        assert kept.exists() and (state / f"{OLD}.json").exists()
        # The limit holds, the file that refused counted in it.
        assert d.metric("flamed_disk_files", text=text) <= 3
        assert len(profile_files(state)) <= 4  # and perhaps one written since the scrape
        # A reload applies retention at once: it must not take the daemon down either.
        d.signal(signal.SIGHUP)
        d.wait_for(lambda: d.metric("flamed_config_reloads_total", {"result": "ok"}) >= 1, 30, "the reload")
        written = d.metric("flamed_files_written_total")
        d.wait_for(lambda: d.metric("flamed_files_written_total") > written + 2, 30, "files after the reload")
        d.signal(signal.SIGTERM)
        assert d.wait_exit(30) == 0
        log = d.log()
        assert "Traceback" not in log
        assert log.count(f"cannot delete {kept}") == 1, log[-3000:]
        assert kept.exists()
    check_state_dir(state)


def test_a_full_disk_makes_room_past_a_file_it_cannot_delete(daemon_factory: Any, tmp_path: Path) -> None:
    mnt = tmp_path / "state"
    mnt.mkdir()
    with tmpfs(mnt, "256k"), immutable_old_file(mnt) as kept:
        d: DaemonProc = daemon_factory(**_config(mnt))
        d.wait_for(lambda: d.metric("flamed_files_deleted_total", {"reason": "disk_full"}) >= 3, 30,
                   "files deleted to make room on the full tmpfs")
        text = d.metrics_text()
        assert d.metric("flamed_write_errors_total", {"errno": "EPERM"}, text) == 0
        assert d.metric("flamed_delete_errors_total", {"errno": "EPERM"}, text) >= 1
        assert d.status()["write_error"] is None
        d.signal(signal.SIGTERM)
        assert d.wait_exit(30) == 0
        assert kept.exists() and "Traceback" not in d.log()
        assert check_state_dir(mnt)
