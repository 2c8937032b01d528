"""pthread ids to OS tids by reading a live process's memory: this test process's own threads."""

from __future__ import annotations

import os
from pathlib import Path
import threading

from flamed.pyspy.threadids import ThreadIds


def test_maps_the_pthread_ids_of_a_live_process_to_its_os_tids() -> None:
    stop = threading.Event()
    started = threading.Barrier(4)

    def wait() -> None:
        started.wait(10)
        stop.wait(30)

    threads = [threading.Thread(target=wait) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        started.wait(10)
        # threading's ident is pthread_self(), what py-spy names before 3.11; native_id is the OS tid
        want = {t.ident: t.native_id for t in threads} | {threading.get_ident(): threading.get_native_id()}
        ids = ThreadIds()
        got, why = ids.resolve(os.getpid(), list(want))
        assert why is None and got == want
        assert ids.counters["mapped"] == 4 and ids.counters["unmapped"] == 0
    finally:
        stop.set()
        for t in threads:
            t.join(10)


def test_says_why_when_the_process_is_gone() -> None:
    ids = ThreadIds()
    got, why = ids.resolve(2**22 + 1, [0x7F0000000000])  # above any pid_max: no such process
    assert got == {} and why is not None and "exited" in why
    assert ids.counters["unmapped"] == 1


def test_namespaced_tids_map_to_host_tids(tmp_path: Path) -> None:
    """A process in a PID namespace: py-spy's tids are the namespace's, mapped
    to host tids through each task's NSpid line (a fake /proc)."""
    from flamed.pyspy.chrometrace import PyTrace
    from flamed.pyspy.threadids import ThreadIds

    for host, inner in ((4242, 1), (4250, 7)):
        d = tmp_path / "4242" / "task" / str(host)
        d.mkdir(parents=True)
        (d / "status").write_text(f"Name:\tpython3\nNSpid:\t{host}\t{inner}\n")
    ids = ThreadIds(proc_root=str(tmp_path))
    assert ids.namespaced(4242)
    trace = PyTrace()
    trace.threads = {1: [(0, ("main",))], 7: [(0, ("worker",))], 99: [(0, ("gone",))]}
    trace.thread_names = {1: "MainThread", 7: "worker"}
    assert ids.rekey(4242, trace) is None
    assert set(trace.threads) == {4242, 4250, 99}
    assert trace.thread_names == {4242: "MainThread", 4250: "worker"}


def test_host_process_is_not_namespaced(tmp_path: Path) -> None:
    from flamed.pyspy.threadids import ThreadIds

    d = tmp_path / "77" / "task" / "77"
    d.mkdir(parents=True)
    (d / "status").write_text("Name:\tpython3\nNSpid:\t77\n")
    assert not ThreadIds(proc_root=str(tmp_path)).namespaced(77)


CHILD = """\
import sys, threading
stop = threading.Event()
threads = [threading.Thread(target=stop.wait, args=(60,)) for _ in range(3)]
for t in threads:
    t.start()
ids = [(threading.get_ident(), threading.get_native_id())] + [(t.ident, t.native_id) for t in threads]
print(" ".join(f"{a}:{b}" for a, b in ids), flush=True)
sys.stdin.read()
"""


def test_threads_tracked_while_the_process_runs_are_mapped_after_it_exits() -> None:
    """``track`` maps each live thread's pthread id (get_robust_list, then the
    thread control block below it) without py-spy's ids: a trace that
    arrives once the process has exited still finds its threads."""
    import platform
    import subprocess
    import sys

    from support import need

    need(platform.machine() == "x86_64", "x86-64 (the thread control block's layout is known there)")
    p = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        want = {int(a): int(b) for a, b in (pair.split(":") for pair in p.stdout.readline().split())}
        ids = ThreadIds()
        reads: list[int] = []
        nspid = ids._nspid
        ids._nspid = lambda pid, tid: reads.append(tid) or nspid(pid, tid)  # type: ignore[method-assign]
        assert ids.track(p.pid) == len(want)
        assert ids.track(p.pid) == 0  # nothing new: nothing read again
        assert not ids.namespaced(p.pid)
        # A host process: one task's status settles that, for good (not one read per new thread).
        assert len(reads) == 1, reads
    finally:
        p.kill()
        p.wait(10)
    got, why = ids.resolve(p.pid, list(want))
    assert why is None and got == want
    assert ids.counters["mapped"] == len(want) and ids.counters["unmapped"] == 0


SUCCESSIVE = """\
import os, sys, threading, time
def one():
    print(threading.get_ident(), threading.get_native_id(), flush=True)
    sys.stdin.readline()
for _ in range(2):
    t = threading.Thread(target=one)
    t.start()
    t.join()
    # join() returns before the (detached) thread has left the kernel; glibc reuses its
    # stack, and so its pthread id, only once it has.
    end = time.monotonic() + 10
    while len(os.listdir("/proc/self/task")) > 1 and time.monotonic() < end:
        time.sleep(0.01)
sys.stdin.readline()
"""


def test_threads_that_had_one_pthread_id_in_turn_all_get_its_changes() -> None:
    """glibc gives a new thread the struct pthread of one that was joined: two
    threads one after the other have one pthread id.  A py-spy trace names
    that id once, and both threads (each tracked while it ran) get its changes."""
    import platform
    import subprocess
    import sys

    from flamed.pyspy.chrometrace import PyTrace
    from support import need

    need(platform.machine() == "x86_64", "x86-64 (the thread control block's layout is known there)")
    p = subprocess.Popen([sys.executable, "-c", SUCCESSIVE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    ids = ThreadIds()
    seen: list[tuple[int, int]] = []
    try:
        assert p.stdin is not None and p.stdout is not None
        for _ in range(2):
            ident, native = (int(x) for x in p.stdout.readline().split())
            seen.append((ident, native))
            assert ids.track(p.pid) >= 1
            p.stdin.write("\n")
            p.stdin.flush()
        assert seen[0][0] == seen[1][0] and seen[0][1] != seen[1][1], seen  # one id, two threads
        trace = PyTrace()
        ptid = seen[0][0]
        trace.threads = {ptid: [(0, ("one",))]}
        trace.thread_names = {ptid: "Thread-1"}
        trace.pthread_ids = {ptid}
        assert ids.rekey(p.pid, trace) is None
    finally:
        p.kill()
        p.wait(10)
    assert set(trace.threads) == {seen[0][1], seen[1][1]}
    assert trace.thread_names == {seen[0][1]: "Thread-1", seen[1][1]: "Thread-1"}
    assert trace.unmapped == 0
