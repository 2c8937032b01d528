"""Attribution accuracy of a mixed-mode timeline against phases.py's log.

usage: accuracy.py PHASES_LOG TIMELINE  -> prints a JSON object

* ``syscall``: of the main thread's samples taken inside a system call
  (kernel frames from the syscall entry) during a syscall phase, the share
  placed under ``syscall_phase``.  (A compute phase makes system calls too:
  the GIL hand-offs with the second thread, futex wake/wait.  Those samples
  belong to ``compute_phase`` and are scored by ``compute``.)
* ``compute``: of the main thread's samples taken during a compute phase (by
  the logged CLOCK_MONOTONIC phase starts), the share under ``compute_phase``.
* ``background``: of the second thread's samples, the share under ``background_work``.
"""

from __future__ import annotations

import bisect
import json
import sys
from dataclasses import asdict, dataclass

SYSCALL_ENTRY = ("entry_SYSCALL", "do_syscall_64")


@dataclass
class Accuracy:
    syscall: float
    compute: float
    background: float
    syscall_samples: int
    compute_samples: int
    background_samples: int
    main_samples: int
    no_frame: int


def load_phases(path: str) -> tuple[list[int], list[str]]:
    times, kinds = [], []
    with open(path) as f:
        for line in f:
            t, kind = line.split()
            times.append(int(t))
            kinds.append(kind)
    return times, kinds


def load_timeline(path: str) -> list[tuple[int, int, int, list[str]]]:
    out = []
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            t, pid, tid, stack = line.rstrip("\n").split(" ", 3)
            out.append((int(t), int(pid), int(tid), stack.split(";")))
    return out


def accuracy(phases_log: str, timeline: str) -> Accuracy:
    times, kinds = load_phases(phases_log)
    start, end = times[0], times[-1]
    sc_n = sc_ok = cp_n = cp_ok = bg_n = bg_ok = main = no_frame = 0
    for t, pid, tid, stack in load_timeline(timeline):
        if not start <= t < end:
            continue
        joined = ";".join(stack)
        if tid != pid:
            if "background_work" in joined or "[python: no frame]" in joined:
                bg_n += 1
                bg_ok += "background_work" in joined
            continue
        main += 1
        no_frame += stack[0] == "[python: no frame]"
        kind = kinds[bisect.bisect_right(times, t) - 1]
        if kind == "syscall" and any(f.endswith("_[k]") and f.startswith(SYSCALL_ENTRY) for f in stack):
            sc_n += 1
            sc_ok += "syscall_phase" in joined
        if kind == "compute":
            cp_n += 1
            cp_ok += "compute_phase" in joined
    return Accuracy(syscall=sc_ok / sc_n if sc_n else 0.0, compute=cp_ok / cp_n if cp_n else 0.0,
                    background=bg_ok / bg_n if bg_n else 0.0, syscall_samples=sc_n, compute_samples=cp_n,
                    background_samples=bg_n, main_samples=main, no_frame=no_frame)


if __name__ == "__main__":
    print(json.dumps(asdict(accuracy(sys.argv[1], sys.argv[2]))))
