"""The drain loop's wake-up: an eventfd that signal handlers may set (no lock), polled
(so an fd past select's 1,024, on a host with many CPUs' perf events, still works);
and the watchers' wait on the proc connector, polled too."""

from __future__ import annotations

import os
import resource
import signal
import threading
import time

import pytest

from flamed.daemon.loop import Wakeup
from flamed.pyspy.watcher import wait_readable


def test_set_wakes_a_wait_and_clear_resets_it() -> None:
    w = Wakeup()
    t0 = time.monotonic()
    assert w.wait(0.05) is False
    assert time.monotonic() - t0 >= 0.04
    w.set()
    w.set()
    assert w.wait(5.0) is True
    w.clear()
    assert w.wait(0.0) is False
    threading.Timer(0.05, w.set).start()
    t0 = time.monotonic()
    assert w.wait(5.0) is True
    assert time.monotonic() - t0 < 4.0


def test_a_signal_handler_sets_it_while_the_loop_waits() -> None:
    w = Wakeup()
    old = signal.signal(signal.SIGUSR1, lambda *_: w.set())
    try:
        threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        assert w.wait(5.0) is True
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_an_fd_past_1024_still_waits() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < 1200: cannot open an fd past 1,024")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held: list[int] = []
    try:
        r = os.open("/dev/null", os.O_RDONLY)
        held.append(r)
        while held[-1] < 1030:
            held.append(os.dup(r))
        w = Wakeup()
        assert w.fd > 1024
        assert w.wait(0.01) is False
        w.set()
        assert w.wait(1.0) is True
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_watchers_wait_names_the_readable_fds_and_refuses_a_closed_one() -> None:
    r, w = os.pipe()
    r2, w2 = os.pipe()
    try:
        assert wait_readable([r, r2], 0.01) == []
        os.write(w2, b"x")
        assert wait_readable([r, r2], 1.0) == [r2]
    finally:
        for fd in (r, w, r2, w2):
            os.close(fd)
    # A closed fd is an error, as select made it (the caller then ticks), not an instant return.
    with pytest.raises(OSError):
        wait_readable([r], 1.0)
