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
frames, 4 after, plus ~40), where a tuple of references
per key, its window's dict slot and an interning table took ~500 bytes with
30-frame stacks (bench/ring_memory.py).  Readers see the same mapping of
(tgid, tid, comm, stack) to counts, decoded as they iterate.

Stacks no window holds any more are forgotten by a sweep, which numbers the
live ones in a new table and moves every packed window still alive (in the
ring, in the file being filled, queued for a push) to it; a reader that took a
window's state before keeps decoding it with the old table.
"""

from __future__ import annotations

import threading
import weakref
from array import array
from collections import deque
from collections.abc import Callable, Hashable, ItemsView, Iterable, Iterator, Mapping, ValuesView
from dataclasses import dataclass, field, replace
from typing import TypeVar

from flamed.sampling.cgroups import CgroupIdentity
from flamed.model import Stack
from flamed.sampling.contract import CountKey


_STACK_MASK = 0xFFFF_FFFF
_Task = tuple[int, int, str]
_T = TypeVar("_T", bound=Hashable)


def _number(ids: dict[_T, int], items: list[_T], x: _T) -> int:
    """``x``'s number in ``ids``/``items``, a new one (appended) if it has none."""
    i = ids.get(x)
    if i is None:
        i = ids[x] = len(items)
        items.append(x)
    return i


class StackTable:
    """Tasks, stacks and frames of packed windows, numbered.

    A stack is its frames' numbers (2 bytes each, 4 once there are more than
    65,536 frames), kept end to end in one
    buffer with its start in an array, and found again through an
    open-addressing hash table of arrays: a distinct stack costs its frames
    and ~40 bytes, and no Python object of its own (long-lived objects by the
    hundred thousand, allocated among a drain's transient ones, would keep
    the allocator's arenas from being given back).

    Append-only: a number once given keeps its meaning in this table, so
    readers decode without a lock while the drain thread adds.  A sweep makes
    a new table (:meth:`WindowRing._sweep`)."""

    __slots__ = ("frame_ids", "frames", "code", "_blob", "_offs", "_hashes", "_index", "task_ids", "tasks",
                 "__weakref__")

    def __init__(self, frames: tuple[dict[str, int], list[str]] | None = None, code: str = "H") -> None:
        #: Frames may be shared with the table this one replaces (they are few and append-only).
        self.frame_ids, self.frames = frames if frames is not None else ({}, [])
        #: A frame number's array type: 2 bytes ("H") while there are at most 65,536 frames, then 4 ("I").
        self.code = code
        self._blob = bytearray()
        #: Stack i is _blob[_offs[i]:_offs[i + 1]]; _hashes[i] is hash() of those bytes.
        self._offs = array("Q", [0])
        self._hashes = array("q")
        #: (slots, mask): stack numbers by hash, linear probing, -1 where free; at most half
        #: full.  One attribute, so that a reader never sees a new array with the old mask.
        self._index = (array("q", [-1]) * 1024, 1023)
        self.task_ids: dict[_Task, int] = {}
        self.tasks: list[_Task] = []

    def __len__(self) -> int:
        """Stacks numbered."""
        return len(self._hashes)

    def stack_bytes(self, si: int) -> bytes:
        return bytes(self._blob[self._offs[si]: self._offs[si + 1]])

    # -- numbering (the drain thread, under the ring's intern lock) ----------
    def _frame_id(self, f: str) -> int:
        return _number(self.frame_ids, self.frames, f)

    def _probe(self, slots: array[int], mask: int, b: bytes, h: int) -> int:
        """The slot of the stack ``b`` (hash ``h``), or of the free slot where it would go."""
        hashes, offs, blob = self._hashes, self._offs, self._blob
        i = h & mask
        while True:
            si = slots[i]
            if si < 0 or (hashes[si] == h and blob[offs[si]: offs[si + 1]] == b):
                return i
            i = (i + 1) & mask

    def find_stack(self, stack: Stack) -> int | None:
        """The number of ``stack`` (None: not numbered; nothing is added)."""
        try:
            b = array(self.code, map(self.frame_ids.__getitem__, stack)).tobytes()
        except (KeyError, OverflowError):  # a frame never numbered (or beyond this table's code)
            return None
        slots, mask = self._index
        si = slots[self._probe(slots, mask, b, hash(b))]
        return None if si < 0 else si

    def _stack_id(self, b: bytes) -> int:
        h = hash(b)
        slots, mask = self._index
        i = self._probe(slots, mask, b, h)
        si = slots[i]
        if si >= 0:
            return si
        si = len(self._hashes)
        self._blob += b
        self._offs.append(len(self._blob))
        self._hashes.append(h)  # before the slot: a reader that finds the slot finds its hash
        slots[i] = si
        if 2 * len(self._hashes) > len(slots):
            self._grow()
        return si

    def _grow(self) -> None:
        n = 2 * len(self._index[0])
        slots, mask = array("q", [-1]) * n, n - 1
        for si, h in enumerate(self._hashes):
            i = h & mask
            while slots[i] >= 0:
                i = (i + 1) & mask
            slots[i] = si
        self._index = (slots, mask)

    def _task_id(self, t: _Task) -> int:
        return _number(self.task_ids, self.tasks, t)

    def encode_stack(self, stack: Stack) -> bytes:
        """The stack's frame numbers as bytes (OverflowError: a number too large for ``code``)."""
        try:
            return array(self.code, map(self.frame_ids.__getitem__, stack)).tobytes()
        except KeyError:  # a frame seen for the first time
            return array(self.code, map(self._frame_id, stack)).tobytes()

    def pack(self, counts: Mapping[CountKey, int]) -> PackedCounts:
        keys, vals = array("Q"), array("q")
        task_ids = self.task_ids
        encode, stack_id = self.encode_stack, self._stack_id
        for (tgid, tid, comm, stack), n in counts.items():
            t = (tgid, tid, comm)
            ti = task_ids.get(t)
            if ti is None:
                ti = self._task_id(t)
            keys.append(ti << 32 | stack_id(encode(stack)))
            vals.append(n)
        return PackedCounts(self, keys, vals)

    # -- decoding (any thread) -----------------------------------------------
    def stack(self, si: int) -> Stack:
        a = array(self.code)
        # A slice is a copy: no view of the buffer is held while the drain thread appends to it.
        a.frombytes(self._blob[self._offs[si]: self._offs[si + 1]])
        return tuple(map(self.frames.__getitem__, a))

    def key(self, packed: int) -> CountKey:
        tgid, tid, comm = self.tasks[packed >> 32]
        return (tgid, tid, comm, self.stack(packed & _STACK_MASK))


class PackedCounts(Mapping[CountKey, int]):
    """One window's counts, packed: a mapping of (tgid, tid, comm, stack) to
    counts whose keys are decoded as they are read (each read builds new
    tuples: readers that go over many windows use :meth:`decoded_items`)."""

    __slots__ = ("_state", "__weakref__")

    def __init__(self, table: StackTable, keys: array[int], vals: array[int]) -> None:
        #: Replaced whole (never changed in place) when a sweep renumbers: a reader takes it once.
        self._state = (table, keys, vals)

    @property
    def table(self) -> StackTable:
        return self._state[0]

    def __len__(self) -> int:
        return len(self._state[1])

    def __iter__(self) -> Iterator[CountKey]:
        table, keys, _ = self._state
        return map(table.key, keys)

    def __getitem__(self, key: CountKey) -> int:
        table, keys, vals = self._state
        tgid, tid, comm, stack = key
        ti = table.task_ids.get((tgid, tid, comm))
        si = table.find_stack(stack)
        if ti is None or si is None:
            raise KeyError(key)
        try:
            return vals[keys.index(ti << 32 | si)]
        except ValueError:
            raise KeyError(key) from None

    def items(self) -> ItemsView[CountKey, int]:
        return _PackedItems(self)

    def values(self) -> ValuesView[int]:
        return _PackedValues(self)

    def decoded_items(self, cache: DecodeCache) -> Iterator[tuple[CountKey, int]]:
        """(key, count) pairs, each key decoded once per ``cache`` (one per request
        that reads several windows: a steady workload repeats its keys window
        after window)."""
        table, keys, vals = self._state
        memo = cache.get(table)
        if memo is None:
            memo = cache[table] = {}
        key = table.key
        for k, n in zip(keys, vals):
            ck = memo.get(k)
            if ck is None:
                ck = memo[k] = key(k)
            yield ck, n

    def tgids(self) -> set[int]:
        """The processes with counts here."""
        table, keys, _ = self._state
        tasks = table.tasks
        return {tasks[t][0] for t in {k >> 32 for k in keys}}


#: A reader's decoded keys, per table (see PackedCounts.decoded_items).
DecodeCache = dict[StackTable, dict[int, CountKey]]


def window_items(counts: Mapping[CountKey, int], cache: DecodeCache) -> Iterable[tuple[CountKey, int]]:
    """(key, count) of a window's counts, packed or not; packed keys decoded once per ``cache``."""
    return counts.decoded_items(cache) if isinstance(counts, PackedCounts) else counts.items()


class _PackedItems(ItemsView[CountKey, int]):
    _mapping: PackedCounts

    def __iter__(self) -> Iterator[tuple[CountKey, int]]:
        table, keys, vals = self._mapping._state
        return zip(map(table.key, keys), vals)


class _PackedValues(ValuesView[int]):
    _mapping: PackedCounts

    def __iter__(self) -> Iterator[int]:
        return iter(self._mapping._state[2])


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
        """``w`` with its counts packed in the ring's table (as :meth:`add` keeps it)."""
        if isinstance(w.counts, PackedCounts):
            return w
        with self._intern_lock:
            try:
                packed = self._table.pack(w.counts)
            except OverflowError:  # the 65,537th frame: numbers of 4 bytes from now on
                self._renumber(self._table, [p for p in self._alive() if p.table is self._table], code="I")
                packed = self._table.pack(w.counts)
            self._packed.append(weakref.ref(packed))
            if len(self._packed) >= 64 and len(self._packed) & (len(self._packed) - 1) == 0:
                self._alive()  # dropped ones pruned at each power of two
        return replace(w, counts=packed)

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
            live: set[int] = set()
            for p in alive:
                live.update(p._state[1])
            stacks = len({k & _STACK_MASK for k in live})
            tasks = len({k >> 32 for k in live})
            if len(table) - stacks <= max(stacks // 4, 1024) and len(table.tasks) - tasks <= max(tasks // 4, 1024):
                self._check_at = (len(table) + max(len(table) // 4, 4096),
                                  len(table.tasks) + max(len(table.tasks) // 4, 4096))
                return
            # Frames are kept (shared) unless they too outnumber what can be live by far.
            renumber_frames = len(table.frames) > 64 * stacks + 65536
            try:
                self._renumber(table, alive, code=table.code, frames=not renumber_frames, live=live)
            except OverflowError:  # the live frames alone need 4-byte numbers
                self._renumber(table, alive, code="I", frames=False, live=live)
            self.sweeps += 1

    def _renumber(self, table: StackTable, alive: list[PackedCounts], *, code: str, frames: bool = True,
                  live: set[int] | None = None) -> None:
        """Number the keys of ``alive`` in a new table (``frames``: sharing the old
        one's frames) and move them to it (under _intern_lock)."""
        if live is None:
            live = set()
            for p in alive:
                live.update(p._state[1])
        new = StackTable((table.frame_ids, table.frames) if frames else None, code)
        same = frames and code == table.code  # the stacks' bytes carry over as they are
        remap: dict[int, int] = {}
        for k in sorted(live):  # stacks in their old order: the new buffer is filled front to back
            si = k & _STACK_MASK
            b = table.stack_bytes(si) if same else new.encode_stack(table.stack(si))
            remap[k] = new._task_id(table.tasks[k >> 32]) << 32 | new._stack_id(b)
        for p in alive:
            _, keys, vals = p._state
            p._state = (new, array("Q", map(remap.__getitem__, keys)), vals)
        self._table = new
        self._check_at = (len(new) + max(len(new) // 4, 4096), len(new.tasks) + max(len(new.tasks) // 4, 4096))

    def distinct_keys(self) -> int:
        """Distinct stacks numbered: those of the windows alive, and those of windows
        gone until the next sweep (at most a quarter more, or 4,096)."""
        with self._intern_lock:
            return len(self._table)

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
        """(windows, stack entries) held."""
        with self._cond:
            return len(self._windows), self._stacks
