"""A state directory that fills up: the newest files are kept, the backlog is bounded, losses are counted.

A real daemon (fake sampler, so the run needs no BPF and fills the disk in
seconds) writes into a real 256 KiB tmpfs until it is full, then a ballast
file takes every page the daemon frees, so nothing of ours is left to delete
and the closed periods wait in memory until the budget drops them.  A real
SIGTERM ends it, and its last log line must add up.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemonproc import DaemonProc, profile_files, tmpfs

pytestmark = pytest.mark.concurrent

TMPFS_BYTES = 256 * 1024
BUDGET = 16 * 1024
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"


@pytest.fixture
def tmpfs_state(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "state"
    mnt.mkdir()
    with tmpfs(mnt, f"{TMPFS_BYTES // 1024}k"):
        yield mnt


def sidecars(state: Path) -> list[dict[str, Any]]:
    """The sidecars of the profile files present, oldest first (by their first window)."""
    out = []
    for f in profile_files(state):
        side = state / re.sub(r"\.folded(\.gz)?$", ".json", f.name)
        with contextlib.suppress(FileNotFoundError, ValueError):  # the daemon may delete it meanwhile
            out.append(json.loads(side.read_text()))
    return sorted(out, key=lambda m: m["start_ns"])


def used_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def fill_until_full(ballast: Path) -> None:
    """Write to ``ballast`` until the file system has no page left."""
    with open(ballast, "ab", buffering=0) as f:
        while True:
            try:
                f.write(b"\0" * 4096)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                return


def test_full_disk_keeps_the_newest_files_and_counts_what_it_drops(daemon_factory: Any,
                                                                   tmpfs_state: Path) -> None:
    d: DaemonProc = daemon_factory(
        sampling={"sampler": "fake", "frequency": 200, "drain_interval": 0.1},
        output={"state_dir": str(tmpfs_state), "rotate_interval": 0.1, "backlog_max_bytes": BUDGET,
                "fsync": False},
        retention={"max_files": 0, "max_bytes": 0, "max_age": 0},
    )
    # 1. The daemon alone fills the tmpfs (a file and its sidecar take two 4 KiB pages: ~32 files).
    d.wait_for(lambda: d.metric("flamed_write_errors_total", {"errno": "ENOSPC"}) > 0
               or d.metric("flamed_files_deleted_total", {"reason": "disk_full"}) > 0, 30, "a full disk")
    peak = 0
    deadline = time.monotonic() + 4
    while time.monotonic() < deadline:
        peak = max(peak, used_bytes(tmpfs_state))
        time.sleep(0.05)
    text = d.metrics_text()
    deleted = d.metric("flamed_files_deleted_total", {"reason": "disk_full"}, text)
    assert deleted > 0, f"nothing deleted to make room:\n{d.log()[-2000:]}"
    assert d.metric("flamed_files_deleted_bytes_total", {"reason": "disk_full"}, text) > 0
    assert d.metric("flamed_samples_lost_total", {"reason": "backlog_full"}, text) == 0
    assert peak <= TMPFS_BYTES
    # The files present are the newest, one unbroken run of periods up to now.
    kept = sidecars(tmpfs_state)
    assert len(kept) >= 10, [m["file"] for m in kept]
    assert time.time_ns() - kept[-1]["end_ns"] < 2e9, "the newest file is not recent: old files were kept"
    for a, b in zip(kept, kept[1:]):
        assert b["start_ns"] == a["end_ns"], f"gap between {a['file']} and {b['file']}: a newer file was not kept"
    assert d.status()["write_error"] is None
    # Logged once for the whole episode, not once per file.
    assert len(re.findall(r"is full \(.*\): deleting the oldest profile files", d.log())) == 1, d.log()[-3000:]
    files_kept = len(kept)

    # 2. Another program takes every page: nothing of ours is left to delete, the backlog is bounded.
    # Set up with the daemon stopped (SIGSTOP), so that the ballast does not race its
    # deletions page by page (a loaded host let the daemon win that race for 30 s):
    # its files go, the ballast takes every page, then it runs on a disk it cannot free.
    d.signal(signal.SIGSTOP)
    try:
        for f in profile_files(tmpfs_state):
            side = tmpfs_state / (re.sub(r"\.folded(\.gz)?$", "", f.name) + ".json")
            for g in (f, side):
                with contextlib.suppress(FileNotFoundError):
                    g.unlink()
        fill_until_full(tmpfs_state / "ballast")
    finally:
        d.signal(signal.SIGCONT)
    d.wait_for(lambda: not profile_files(tmpfs_state) and d.status()["backlog"]["files"] >= 2, 30,
               "the ballast to take the whole disk")
    rss0 = d.rss_bytes()
    d.wait_for(lambda: d.metric("flamed_samples_lost_total", {"reason": "backlog_full"}) > 0, 20,
               "the backlog budget to drop a file")
    time.sleep(5)
    rss1 = d.rss_bytes()
    text = d.metrics_text()
    st = d.status()
    assert st["write_error"] and "space" in st["write_error"].lower(), st["write_error"]
    backlog = d.metric("flamed_backlog_bytes", None, text)
    assert 0 < backlog <= BUDGET + 4096, backlog
    assert rss1 - rss0 < 8 * 1024 * 1024, (rss0, rss1)
    produced = d.metric("flamed_samples_total", None, text)
    written = d.metric("flamed_samples_written_total", None, text)
    lost = d.metric("flamed_samples_lost_total", {"reason": "backlog_full"}, text)
    # What is neither written nor counted lost is what waits in memory: the backlog and the open period.
    waiting = produced - written - lost
    per_period = 200 * 0.1 * 3
    assert 0 <= waiting <= (d.metric("flamed_backlog_files", None, text) + 2) * per_period, (produced, written, lost)

    # 3. SIGTERM with the disk still full: the last line adds up, nothing is silently gone.
    d.signal(signal.SIGTERM)
    assert d.wait_exit(60) == 0
    log = d.log()
    m = re.search(r"stopping: (\d+) samples drained since start: (\d+) in profile files written, (\d+) lost on the way to them "
                  r"\((\d+) dropped from the backlog over output.backlog_max_bytes=\d+, (\d+) in (\d+) profile "
                  r"file\(s\), \d+ bytes, that could not be written at exit", log)
    assert m, log[-3000:]
    taken, written_end, lost_end, dropped_end, unwritten_end, files_end = map(int, m.groups())
    assert taken == written_end + lost_end and lost_end == dropped_end + unwritten_end
    assert taken >= produced and written_end >= written and dropped_end >= lost
    assert unwritten_end > 0 and files_end >= 1
    assert "exiting with" not in log
    assert not re.search(r"\b0 lost\b", log), log[-3000:]
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "full_disk.json").write_text(json.dumps({
        "tmpfs_bytes": TMPFS_BYTES, "backlog_max_bytes": BUDGET, "peak_used_bytes": peak,
        "files_kept_when_full": files_kept, "files_deleted_disk_full_first_4s": deleted,
        "backlog_bytes_when_stuck": backlog, "rss_bytes": rss1, "rss_growth_5s_bytes": rss1 - rss0,
        "samples_taken": taken, "samples_written": written_end, "samples_lost": lost_end,
        "lost_backlog_full": dropped_end, "lost_unwritten_at_exit": unwritten_end,
    }, indent=2, sort_keys=True) + "\n")


def test_merge_sort_into_a_full_tmpfs_is_an_error(tmp_path: Path, tmpfs_state: Path) -> None:
    """--sort's runs on a file system that fills up (a real 256 KiB tmpfs):
    an error naming the directory and the cause, no traceback, no output."""
    import io

    from flamed.cli import main

    trace = tmp_path / "big.trace"
    with open(trace, "w") as f:
        f.write("# flamed trace\n")
        for i in range(20000):  # ~1 MB of runs pickled: four times the tmpfs
            f.write(f"{(20000 - i) * 1000} app-1/1;main;function_{i % 97};leaf_{i} 1\n")
    out = tmp_path / "sorted.trace"
    err = io.StringIO()
    rc = main(["merge", "--sort", "--sort-run", "1000", "--tmpdir", str(tmpfs_state), str(trace), "-o", str(out)], stderr=err)
    assert rc == 1, err.getvalue()
    assert f"--sort cannot write its sorted runs to {tmpfs_state}: No space left on device" in err.getvalue()
    assert "Traceback" not in err.getvalue() and not out.exists()
    assert os.listdir(tmpfs_state) == []  # the runs written are gone with the error


@pytest.mark.parametrize("unbuffered", ["", "1"], ids=["buffered", "PYTHONUNBUFFERED"])
def test_stdout_on_a_full_disk_is_an_error(tmp_path: Path, tmpfs_state: Path, unbuffered: str) -> None:
    """`flamed svg in.folded > full/out.svg`: standard output on a file system
    that fills up (a real 256 KiB tmpfs, a 746 KB graph) is an error naming
    standard output and exit 1. It was a traceback; under PYTHONUNBUFFERED
    (python -u, containers) it was worse: the first 256 KiB written, the rest
    dropped, exit 0."""
    import subprocess
    import sys

    from support import ROOT

    deep = tmp_path / "deep.folded"
    deep.write_text(";".join(f"frame_{i}" for i in range(5000)) + " 7\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if unbuffered:
        env["PYTHONUNBUFFERED"] = unbuffered
    with open(tmpfs_state / "out.svg", "wb") as out:
        r = subprocess.run([sys.executable, "-m", "flamed", "svg", str(deep)], stdout=out, stderr=subprocess.PIPE,
                           env={**env, "PYTHONPATH": str(ROOT)}, cwd=ROOT, timeout=120, check=False)
    err = r.stderr.decode()
    assert r.returncode == 1, err
    assert err == "flamed svg: error: cannot write to standard output: No space left on device\n", err


@pytest.mark.parametrize("unbuffered", ["", "1"], ids=["buffered", "PYTHONUNBUFFERED"])
def test_print_bpf_on_a_full_disk_is_an_error(tmp_path: Path, unbuffered: str) -> None:
    """`flamed daemon --print-bpf > full/prog.c` (a real 32 KiB tmpfs, a ~70 KB
    program): an error naming standard output and exit 1. It was a traceback,
    and under PYTHONUNBUFFERED the first 32 KiB with exit 0."""
    import subprocess
    import sys

    from support import ROOT

    mnt = tmp_path / "small"
    mnt.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if unbuffered:
        env["PYTHONUNBUFFERED"] = unbuffered
    whole = subprocess.run([sys.executable, "-m", "flamed", "daemon", "--print-bpf"], capture_output=True,
                           env={**env, "PYTHONPATH": str(ROOT)}, cwd=ROOT, timeout=120, check=True)
    assert len(whole.stdout) > 64 * 1024 and b"flamed BPF program" in whole.stdout
    with tmpfs(mnt, "32k"), open(mnt / "prog.c", "wb") as out:
        r = subprocess.run([sys.executable, "-m", "flamed", "daemon", "--print-bpf"], stdout=out,
                           stderr=subprocess.PIPE, env={**env, "PYTHONPATH": str(ROOT)}, cwd=ROOT, timeout=120,
                           check=False)
    err = r.stderr.decode()
    assert r.returncode == 1, err
    assert err == "flamed daemon: error: cannot write to standard output: No space left on device\n", err


def test_a_file_larger_than_the_disk_leaves_gauges_that_match_the_directory(tmp_path: Path) -> None:
    """A closed period bigger than the whole (real, 64 KiB) tmpfs: every older file is deleted
    to make room, the write still fails and the period waits in memory.  flamed_disk_files
    and flamed_disk_bytes then say what is left (nothing), as `flamed status` does; they
    kept counting the deleted files until the next file was written."""
    from flamed.daemon.config import OutputConfig, RetentionConfig
    from flamed.daemon.metrics import DaemonMetrics
    from flamed.daemon.store import ProfileStore

    s = 1_000_000_000
    t0 = 1_700_000_000 * s
    mnt = tmp_path / "small"
    mnt.mkdir()
    with tmpfs(mnt, "64k"):
        m = DaemonMetrics(process=False)
        st = ProfileStore(OutputConfig(state_dir=str(mnt), host="h1", rotate_interval=60.0, fsync=False),
                          RetentionConfig(max_files=0, max_bytes=0, max_age=0), m)
        for i in range(3):
            st.add(t0 + i * 60 * s, t0 + (i + 1) * 60 * s, {(7, 7, "app", ("main", "spin")): 5}, 5, {}, 19.0)
            assert st.rotate() is not None
        assert m.registry.get_sample_value("flamed_disk_files") == 3
        # ~200 KB of distinct stacks: more than the whole file system
        big = {(7, 7, "app", ("main", f"function_with_a_long_name_{n:06d}" * 4)): 1 for n in range(2000)}
        st.add(t0 + 180 * s, t0 + 240 * s, big, len(big), {}, 19.0)
        assert st.rotate() is None and len(st.backlog) == 1
        assert st.list_files() == []
        assert m.registry.get_sample_value("flamed_files_deleted_total", {"reason": "disk_full"}) == 3
        assert m.registry.get_sample_value("flamed_disk_files") == 0
        assert m.registry.get_sample_value("flamed_disk_bytes") == 0
        assert not [n for n in os.listdir(mnt) if n.endswith(".tmp")]
