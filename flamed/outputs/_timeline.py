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

from flamed.model import Sample, Stack, Weight, parse_task_frame, task_frame

#: Sampling interval assumed when neither the rate nor the data tell one.
DEFAULT_INTERVAL_NS = 10_000_000


@dataclass(frozen=True, slots=True)
class Interval:
    depth: int
    name: str
    start_ns: int
    end_ns: int


#: A thread's key: (pid, tid, command).  The command is there only when the
#: capture gives neither id (a trace or folded timeline whose root frames are
#: bare commands): then each command is a lane of its own, rather than every
#: command of the capture drawn as one thread 0.
ThreadKey = tuple[int, int, str]


def thread_key(s: Sample) -> ThreadKey:
    """(pid, tid, "") of a sample; from its fields, else from a ``comm-PID/TID`` root frame.

    When the capture has no pid (perf script's default prints only the thread
    id) the pid is -1: the thread is its own group, not a member of process 0.
    When it has neither id, the key is (-1, 0, command).
    """
    pid, tid, comm = _ids(s)
    if tid is None and pid is None:
        return -1, 0, comm
    if tid is None:
        tid = pid
    assert tid is not None
    return (pid if pid is not None else -1), tid, ""


def group_by_thread(samples: Iterable[Sample]) -> dict[ThreadKey, list[Sample]]:
    """Samples per thread (:func:`thread_key`), each list in time order; threads sorted."""
    groups: dict[ThreadKey, list[Sample]] = {}
    for s in samples:
        groups.setdefault(thread_key(s), []).append(s)
    out: dict[ThreadKey, list[Sample]] = {}
    for k in sorted(groups):
        lst = groups[k]
        lst.sort(key=lambda s: s.time_ns)  # stable: equal times keep input order
        out[k] = lst
    return out


@dataclass(frozen=True, slots=True)
class ThreadNames:
    """What the capture says about one thread: its command and its process's."""

    pid: int | None  # None: the capture printed only the thread id (perf script's default)
    tid: int | None  # None: nor that (a timeline whose root frames are bare commands)
    comm: str
    process: str  # command of the process's main thread when seen, else of its first thread

    @property
    def label(self) -> str:
        if self.tid is None:
            return f"{self.comm} (no thread id in the capture)"
        ids = f"pid {self.pid}, tid {self.tid}" if self.pid is not None else f"tid {self.tid}"
        return f"{self.comm} ({ids})" if self.comm else ids


def _ids(s: Sample) -> tuple[int | None, int | None, str]:
    """(pid, tid, comm) of a sample, from its fields and its root frame (``comm`` or ``comm-PID/TID``)."""
    root = s.stack[0] if s.stack else ""
    task = parse_task_frame(root)
    pid = s.pid if s.pid is not None else task.pid
    tid = s.tid if s.tid is not None else task.tid
    return pid, tid, task.comm


def thread_names(groups: dict[ThreadKey, list[Sample]]) -> dict[ThreadKey, ThreadNames]:
    """Names of the threads of :func:`group_by_thread`'s groups, from their samples."""
    known: dict[ThreadKey, tuple[int | None, str]] = {}
    for key, lst in groups.items():
        pid, _, comm = _ids(lst[0]) if lst else (None, None, "")
        known[key] = (pid, comm)
    # A process is named after its main thread (tid == pid), as ps does; else its first thread.
    process: dict[int, str] = {}
    for (_, tid, _), (pid, comm) in known.items():
        if pid is not None and tid == pid:
            process[pid] = comm
    for pid, comm in known.values():
        if pid is not None:
            process.setdefault(pid, comm)
    out: dict[ThreadKey, ThreadNames] = {}
    for key, (pid, comm) in known.items():
        out[key] = ThreadNames(pid, None if key[2] else key[1], comm,
                               process.get(pid, comm) if pid is not None else comm)
    return out


def lanes(samples: Iterable[Sample]) -> list[tuple[Stack, Weight]]:
    """A time-ordered stream as flame chart items: one lane per thread, each in time order.

    Interleaving the samples of several threads makes every box one sample
    wide; a lane per thread keeps each thread's runs together.  The root frame
    of each lane names the thread (``comm-PID/TID``, ``comm-?/TID`` when the
    capture has no pid) so that lanes of threads with one command stay apart.
    """
    groups = group_by_thread(samples)
    names = thread_names(groups)
    if len(groups) <= 1:
        return [(s.stack, s.weight) for lst in groups.values() for s in lst]
    out: list[tuple[Stack, Weight]] = []
    # Lanes in the order the threads first ran.
    for key in sorted(groups, key=lambda k: (groups[k][0].time_ns if groups[k] else 0, k)):
        n = names[key]
        if n.tid is None:  # bare commands: each its own lane already, under its own root
            out.extend((s.stack, s.weight) for s in groups[key])
            continue
        root = task_frame(n.comm, n.pid, n.tid)
        for s in groups[key]:
            stack = s.stack
            if stack and parse_task_frame(stack[0]).tid is None:
                stack = (root,) + stack[1:]
            elif not stack:
                stack = (root,)
            out.append((stack, s.weight))
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
