"""Count keys numbered in a table: how windows are held compactly.

A :class:`StackTable` numbers each distinct task once, each distinct stack
once (as an array of frame numbers) and each frame string once; a window is
then two arrays (:class:`PackedCounts`), the (task, stack) numbers of its
entries and their counts.  The snapshot ring (flamed/daemon/ring.py) keeps
its windows so; the BPF drain numbers the stacks it names straight into the
ring's table (:class:`PackedBuilder`), so that no tuple of frames per key is
built for a window that is only going to be packed (docs/bpf.md, "Where a
large drain's memory stays").
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Callable, Hashable, ItemsView, Iterable, Iterator, Mapping, MutableMapping, ValuesView
from contextlib import AbstractContextManager
from typing import Protocol, TypeVar

from flamed.model import Stack, encode_frame
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
    and 16-24 bytes, and no Python object of its own (long-lived objects by the
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
        #: Stack i is _blob[_offs[i]:_offs[i + 1]]; _hashes[i] is the low 32 bits of hash() of
        #: those bytes (all a slot needs; a match is confirmed on the bytes).  4 bytes each, and
        #: 4 per slot below: 16-24 bytes a stack less than 8-byte arrays (12 MB at 500 k stacks).
        #: Offsets go to 8 bytes if the buffer ever passes 4 GiB.
        self._offs = array("I", [0])
        self._hashes = array("I")
        #: (slots, mask): stack numbers by hash, linear probing, -1 where free; at most half
        #: full.  One attribute, so that a reader never sees a new array with the old mask.
        self._index = (array("i", [-1]) * 1024, 1023)
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
        h &= 0xFFFFFFFF
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

    def stack_number(self, b: bytes) -> int:
        h = hash(b)
        slots, mask = self._index
        i = self._probe(slots, mask, b, h)
        si = slots[i]
        if si >= 0:
            return si
        si = len(self._hashes)
        self._blob += b
        try:
            self._offs.append(len(self._blob))
        except OverflowError:  # past 4 GiB of frames: a copy with 8-byte offsets replaces the array
            offs = array("Q", self._offs)
            offs.append(len(self._blob))
            self._offs = offs
        self._hashes.append(h & 0xFFFFFFFF)  # before the slot: a reader that finds the slot finds its hash
        slots[i] = si
        if 2 * len(self._hashes) > len(slots):
            self._grow()
        return si

    def _grow(self) -> None:
        n = 2 * len(self._index[0])
        slots, mask = array("i", [-1]) * n, n - 1
        for si, h in enumerate(self._hashes):
            i = h & mask
            while slots[i] >= 0:
                i = (i + 1) & mask
            slots[i] = si
        self._index = (slots, mask)

    def task_number(self, t: _Task) -> int:
        return _number(self.task_ids, self.tasks, t)

    def encode_stack(self, stack: Stack) -> bytes:
        """The stack's frame numbers as bytes (OverflowError: a number too large for ``code``)."""
        try:
            return array(self.code, map(self.frame_ids.__getitem__, stack)).tobytes()
        except KeyError:  # a frame seen for the first time
            return array(self.code, map(self._frame_id, stack)).tobytes()

    def number(self, counts: Mapping[CountKey, int], into: dict[int, int] | None = None) -> dict[int, int]:
        """``counts`` by packed key (task number << 32 | stack number), added to ``into`` if given."""
        out: dict[int, int] = {} if into is None else into
        task_ids = self.task_ids
        encode, stack_number = self.encode_stack, self.stack_number
        for (tgid, tid, comm, stack), n in counts.items():
            t = (tgid, tid, comm)
            ti = task_ids.get(t)
            if ti is None:
                ti = self.task_number(t)
            k = ti << 32 | stack_number(encode(stack))
            out[k] = out.get(k, 0) + n
        return out

    def pack(self, counts: Mapping[CountKey, int]) -> PackedCounts:
        """``counts`` as a window of this table."""
        return self.window(self.number(counts))

    def window(self, numbered: dict[int, int]) -> PackedCounts:
        """Counts by packed key (:meth:`number`) as a window of this table."""
        return PackedCounts(self, array("Q", numbered.keys()), array("q", numbered.values()))

    def packed_key(self, key: CountKey) -> int | None:
        """``key``'s packed number if its task and stack are numbered (nothing is added)."""
        tgid, tid, comm, stack = key
        ti = self.task_ids.get((tgid, tid, comm))
        if ti is None:
            return None
        si = self.find_stack(stack)
        return None if si is None else ti << 32 | si

    # -- decoding (any thread) -----------------------------------------------
    def frame_numbers(self, si: int) -> array[int]:
        """Stack ``si``'s frame numbers, root first."""
        a = array(self.code)
        # A slice is a copy: no view of the buffer is held while the drain thread appends to it.
        a.frombytes(self._blob[self._offs[si]: self._offs[si + 1]])
        return a

    def stack(self, si: int) -> Stack:
        return tuple(map(self.frames.__getitem__, self.frame_numbers(si)))

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
        k = table.packed_key(key)
        if k is None:
            raise KeyError(key)
        try:
            return vals[keys.index(k)]
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


class PackedBuilder(MutableMapping[CountKey, int]):
    """A window's counts while it is built, numbered in ``table`` as they come.

    The BPF drain fills :attr:`packed` (packed key -> count) straight from the
    frame numbers of the parts it names, so that a key never exists as a
    tuple of frames.  Keys set later through the mapping (window processors,
    events nobody claimed) go to :attr:`packed` when ``table`` already numbers
    their task and stack, and otherwise to :attr:`extra`, as tuples: this
    object only reads the table (a reader's right, without a lock), and the
    ring numbers the extra keys when it packs the window
    (:meth:`~flamed.daemon.ring.WindowRing.pack`)."""

    __slots__ = ("table", "packed", "extra")

    def __init__(self, table: StackTable, packed: dict[int, int] | None = None) -> None:
        self.table = table
        self.packed: dict[int, int] = {} if packed is None else packed
        self.extra: dict[CountKey, int] = {}

    def __len__(self) -> int:
        return len(self.packed) + len(self.extra)

    def __iter__(self) -> Iterator[CountKey]:
        yield from map(self.table.key, self.packed)
        yield from self.extra

    def __getitem__(self, key: CountKey) -> int:
        n = self.extra.get(key)
        if n is not None:
            return n
        k = self.table.packed_key(key)
        if k is None or k not in self.packed:
            raise KeyError(key)
        return self.packed[k]

    def __setitem__(self, key: CountKey, n: int) -> None:
        if key not in self.extra:
            k = self.table.packed_key(key)
            if k is not None:
                self.packed[k] = n
                return
        self.extra[key] = n

    def __delitem__(self, key: CountKey) -> None:
        if key in self.extra:
            del self.extra[key]
            return
        k = self.table.packed_key(key)
        if k is None or k not in self.packed:
            raise KeyError(key)
        del self.packed[k]

    def values(self) -> ValuesView[int]:
        return _BuilderValues(self)


class _BuilderValues(ValuesView[int]):
    _mapping: PackedBuilder

    def __iter__(self) -> Iterator[int]:
        yield from self._mapping.packed.values()
        yield from self._mapping.extra.values()


class Numbering(Protocol):
    """Where a drain numbers the keys of its windows (the snapshot ring's table)."""

    def numbering(self) -> AbstractContextManager[StackTable]:
        """The table to number in, held for the ``with`` block (no other writer meanwhile)."""

    def widen(self, table: StackTable) -> None:
        """``table`` ran out of 2-byte frame numbers: number in 4 bytes from now on."""


class MergedByRoot:
    """Packed windows of one table merged by folded line: (root frames, stack)
    -> count, as numbers, for writing them as folded text without a tuple of
    frames per line (the daemon's files: flamed/daemon/store.py).

    ``root_of(task)`` gives a task's root frames; tasks with the same root
    frames and stack fold into one line, as :func:`~flamed.sampling.contract.counts_to_profile`
    folds them."""

    def __init__(self, table: StackTable, parts: Iterable[PackedCounts],
                 root_of: Callable[[_Task], Stack]) -> None:
        self.table = table
        self.roots: list[Stack] = []
        root_ids: dict[Stack, int] = {}
        by_task: dict[int, int] = {}
        counts: dict[int, int] = {}
        tasks = table.tasks
        for part in parts:
            _table, keys, vals = part._state
            for k, n in zip(keys, vals):
                t = k >> 32
                r = by_task.get(t)
                if r is None:
                    r = by_task[t] = _number(root_ids, self.roots, root_of(tasks[t]))
                mk = r << 32 | (k & _STACK_MASK)
                counts[mk] = counts.get(mk, 0) + n
        #: root number << 32 | stack number -> count
        self.counts = counts

    def sorted_keys(self) -> list[int]:
        """The keys in the order of their frames (root frames, then the stack),
        compared as tuples of strings: each frame's rank among all frames,
        big-endian in 2 bytes (4 past 65,535 names), end to end, compares as
        the tuples would.  One key of bytes per line, made once by the sort
        (a memo of them beside the sort's own, 4 bytes a frame, was ~100 MB
        at 400 k lines)."""
        table = self.table
        names = sorted(set(table.frames).union(*self.roots))
        code = "H" if len(names) < 0xFFFF else "I"
        rank = {f: i + 1 for i, f in enumerate(names)}
        by_number = [rank[f] for f in table.frames]
        roots = [_big_endian(array(code, map(rank.__getitem__, r))) for r in self.roots]
        del rank, names
        frame_numbers = table.frame_numbers
        single = len(roots) == 1 and not roots[0]

        def key(mk: int) -> bytes:
            b = _big_endian(array(code, map(by_number.__getitem__, frame_numbers(mk & _STACK_MASK))))
            return b if single else roots[mk >> 32] + b

        return sorted(self.counts, key=key)

    def lines(self, keys: Iterable[int], weigh: Callable[[int], int] | None = None) -> Iterator[bytes]:
        """Folded lines (``root;...;leaf COUNT\\n``) of ``keys``, counts through
        ``weigh`` if given (a line whose weight is 0 is left out)."""
        table = self.table
        frames = [encode_frame(f) for f in table.frames]
        roots = [b";".join(map(encode_frame, r)) for r in self.roots]
        frame_numbers, counts = table.frame_numbers, self.counts
        for mk in keys:
            n = counts[mk] if weigh is None else weigh(counts[mk])
            if not n:
                continue
            stack = b";".join(map(frames.__getitem__, frame_numbers(mk & _STACK_MASK)))
            root = roots[mk >> 32]
            yield b"%s%s%s %d\n" % (root, b";" if root and stack else b"", stack, n)


def _big_endian(a: array[int]) -> bytes:
    if sys.byteorder == "little":
        a.byteswap()
    return a.tobytes()


def weight_by_tgid(counts: Mapping[CountKey, int]) -> dict[int, int]:
    """tgid -> the sum of its counts; packed counts are not decoded for it."""
    out: dict[int, int] = {}
    rest: Iterable[tuple[CountKey, int]] = counts.items()
    if isinstance(counts, (PackedBuilder, PackedCounts)):
        numbered: Iterable[tuple[int, int]]
        if isinstance(counts, PackedBuilder):
            tasks, numbered, rest = counts.table.tasks, counts.packed.items(), counts.extra.items()
        else:
            table, keys, vals = counts._state
            tasks, numbered, rest = table.tasks, zip(keys, vals), ()
        for k, n in numbered:
            tgid = tasks[k >> 32][0]
            out[tgid] = out.get(tgid, 0) + n
    for (tgid, _tid, _comm, _stack), n in rest:
        out[tgid] = out.get(tgid, 0) + n
    return out
