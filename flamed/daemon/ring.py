"""The in-memory ring of recent windows that snapshots are cut from.

Bounded twice: by age (``ring_seconds``) and by the number of (task, stack)
entries over all windows (``ring_max_stacks``), so a burst of unique stacks
cannot grow the daemon without limit.  Oldest windows go first.

Windows are kept with their task keys (tgid, tid, comm) and the identities of
their tasks' cgroups (tgid -> unit, container, pod) so that a snapshot can
filter by pid/tid/comm/unit/container/cgroup and choose its root frames per
request.

Each window has a kind: ``cpu`` (sample counts) or ``offcpu`` (nanoseconds
off the CPU, with ``[sampling] off_cpu``); a drain adds its windows of both
kinds at once, and readers ask for one kind.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from flamed.sampling.cgroups import CgroupIdentity
from flamed.sampling.contract import CountKey


#: The kinds of windows: CPU samples (counts), off-CPU time (nanoseconds).
KINDS = ("cpu", "offcpu")


@dataclass(frozen=True)
class RingWindow:
    start_ns: int
    end_ns: int
    counts: dict[CountKey, int]
    samples: int
    lost: dict[str, int] = field(default_factory=dict)
    sample_rate: float | None = None
    seq: int = 0
    #: tgid -> who owns its cgroup (Window.identities)
    identities: dict[int, CgroupIdentity] = field(default_factory=dict)
    #: ``cpu``: counts are samples; ``offcpu``: counts are nanoseconds off the CPU.
    kind: str = "cpu"


class WindowRing:
    """Thread-safe: the drain adds, control-socket threads read and wait."""

    def __init__(self, max_seconds: float, max_stacks: int, *, clock_ns: Callable[[], int]) -> None:
        self.max_seconds = max_seconds
        self.max_stacks = max_stacks
        self._clock_ns = clock_ns
        self._windows: deque[RingWindow] = deque()
        self._stacks = 0
        self._cond = threading.Condition()
        self.evicted = 0
        self.seq = 0

    def configure(self, max_seconds: float, max_stacks: int) -> None:
        with self._cond:
            self.max_seconds = max_seconds
            self.max_stacks = max_stacks
            self._trim()

    def add(self, w: RingWindow, *more: RingWindow) -> None:
        """Add one drain's windows (of different kinds) at once: a reader woken by them sees them all."""
        with self._cond:
            for x in (w, *more):
                self.seq += 1
                x = replace(x, seq=self.seq)
                self._windows.append(x)
                self._stacks += len(x.counts)
            self._trim()
            self._cond.notify_all()

    def _trim(self) -> None:
        horizon = self._clock_ns() - int(self.max_seconds * 1e9)
        # Always keep the newest window of each kind, even when it alone is over the budget.
        newest = {w.kind: w.seq for w in self._windows}
        i = 0
        while i < len(self._windows):
            w = self._windows[i]
            if not (w.end_ns < horizon or self._stacks > self.max_stacks):
                break
            if newest[w.kind] == w.seq:
                i += 1
                continue
            del self._windows[i]
            self._stacks -= len(w.counts)
            self.evicted += 1

    def oldest_start_ns(self, kind: str = "cpu") -> int | None:
        """Start of the oldest window of ``kind`` held (None: none)."""
        with self._cond:
            return next((w.start_ns for w in self._windows if w.kind == kind), None)

    def since(self, start_ns: int, end_ns: int | None = None, *, kind: str = "cpu") -> list[RingWindow]:
        """Windows of ``kind`` that end after ``start_ns`` (and start before ``end_ns``), oldest first."""
        with self._cond:
            return [w for w in self._windows if w.kind == kind and w.end_ns > start_ns
                    and (end_ns is None or w.start_ns < end_ns)]

    def wait_for_end(self, end_ns: int, timeout: float) -> bool:
        """Block until a window ending at or after ``end_ns`` is in the ring (or timeout)."""
        with self._cond:
            return self._cond.wait_for(
                lambda: bool(self._windows) and self._windows[-1].end_ns >= end_ns, timeout=timeout
            )

    def wake_all(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def stats(self) -> tuple[int, int]:
        """(windows, stack entries) held."""
        with self._cond:
            return len(self._windows), self._stacks
