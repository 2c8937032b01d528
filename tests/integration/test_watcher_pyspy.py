"""The watcher on the real proc connector, and the py-spy supervisor with real py-spy."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flamed.pyspy.supervisor import Failure, PySpyOptions, PySpySupervisor, classify
from flamed.pyspy.watcher import ProcessWatcher, PyProcess, WatchOptions
from support import need

pytestmark = pytest.mark.pyspy


def wait_for(cond, timeout: float, step) -> bool:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        step()
        if cond():
            return True
    return False


RENAMER = r"""
import ctypes, sys, time
libc = ctypes.CDLL(None)
n = 0
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    n += 1
    libc.prctl(15, f"r{n}".encode(), 0, 0, 0)  # PR_SET_NAME: one comm event each
print(n, flush=True)
"""


def test_a_process_renaming_itself_costs_the_watcher_nothing() -> None:
    """A process renaming its threads in a loop sends the proc connector a comm
    event per rename: ~40,000 a second here, each read and dropped by the
    watcher (25 % of a core in the daemon's mixed-mode thread).  On a kernel
    that filters (6.6+) the watcher asks for fork, exec and exit only."""
    from flamed.pyspy.watcher import connector_filters

    need(os.geteuid() == 0, "root (CAP_NET_ADMIN) for the proc connector")
    need(connector_filters(), f"a kernel whose proc connector filters events (6.6+; this is {os.uname().release})")
    started: list[PyProcess] = []
    w = ProcessWatcher(WatchOptions(scan_interval_s=3600), on_start=started.append)
    w.start()
    try:
        assert w.stats.connector and w.stats.connector_filtered
        p = subprocess.Popen([sys.executable, "-c", RENAMER, "1.5"], stdout=subprocess.PIPE, text=True)
        assert wait_for(lambda: p.poll() is not None, 20, lambda: w.poll(0.05))
        w.poll(0.2)
        renames = int(p.stdout.read()) if p.stdout else 0
        assert renames > 1000, renames
        # fork, exec and exit of the renamer (and whatever else the host ran meanwhile)
        assert any(s.pid == p.pid for s in started)
        assert w.stats.datagrams < renames / 20, (w.stats.datagrams, renames)
    finally:
        w.close()


def test_watcher_sees_exec_and_exit_by_connector() -> None:
    need(os.geteuid() == 0, "root (CAP_NET_ADMIN) for the proc connector")
    started: list[PyProcess] = []
    exited: list[int] = []
    # scans far apart: what is seen comes from the connector's events
    w = ProcessWatcher(WatchOptions(scan_interval_s=3600), on_start=started.append, on_exit=exited.append)
    w.start()
    try:
        assert w.stats.connector
        t0 = time.monotonic_ns()
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
        assert wait_for(lambda: any(s.pid == p.pid for s in started), 5, lambda: w.poll(0.05))
        s = next(s for s in started if s.pid == p.pid)
        assert s.how == "exe" and s.version == f"{sys.version_info[0]}.{sys.version_info[1]}"
        assert t0 <= s.seen_ns <= time.monotonic_ns()  # the kernel's CLOCK_MONOTONIC timestamp
        p.wait()
        assert wait_for(lambda: p.pid in exited, 5, lambda: w.poll(0.05))
        assert p.pid not in w.watched
        # a Python process that forks (prefork servers) has a Python child
        code = "import os, time\npid = os.fork()\nif pid == 0: time.sleep(0.4); os._exit(0)\nos.waitpid(pid, 0)"
        q = subprocess.Popen([sys.executable, "-c", code])
        assert wait_for(lambda: any(x.how == "fork" and x.pid != q.pid for x in started), 5, lambda: w.poll(0.05))
        q.wait()
    finally:
        w.close()



def test_classify() -> None:
    assert classify(0, "", True, False) is None
    assert classify(1, "Permission Denied: Try running again with elevated permissions", True, False) is Failure.PERMISSION
    assert classify(1, "Error: Failed to find python version from target process", True, False) is Failure.UNSUPPORTED
    assert classify(1, "Error: Failed to get process executable name. Check that the process is running.", False,
                    False) is Failure.TARGET_EXITED
    assert classify(-11, "", True, False) is Failure.CRASH
    assert classify(-9, "", True, True) is Failure.TIMEOUT
    # without CAP_SYS_PTRACE py-spy's reads fail in many words; a live target means permission
    assert classify(1, "Error: Failed to find python version from target process", True, False,
                    can_ptrace=False) is Failure.PERMISSION
    assert classify(1, "Error: Check that the process is running.", False, False,
                    can_ptrace=False) is Failure.TARGET_EXITED


def pyspy_children() -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
                comm = (d / "comm").read_text().strip()
            except OSError:
                continue
            if comm == "py-spy" and int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():
                out.append(int(d.name))
    return out


def test_supervisor_counts_reasons_and_leaves_no_child(require_pyspy: str) -> None:
    # Without the daemon's py-spy clock nothing says when py-spy samples: a
    # window ends attach_timeout_s after its start at the earliest (2 s here, not 5).
    sup = PySpySupervisor(PySpyOptions(binary=require_pyspy, window_s=0.6, backoff_s=0.2, min_age_s=0,
                                       attach_timeout_s=2.0))
    py = subprocess.Popen([sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<20: sum(range(999))"])
    sleeper = subprocess.Popen(["sleep", "5"])
    runs = []
    try:
        assert sup.add(py.pid) and sup.add(sleeper.pid)
        # bounded: rotations need py-spy to attach, which a loaded host slows down
        end = time.monotonic() + 20
        while time.monotonic() < end and len([r for r in runs if r.pid == py.pid]) < 2:
            runs += sup.tick()
            time.sleep(0.05)
        assert sup.failures[Failure.UNSUPPORTED.value] >= 1  # `sleep` is no Python
        assert len([r for r in runs if r.pid == py.pid]) >= 2  # windows rotate
        for r in runs:
            assert r.trace.threads and r.trace.first_ts_us is not None
    finally:
        runs += sup.close()
        py.kill()
        sleeper.kill()
        py.wait()
        sleeper.wait()
    assert pyspy_children() == []
    assert sup.running() == 0


def test_supervisor_missing_binary_is_counted() -> None:
    sup = PySpySupervisor(PySpyOptions(binary="/nonexistent/py-spy", min_age_s=0))
    assert sup.binary is None
    assert sup.add(os.getpid())
    assert sup.failures[Failure.MISSING_BINARY.value] == 1
    sup.close()


def test_pyspy_dies_with_its_parent(require_pyspy: str, tmp_path: Path) -> None:
    # A parent that starts a py-spy child and is SIGKILLed: PR_SET_PDEATHSIG takes the child along.
    script = tmp_path / "parent.py"
    script.write_text(
        "import sys, time\n"
        "from flamed.pyspy.supervisor import PySpyOptions, PySpySupervisor\n"
        f"sup = PySpySupervisor(PySpyOptions(binary={require_pyspy!r}, min_age_s=0))\n"
        "sup.add(int(sys.argv[1]))\n"
        "print(sup._targets[int(sys.argv[1])].children[0].proc.pid, flush=True)\n"
        "time.sleep(60)\n")
    target = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    parent = subprocess.Popen([sys.executable, str(script), str(target.pid)], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parents[2])
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert Path(f"/proc/{child}").exists()
        parent.kill()
        parent.wait()
        gone = wait_for(lambda: not Path(f"/proc/{child}").exists() or
                        Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z",
                        5, lambda: time.sleep(0.05))
        assert gone
    finally:
        target.kill()
        target.wait()
