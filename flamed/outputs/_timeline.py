"""Time-ordered samples to per-thread frame intervals (shared by speedscope and chrome trace).

A sample taken at ``t`` stands for the time until the thread's next sample,
but no longer than ``max_gap`` (twice the sampling interval): a longer gap
means the thread was off CPU, and drawing its last stack across it would
invent work.  Consecutive samples that share a stack prefix share those
frames' intervals, so a function that ran for 40 samples is one interval.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from flamed.model import Sample, Stack, parse_task_frame

#: Sampling interval assumed when neither the rate nor the data tell one.
DEFAULT_INTERVAL_NS = 10_000_000


@dataclass(frozen=True, slots=True)
class Interval:
    depth: int
    name: str
    start_ns: int
    end_ns: int


def thread_key(s: Sample) -> tuple[int, int]:
    """(pid, tid) of a sample; from its fields, else from a ``comm-PID/TID`` root frame."""
    pid, tid = s.pid, s.tid
    if pid is None or tid is None:
        task = parse_task_frame(s.stack[0]) if s.stack else None
        if task is not None:
            pid = pid if pid is not None else task.pid
            tid = tid if tid is not None else task.tid
    pid = pid if pid is not None else 0
    return pid, tid if tid is not None else pid


def group_by_thread(samples: Iterable[Sample]) -> dict[tuple[int, int], list[Sample]]:
    """Samples per (pid, tid), each list in time order; threads sorted."""
    groups: dict[tuple[int, int], list[Sample]] = {}
    for s in samples:
        groups.setdefault(thread_key(s), []).append(s)
    out: dict[tuple[int, int], list[Sample]] = {}
    for k in sorted(groups):
        lst = groups[k]
        lst.sort(key=lambda s: s.time_ns)  # stable: equal times keep input order
        out[k] = lst
    return out


def typical_interval(samples: list[Sample], rate_hz: float | None = None) -> int:
    """The sampling interval: from the rate, else the median gap between samples."""
    if rate_hz and rate_hz > 0:
        return max(1, round(1e9 / rate_hz))
    gaps = sorted(b.time_ns - a.time_ns for a, b in zip(samples, samples[1:]) if b.time_ns > a.time_ns)
    return gaps[(len(gaps) - 1) // 2] if gaps else DEFAULT_INTERVAL_NS  # lower median: idle gaps must not set it


def intervals(samples: list[Sample], interval_ns: int) -> Iterator[Interval]:
    """Frame intervals of one thread's time-ordered samples (closed intervals first)."""
    max_gap = 2 * interval_ns
    open_stack: Stack = ()
    starts: list[int] = []
    for i, s in enumerate(samples):
        t = s.time_ns
        nxt = samples[i + 1].time_ns if i + 1 < len(samples) else None
        end = nxt if nxt is not None and nxt - t <= max_gap else t + interval_ns
        stack = s.stack
        same = 0
        m = min(len(open_stack), len(stack))
        while same < m and open_stack[same] == stack[same]:
            same += 1
        # Frames not shared with the new stack ended when it started.
        for d in range(len(open_stack) - 1, same - 1, -1):
            yield Interval(d, open_stack[d], starts[d], t)
        del starts[same:]
        starts.extend([t] * (len(stack) - same))
        open_stack = stack
        if end != nxt:
            # A gap: everything closes at this sample's end.
            for d in range(len(open_stack) - 1, -1, -1):
                yield Interval(d, open_stack[d], starts[d], end)
            open_stack = ()
            starts = []
