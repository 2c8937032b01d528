"""Ground truth for off-CPU profiles: threads that wait in distinctly named
functions, each measuring its own off-CPU time (wall time minus the thread's
CPU time, so a preempted stretch counts as it does for the profiler).

    python offcpu_truth.py [SECONDS] [LONG_SLEEP] [gil]

Threads, each in its own function for about SECONDS (default 3):
``truth_sleep`` sleeps 20 ms at a time; ``truth_lock_wait`` takes a lock that
``truth_lock_hold`` keeps for 30 ms at a time (sleeping while it holds it);
``truth_pipe_read`` blocks reading a pipe that ``truth_pipe_feed`` writes every
25 ms; ``truth_long_sleep`` sleeps LONG_SLEEP seconds once (default 3: across
several drains).  With ``gil``, two more threads compute in pure Python in
``truth_gil_spin_a`` and ``truth_gil_spin_b``: they contend for the GIL, so
their off-CPU time is mostly waiting for it.  The main thread waits for them
all in ``truth_main_join``.
It first computes for 0.3 s in ``truth_warmup`` (on a CPU, so the sampler has
seen the process before its first wait).  At the end it prints one JSON line:
``{"blocked_s": {function: seconds off the CPU}, "pid": PID}``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable

_blocked: dict[str, float] = {}
_guard = threading.Lock()


def _measure(name: str, body: Callable[[], None]) -> None:
    """Run ``body`` and add its off-CPU seconds (wall minus thread CPU) to ``name``."""
    w0, c0 = time.monotonic(), time.thread_time()
    body()
    off = (time.monotonic() - w0) - (time.thread_time() - c0)
    with _guard:
        _blocked[name] = _blocked.get(name, 0.0) + off


def truth_warmup() -> None:
    end = time.monotonic() + 0.3
    n = 0
    while time.monotonic() < end:
        n += sum(range(200))


def truth_sleep(end: float) -> None:
    def body() -> None:
        while time.monotonic() < end:
            time.sleep(0.02)
    _measure("truth_sleep", body)


def truth_lock_hold(lock: threading.Lock, end: float) -> None:
    def body() -> None:
        while time.monotonic() < end:
            with lock:
                time.sleep(0.03)
            time.sleep(0.001)
    _measure("truth_lock_hold", body)


def truth_lock_wait(lock: threading.Lock, end: float) -> None:
    def body() -> None:
        while time.monotonic() < end:
            with lock:
                pass
    _measure("truth_lock_wait", body)


def truth_pipe_feed(wfd: int, end: float) -> None:
    def body() -> None:
        while time.monotonic() < end:
            time.sleep(0.025)
            os.write(wfd, b"x")
        os.write(wfd, b"q")
    _measure("truth_pipe_feed", body)


def truth_pipe_read(rfd: int) -> None:
    def body() -> None:
        while os.read(rfd, 1) != b"q":
            pass
    _measure("truth_pipe_read", body)


def truth_long_sleep(seconds: float) -> None:
    _measure("truth_long_sleep", lambda: time.sleep(seconds))


def _spin(name: str, end: float) -> None:
    def body() -> None:
        n = 0
        while time.monotonic() < end:
            for i in range(2000):
                n += i * i
    _measure(name, body)


def truth_gil_spin_a(end: float) -> None:
    _spin("truth_gil_spin_a", end)


def truth_gil_spin_b(end: float) -> None:
    _spin("truth_gil_spin_b", end)


def truth_main_join(threads: list[threading.Thread]) -> None:
    def body() -> None:
        for t in threads:
            t.join()
    _measure("truth_main_join", body)


def main() -> None:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 3.0
    long_sleep = float(sys.argv[2]) if len(sys.argv) > 2 else 3.0
    gil = len(sys.argv) > 3 and sys.argv[3] == "gil"
    truth_warmup()
    end = time.monotonic() + seconds
    lock = threading.Lock()
    rfd, wfd = os.pipe()
    threads = [
        threading.Thread(target=truth_sleep, args=(end,)),
        threading.Thread(target=truth_lock_hold, args=(lock, end)),
        threading.Thread(target=truth_lock_wait, args=(lock, end)),
        threading.Thread(target=truth_pipe_feed, args=(wfd, end)),
        threading.Thread(target=truth_pipe_read, args=(rfd,)),
        threading.Thread(target=truth_long_sleep, args=(long_sleep,)),
    ]
    if gil:
        threads += [threading.Thread(target=truth_gil_spin_a, args=(end,)),
                    threading.Thread(target=truth_gil_spin_b, args=(end,))]
    for t in threads:
        t.start()
    truth_main_join(threads)
    print(json.dumps({"blocked_s": _blocked, "pid": os.getpid()}), flush=True)


if __name__ == "__main__":
    main()
