"""Ground-truth workload for mixed-mode attribution.

The main thread alternates phases of a known length between a syscall-heavy
Python function (``syscall_phase``: os.stat in a loop, mostly in the kernel)
and a pure-compute one (``compute_phase``: integer arithmetic, never enters
the kernel on purpose); a second thread runs ``background_work`` all along.
Each phase's start is logged as ``MONOTONIC_NS KIND`` to the log file, so a
recorder's samples can be checked against the truth.

usage: phases.py LOG PHASE_MS CYCLES
"""

from __future__ import annotations

import os
import sys
import threading
import time


def syscall_phase(end: float) -> None:
    st = os.stat
    while time.monotonic() < end:
        for _ in range(50):
            st("/")


def compute_phase(end: float) -> None:
    x = 0
    while time.monotonic() < end:
        for i in range(2000):
            x = (x * 31 + i) % 1000003


def background_work(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        for i in range(20000):
            x = (x + i * i) % 7919
        time.sleep(0.002)


def main() -> int:
    log_path, phase_ms, cycles = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    stop = threading.Event()
    bg = threading.Thread(target=background_work, args=(stop,), name="background", daemon=True)
    bg.start()
    time.sleep(float(os.environ.get("PHASES_WARMUP_S", "0.5")))  # let the recorder attach
    lines = []
    step = phase_ms / 1000.0
    t = time.monotonic()
    for _ in range(cycles):
        for kind, fn in (("syscall", syscall_phase), ("compute", compute_phase)):
            lines.append(f"{time.monotonic_ns()} {kind}\n")
            t += step
            fn(t)
    lines.append(f"{time.monotonic_ns()} end\n")
    stop.set()
    bg.join()
    with open(log_path, "w") as f:
        f.writelines(lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
