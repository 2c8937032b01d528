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

Keys are interned: each drain builds new (tgid, tid, comm, stack) tuples, but
a steady workload has the same ones window after window, so the ring keeps one
tuple per distinct key (and forgets it once no window holds it: a sweep when
the table reaches twice the entries held).  An entry repeated from an earlier
window costs its dict slot only: ~80 bytes instead of ~470 with 30-frame
stacks (bench/ring_memory.py).
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
        #: One copy of each distinct key interned (flamed keeps it until a sweep finds no window holding it).
        self._canon: dict[CountKey, CountKey] = {}
        self._cond = threading.Condition()
        # Interning runs outside _cond (readers wait on it), under its own lock.
        self._intern_lock = threading.Lock()
        self.evicted = 0
        self.seq = 0

    def configure(self, max_seconds: float, max_stacks: int) -> None:
        with self._cond:
            self.max_seconds = max_seconds
            self.max_stacks = max_stacks
            self._trim()

    def add(self, w: RingWindow, *more: RingWindow) -> None:
        """Add one drain's windows (of different kinds) at once: a reader woken by them sees them all."""
        interned = [replace(x, counts=self._intern(x.counts)) for x in (w, *more)]
        with self._cond:
            for x in interned:
                self.seq += 1
                x = replace(x, seq=self.seq)
                self._windows.append(x)
                self._stacks += len(x.counts)
            self._trim()
            self._cond.notify_all()
        self._sweep()

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

    def _intern(self, counts: dict[CountKey, int]) -> dict[CountKey, int]:
        """``counts`` with its keys replaced by the ring's copies of equal keys."""
        with self._intern_lock:
            canon = self._canon
            return {canon.setdefault(k, k): v for k, v in counts.items()}

    def _sweep(self) -> None:
        """Forget the interned keys no window holds any more, once they are as many as
        the entries held (each sweep walks every entry: it runs rarely, and always
        leaves the table at most twice the size of what is live)."""
        with self._cond:
            windows = list(self._windows)
            live_entries = self._stacks
        with self._intern_lock:
            if len(self._canon) <= max(2 * live_entries, 4096):
                return
            live: dict[CountKey, CountKey] = {}
            for w in windows:
                for k in w.counts:
                    live[k] = k
            self._canon = live

    def distinct_keys(self) -> int:
        """Distinct (task, stack) keys interned (those of the windows held, and up to
        as many again of evicted windows, until the next sweep)."""
        with self._intern_lock:
            return len(self._canon)

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
