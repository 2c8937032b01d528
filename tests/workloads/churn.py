"""Process churn for mixed mode: N short-lived Python children, every Kth long-lived.

usage: churn.py OUT N K LONG_S CONCURRENCY
Writes ``PID long|short START_NS END_NS`` per child (CLOCK_MONOTONIC, as seen by the parent).
A long-lived child spends LONG_S seconds in ``long_lived_work``.
"""

from __future__ import annotations

import subprocess
import sys
import time

LONG = ("import time\n"
        "def long_lived_work(end):\n"
        "    x = 0\n"
        "    while time.monotonic() < end:\n"
        "        x = (x * 7 + 1) % 65521\n"
        "long_lived_work(time.monotonic() + float(__import__('sys').argv[1]))\n")
SHORT = "import time; time.sleep(0.02)"


def main() -> int:
    out, n, k, long_s, conc = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
    running: list[tuple[subprocess.Popen[bytes], str, int]] = []
    lines = []
    started = 0
    while started < n or running:
        while started < n and len(running) < conc:
            kind = "long" if started % k == 0 else "short"
            cmd = [sys.executable, "-S", "-c", LONG, str(long_s)] if kind == "long" else [sys.executable, "-S", "-c", SHORT]
            running.append((subprocess.Popen(cmd), kind, time.monotonic_ns()))
            started += 1
        for item in list(running):
            p, kind, t0 = item
            if p.poll() is not None:
                lines.append(f"{p.pid} {kind} {t0} {time.monotonic_ns()}\n")
                running.remove(item)
        time.sleep(0.005)
    with open(out, "w") as f:
        f.writelines(lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
