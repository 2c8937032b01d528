"""The stat fields of real tasks, and of comm names that hide the separators."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from flamed.procstat import read_stat, running, stat_fields


def test_fields_follow_the_last_parenthesis_of_a_hostile_comm() -> None:
    raw = b"4242 (a) b (c) S 1 4242 4242 0 -1 4194560 1 0 0 0 2 3 0 0 20 0 1 0 777 0\n"
    fields = stat_fields(raw)
    assert fields[0] == b"S" and fields[1] == b"1" and fields[19] == b"777"
    assert stat_fields(b"garbage without the name") == []
    assert stat_fields(b"12 (x)") == []


def test_a_real_process_is_running_until_it_is_a_zombie_then_gone(tmp_path: Path) -> None:
    me = read_stat(f"/proc/{os.getpid()}/stat")
    assert me is not None and me[0] == b"R" and int(me[1]) == os.getppid()
    # A child whose name holds ") X (": its state is still read right.
    child = subprocess.Popen([sys.executable, "-c",
                              "import ctypes,time; ctypes.CDLL(None).prctl(15, b'p) X (q', 0, 0, 0); time.sleep(30)"])
    try:
        stat = f"/proc/{child.pid}/stat"
        deadline = time.monotonic() + 10
        while b") X (" not in Path(stat).read_bytes() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert b"p) X (q" in Path(stat).read_bytes()
        assert running(stat) and read_stat(stat)[0] in (b"S", b"R")  # type: ignore[index]
        child.kill()
        deadline = time.monotonic() + 10
        while running(stat) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not running(stat) and read_stat(stat)[0] == b"Z"  # type: ignore[index]  # not yet reaped
    finally:
        child.kill()
        child.wait(10)
    assert read_stat(stat) is None and not running(stat)


def test_the_thread_group_of_a_process_and_of_one_of_its_threads() -> None:
    import threading

    from flamed.procstat import status_tgid

    me = os.getpid()
    assert status_tgid(Path(f"/proc/{me}/status").read_bytes()) == me
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait, args=(10,))
    worker.start()
    try:
        tid = worker.native_id
        assert tid is not None and tid != me
        assert status_tgid(Path(f"/proc/{me}/task/{tid}/status").read_bytes()) == me
    finally:
        stop.set()
        worker.join(10)
    assert status_tgid(b"Name:\tx\nPid:\t5\n") is None


def _kernel_thread_with_children() -> int | None:
    """kthreadd (the parent of every kernel thread), where /proc shows it."""
    for pid in (2,):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == "kthreadd":
                return pid
        except OSError:
            pass
    return None


def test_a_kernel_thread_is_told_and_its_children_are_not_called_the_work_it_left() -> None:
    """`record -p 2` said kthreadd "started pool_workqueue_release, which record does
    not follow (... s of CPU used by the processes it started)"."""
    from flamed.commands.record_daemon import TargetWatch
    from flamed.procstat import is_kernel_thread

    assert not is_kernel_thread(os.getpid())
    assert not is_kernel_thread(2 ** 22 + 1)  # no such pid
    kthreadd = _kernel_thread_with_children()
    if kthreadd is None:
        import pytest

        pytest.skip("no kthreadd in this PID namespace (pid 2)")
    assert is_kernel_thread(kthreadd)
    w = TargetWatch(kthreadd)
    w.update()
    assert (w.child, w.children_cpu_s, w.child_hint(daemon=False)) == ("", 0.0, "")
    # A user process's child is still named.
    kid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        me = TargetWatch(os.getpid())
        deadline = time.monotonic() + 10
        while not me.child and time.monotonic() < deadline:
            me.update()
            time.sleep(0.05)
        assert me.child, "a user process's child is named"
    finally:
        kid.kill()
        kid.wait()
