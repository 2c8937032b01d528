"""A request-like service that mostly waits: each request computes a little
and waits on a timer, a socket and a lock, each in a function of its own.

    python requests_wait.py [SECONDS] [WORKERS]

WORKERS threads (default 2) serve requests for SECONDS (default 4).  One
request: ``cpu_work`` (about 1 ms of pure Python), ``sleep_wait`` (4 ms
sleep), ``recv_wait`` (a socket read, answered 4 ms later by a feeder
thread), ``lock_wait`` (a lock a holder thread keeps about half of the
time).  Each function adds the wall time it took to its entry; at the end one
JSON line gives those seconds summed over the workers:
``{"wall_s": {function: seconds}, "pid": PID}``.  A wall-clock profile of the
workers should put each function's share of their time where this says.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time

_spent: dict[str, float] = {}
_guard = threading.Lock()
_held = threading.Lock()


def _add(name: str, t0: float) -> None:
    dt = time.monotonic() - t0
    with _guard:
        _spent[name] = _spent.get(name, 0.0) + dt


def cpu_work() -> None:
    t0 = time.monotonic()
    end = time.thread_time() + 0.001
    n = 0
    while time.thread_time() < end:
        n += sum(range(100))
    _add("cpu_work", t0)


def sleep_wait() -> None:
    t0 = time.monotonic()
    time.sleep(0.004)
    _add("sleep_wait", t0)


def recv_wait(sock: socket.socket) -> None:
    t0 = time.monotonic()
    sock.sendall(b"?")
    sock.recv(1)
    _add("recv_wait", t0)


def lock_wait() -> None:
    t0 = time.monotonic()
    with _held:
        pass
    _add("lock_wait", t0)


def _holder(end: float) -> None:
    while time.monotonic() < end:
        with _held:
            time.sleep(0.003)
        time.sleep(0.003)


def _feeder(sock: socket.socket) -> None:
    while True:
        if not sock.recv(1):
            return
        time.sleep(0.004)
        sock.sendall(b"!")


def worker(end: float) -> None:
    a, b = socket.socketpair()
    threading.Thread(target=_feeder, args=(b,), daemon=True).start()
    while time.monotonic() < end:
        cpu_work()
        sleep_wait()
        recv_wait(a)
        lock_wait()
    a.close()


def main() -> None:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 4.0
    workers = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    end = time.monotonic() + seconds
    threading.Thread(target=_holder, args=(end,), daemon=True).start()
    ts = [threading.Thread(target=worker, args=(end,), name=f"worker-{i}") for i in range(workers)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    print(json.dumps({"wall_s": _spent, "pid": os.getpid()}), flush=True)


if __name__ == "__main__":
    main()
