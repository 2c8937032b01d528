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

Windows are stored packed (:class:`PackedCounts`): a drain's keys are
numbered in a :class:`StackTable` (each distinct task once, each distinct stack
once as an array of frame numbers, each frame string once), and a
window is two arrays, the (task, stack) numbers of its entries and their
counts.  An entry repeated from an earlier window costs 16 bytes; a new one
adds its stack once (2 bytes a frame while the table has at most 65,536
frames, 4 after, plus 16-24), where a tuple of references
per key, its window's dict slot and an interning table took ~500 bytes with
30-frame stacks (bench/ring_memory.py).  Readers see the same mapping of
(tgid, tid, comm, stack) to counts, decoded as they iterate.  The table and
its windows are in flamed/sampling/packed.py: the BPF drain numbers its
stacks into the ring's table as it names them (:meth:`WindowRing.numbering`),
and :meth:`WindowRing.pack` takes such a window as it is.

Stacks no window holds any more are forgotten by a sweep, which numbers the
live ones in a new table and moves every packed window still alive (in the
ring, in the file being filled, queued for a push) to it; a reader that took a
window's state before keeps decoding it with the old table.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from array import array
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace

from flamed.sampling.cgroups import CgroupIdentity
from flamed.sampling.contract import CountKey
from flamed.sampling.packed import (
    _STACK_MASK,
    DecodeCache,
    PackedBuilder,
    PackedCounts,
    StackTable,
    window_items,
)

#: Names other modules import from here (the table and its windows moved to flamed/sampling/packed.py).
__all__ = ["KINDS", "DecodeCache", "PackedCounts", "RingWindow", "StackTable", "WindowRing", "window_items"]


#: The kinds of windows: CPU samples (counts), off-CPU time (nanoseconds).
KINDS = ("cpu", "offcpu")


@dataclass(frozen=True)
class RingWindow:
    start_ns: int
    end_ns: int
    #: A dict as the drain builds it; a :class:`PackedCounts` once in the ring.
    counts: Mapping[CountKey, int]
    samples: int
    lost: dict[str, int] = field(default_factory=dict)
    sample_rate: float | None = None
    seq: int = 0
    #: tgid -> who owns its cgroup (Window.identities)
    identities: dict[int, CgroupIdentity] = field(default_factory=dict)
    #: ``cpu``: counts are samples; ``offcpu``: counts are nanoseconds off the CPU.
    kind: str = "cpu"


@dataclass
class _LiveNumbers:
    """Which stack and task numbers of a table the packed windows still hold:
    one byte a number (a set of the live keys, and a dict from them to their
    new numbers, took ~100 MB at 400 k live keys: the daemon's highest mark)."""

    stack_marks: bytearray
    task_marks: bytearray
    stacks: int
    tasks: int

    @classmethod
    def of(cls, table: StackTable, alive: list[PackedCounts]) -> _LiveNumbers:
        sm = bytearray(len(table))
        tm = bytearray(len(table.tasks))
        for p in alive:
            for k in p._state[1]:
                sm[k & _STACK_MASK] = 1
                tm[k >> 32] = 1
        return cls(sm, tm, len(sm) - sm.count(0), len(tm) - tm.count(0))


class WindowRing:
    """Thread-safe: the drain adds, control-socket threads read and wait."""

    def __init__(self, max_seconds: float, max_stacks: int, *, clock_ns: Callable[[], int]) -> None:
        self.max_seconds = max_seconds
        self.max_stacks = max_stacks
        self._clock_ns = clock_ns
        self._windows: deque[RingWindow] = deque()
        self._stacks = 0
        #: Where the windows' keys are numbered (a new one after each sweep).
        self._table = StackTable()
        #: Every packed window still alive, in the ring or not (the file being filled holds some).
        self._packed: list[weakref.ref[PackedCounts]] = []
        self._cond = threading.Condition()
        # Packing runs outside _cond (readers wait on it), under its own lock.
        self._intern_lock = threading.Lock()
        self.sweeps = 0
        #: (stacks, tasks) in the table past which _sweep looks for dead ones.
        self._check_at = (4096, 4096)
        self.evicted = 0
        self.seq = 0

    def configure(self, max_seconds: float, max_stacks: int) -> None:
        with self._cond:
            self.max_seconds = max_seconds
            self.max_stacks = max_stacks
            self._trim()

    def pack(self, w: RingWindow) -> RingWindow:
        """``w`` with its counts packed in the ring's table (as :meth:`add` keeps it).

        Counts the drain numbered in this table already (a
        :class:`~flamed.sampling.packed.PackedBuilder`) are taken as they are,
        and only their extra keys numbered; a builder of a table replaced since
        (a sweep, a widening) is decoded and numbered again."""
        if isinstance(w.counts, PackedCounts):
            return w
        with self._intern_lock:
            try:
                packed = self._pack_counts(w.counts)
            except OverflowError:  # the 65,537th frame: numbers of 4 bytes from now on
                self._renumber(self._table, [p for p in self._alive() if p.table is self._table], code="I")
                packed = self._pack_counts(w.counts, decode=True)
            self._packed.append(weakref.ref(packed))
            if len(self._packed) >= 64 and len(self._packed) & (len(self._packed) - 1) == 0:
                self._alive()  # dropped ones pruned at each power of two
        return replace(w, counts=packed)

    def _pack_counts(self, counts: Mapping[CountKey, int], *, decode: bool = False) -> PackedCounts:
        """``counts`` numbered in the current table (under _intern_lock; OverflowError: it needs 4-byte numbers)."""
        table = self._table
        if isinstance(counts, PackedBuilder) and counts.table is table and not decode:
            return table.window(table.number(counts.extra, dict(counts.packed)) if counts.extra else counts.packed)
        return table.pack(counts)

    @contextlib.contextmanager
    def numbering(self) -> Iterator[StackTable]:
        """The table a drain numbers its keys in (flamed.sampling.packed.Numbering), held for the block."""
        with self._intern_lock:
            yield self._table

    def widen(self, table: StackTable) -> None:
        """``table`` needs 4-byte frame numbers: the windows in it move to a new table that has them."""
        with self._intern_lock:
            if table is self._table and table.code != "I":
                self._renumber(table, [p for p in self._alive() if p.table is table], code="I")

    def add(self, w: RingWindow, *more: RingWindow) -> None:
        """Add one drain's windows (of different kinds) at once: a reader woken by them sees them all."""
        interned = [self.pack(x) for x in (w, *more)]
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

    def _sweep(self) -> None:
        """Forget the stacks and tasks no packed window holds any more.

        Once the table has grown by a quarter (at least 4,096) since it was last
        looked at, the live numbers are counted; when a fifth or more of the
        table is dead, the live keys are numbered in a new table and every packed
        window still alive (in the ring or not) moves to it."""
        with self._intern_lock:
            table = self._table
            if len(table) <= self._check_at[0] and len(table.tasks) <= self._check_at[1]:
                return
            alive = [p for p in self._alive() if p.table is table]
            live = _LiveNumbers.of(table, alive)
            if (len(table) - live.stacks <= max(live.stacks // 4, 1024)
                    and len(table.tasks) - live.tasks <= max(live.tasks // 4, 1024)):
                self._check_at = (len(table) + max(len(table) // 4, 4096),
                                  len(table.tasks) + max(len(table.tasks) // 4, 4096))
                return
            # Frames are kept (shared) unless they too outnumber what can be live by far.
            renumber_frames = len(table.frames) > 64 * live.stacks + 65536
            try:
                self._renumber(table, alive, code=table.code, frames=not renumber_frames, live=live)
            except OverflowError:  # the live frames alone need 4-byte numbers
                self._renumber(table, alive, code="I", frames=False, live=live)
            self.sweeps += 1

    def _renumber(self, table: StackTable, alive: list[PackedCounts], *, code: str, frames: bool = True,
                  live: _LiveNumbers | None = None) -> None:
        """Number the keys of ``alive`` in a new table (``frames``: sharing the old
        one's frames) and move them to it (under _intern_lock)."""
        if live is None:
            live = _LiveNumbers.of(table, alive)
        new = StackTable((table.frame_ids, table.frames) if frames else None, code)
        same = frames and code == table.code  # the stacks' bytes carry over as they are
        # Old number -> new one, in arrays (-1: not live).  Stacks in their old
        # order: the new buffer is filled front to back.
        stack_to = array("q", [-1]) * len(table)
        for si, on in enumerate(live.stack_marks):
            if on:
                b = table.stack_bytes(si) if same else new.encode_stack(table.stack(si))
                stack_to[si] = new.stack_number(b)
        task_to = array("q", [-1]) * len(table.tasks)
        for ti, on in enumerate(live.task_marks):
            if on:
                task_to[ti] = new.task_number(table.tasks[ti])
        for p in alive:
            _, keys, vals = p._state
            p._state = (new, array("Q", (task_to[k >> 32] << 32 | stack_to[k & _STACK_MASK] for k in keys)), vals)
        self._table = new
        self._check_at = (len(new) + max(len(new) // 4, 4096), len(new.tasks) + max(len(new.tasks) // 4, 4096))

    def distinct_keys(self) -> int:
        """Distinct stacks numbered: those of the windows alive, and those of windows
        gone until the next sweep (at most a quarter more, or 4,096)."""
        return len(self._table)  # no lock: a length read while a drain numbers is a moment old

    def _alive(self) -> list[PackedCounts]:
        """The packed windows still alive (under _intern_lock); the list of them pruned."""
        alive = [p for p in (r() for r in self._packed) if p is not None]
        self._packed = [weakref.ref(p) for p in alive]
        return alive

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
        """(windows, stack entries) held, of both kinds."""
        with self._cond:
            return len(self._windows), self._stacks

    def windows_by_kind(self) -> dict[str, int]:
        """Windows held, by kind: ``cpu`` (one per drain) always, ``offcpu`` when any is held
        (with off-CPU time on every drain adds one of each)."""
        out = {"cpu": 0}
        with self._cond:
            for w in self._windows:
                out[w.kind] = out.get(w.kind, 0) + 1
        return out
