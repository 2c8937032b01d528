"""Turning the (code address, instruction) pairs of a Python stack into frames.

:class:`CodeSymbolizer` reads code objects of one process (pid + start time)
through process_vm_readv, batched, every read bounded, and gives flamed's
Python frame format ``NAME (FILENAME:LINE)``.  A code object is read once and
cached by address with a guard (its type, name, filename and line-table
pointers and first line); a cached entry is re-checked against those few
bytes at most once per :meth:`~CodeSymbolizer.begin_batch`, so a code object
freed and its memory reused is noticed.  After the process exits the cache
keeps answering.  Failures never raise: they are counted in ``stats`` by
reason and shown as ``[unknown python code 0x...]``.

A name read now is right for a sample taken earlier only if the code object
at that address stayed the same in between: a module's top level, an
``exec``'d or ``eval``'d code object is freed when it finishes, and the next
code object made (a function of the module just imported, the program's own
functions after start-up) often lands at its address.  So an address whose
guard changed within a batch is not named by its new occupant for the
stacks of that batch (they may have been sampled before the change): it is
``[stale python code 0x...]`` until the next batch; stacks named while the
process ran (:meth:`~CodeSymbolizer.symbolize_fresh`, right after their
first sample) keep those names (flamed.sampling.pyframes).  From 3.11 an
instruction outside the code object's bytecode also shows the frame was not
that code object's: the same marker.

Where the BPF program read a guard for a frame when its stack was new
(``guards``: :func:`~flamed.sampling.cpython.layout.code_guard` of the code
object then at the address), the guard decides: a cached code object with
that guard is the sampled one and names the frame without a read; else the
code object there now is read, and named only if its guard is the sample's.
A frame whose code object was replaced gets ``[stale python code 0x...]``
(counted as ``guard_stale``), never its successor's name.

A code object freed but not yet replaced still holds its fields (so its
guard still matches), but not its strings: a module's ``<module>`` name is
not interned and goes with it, and its memory soon holds another string.
So a code object is read only while it lives: its reference count (the
first word, where the allocator keeps its free list once it is freed) must
be plausible, before and after its strings are read; one that is not is
counted as ``freed`` and its frame is ``[unknown python code 0x...]``,
unless a name read while it lived is cached.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from flamed.model import sanitize_frame
from flamed.sampling.cpython.layout import ENTRY_BIT, Layout, code_guard
from flamed.sampling.cpython.memory import ProcessMemory
from flamed.sampling.cpython.objects import MAX_NAME, read_objects
from flamed.sampling.cpython.process import Target
from flamed.sampling.pystack import short_filename

MAX_PATH = 4096
MAX_LINETABLE = 64 << 10

STAT_REASONS = ("read_failed", "not_code", "bad_string", "bad_linetable", "stale", "process_gone",
                "outside_code", "guard_stale", "freed")

#: Above this a code object's first word is no reference count but the
#: allocator's free-list pointer (an address): the object was freed.  A live
#: one's count is small; an immortal one's (3.12+) at most 2**32 - 1.
MAX_REFCNT = 0xFFFFFFFF


@dataclass(slots=True)
class _Code:
    guard: bytes
    name: str
    filename: str
    firstlineno: int
    linetable: bytes
    checked: int  # the batch it was last checked in
    #: its guard as the BPF program computes it (code_guard)
    sample_guard: int = 0
    #: 3.11+: code units of its bytecode (ob_size), to check an instruction against; 0: unknown
    units: int = 0
    #: instruction -> finished frame, bounded (a hot loop samples few instructions)
    frames: dict[int, str] = field(default_factory=dict)


def _u64(data: bytes, off: int) -> int:
    value: int = struct.unpack_from("<Q", data, off)[0]
    return value


# ---- line tables ----


def line_lnotab(table: bytes, firstlineno: int, addr: int) -> int:
    """3.8-3.9 co_lnotab: (byte increment, signed line increment) pairs."""
    line = firstlineno
    pos = 0
    for i in range(0, len(table) - 1, 2):
        pos += table[i]
        if pos > addr:
            break
        delta = table[i + 1]
        line += delta - 256 if delta >= 128 else delta
    return line


def line_310(table: bytes, firstlineno: int, addr: int) -> int | None:
    """3.10 co_linetable: (byte length, signed line delta or -128 for none) pairs."""
    line = firstlineno
    end = 0
    for i in range(0, len(table) - 1, 2):
        start = end
        end += table[i]
        delta = table[i + 1]
        if delta != 128:
            line += delta - 256 if delta >= 128 else delta
        if start <= addr < end:
            return None if delta == 128 else line
    return None


def _varint(table: bytes, pos: int) -> tuple[int, int]:
    shift = 0
    value = 0
    while pos < len(table):
        b = table[pos]
        pos += 1
        value |= (b & 63) << shift
        shift += 6
        if not b & 64:
            break
    return value, pos


def line_locations(table: bytes, firstlineno: int, unit: int) -> int | None:
    """3.11+ location table: entries of (code, length in code units) and deltas."""
    line = firstlineno
    end = 0
    pos = 0
    n = len(table)
    while pos < n:
        first = table[pos]
        if not first & 0x80:
            return None  # lost sync: not a location table
        pos += 1
        code = (first >> 3) & 15
        start = end
        end += (first & 7) + 1
        has_line = True
        if code == 15:
            has_line = False
        elif code == 14:
            raw, pos = _varint(table, pos)
            line += -(raw >> 1) if raw & 1 else raw >> 1
            for _ in range(3):
                _, pos = _varint(table, pos)
        elif code == 13:
            raw, pos = _varint(table, pos)
            line += -(raw >> 1) if raw & 1 else raw >> 1
        elif code >= 10:
            line += code - 10
            pos += 2
        else:
            pos += 1
        if start <= unit < end:
            return line if has_line else None
    return None


class CodeSymbolizer:
    """Names of the code objects of one process (pid + start time)."""

    def __init__(
        self,
        pid: int,
        start_time: int,
        layout: Layout,
        *,
        memory: ProcessMemory | None = None,
        max_entries: int = 16384,
        short_filenames: bool = False,
    ) -> None:
        self.pid = pid
        self.start_time = start_time
        self.layout = layout
        self.memory = memory or ProcessMemory(pid)
        self.max_entries = max_entries
        #: Bound of the batch's (code, instruction) -> frame index.
        self.max_named = 1 << 18
        #: File names as py-spy shows them (``json/decoder.py``, not the
        #: installation's full path), so both Python paths give equal frames.
        self.short_filenames = short_filenames
        self.stats: dict[str, int] = dict.fromkeys(STAT_REASONS, 0)
        self.reads = 0  # code objects read from the process
        self._cache: OrderedDict[int, _Code] = OrderedDict()
        #: (code address as given, instruction) -> frame, for code objects
        #: checked in this batch only: emptied by begin_batch and whenever an
        #: entry leaves the cache.  With a guard: ((address, instruction),
        #: guard) -> frame, for a guard that matched (or 0, as without).
        self._named: dict[object, str] = {}
        self._batch = 0
        #: Addresses whose code object changed within this batch: named
        #: ``[stale python code ...]`` by :meth:`symbolize` until the next.
        self._changed: set[int] = set()
        self._code_type = 0
        self._gone = False
        # One read covers the code object's fields that name a frame.
        fields = [layout.object_type, layout.code_name, layout.code_filename, layout.code_firstlineno,
                  layout.code_linetable]
        if layout.code_qualname is not None:
            fields.append(layout.code_qualname)
        if layout.code_adaptive is not None:
            fields.append(layout.object_type + 8)  # ob_size: a code object is a PyVarObject
        self._head_size = max(fields) + 8

    @classmethod
    def for_target(cls, target: Target, *, short_filenames: bool = False) -> CodeSymbolizer:
        return cls(target.pid, target.start_time, target.layout, short_filenames=short_filenames)

    def begin_batch(self) -> None:
        """Start a drain: cached entries are re-checked (once) when next used."""
        self._batch += 1
        self._named = {}
        self._changed = set()

    def process_exited(self) -> None:
        """The process is gone: serve cached names, read nothing more."""
        self._gone = True

    def __len__(self) -> int:
        return len(self._cache)

    def _count(self, reason: str) -> None:
        self.stats[reason] = self.stats.get(reason, 0) + 1

    def _guard(self, head: bytes) -> bytes:
        lay = self.layout
        parts = [head[lay.object_type : lay.object_type + 8], head[lay.code_name : lay.code_name + 8],
                 head[lay.code_filename : lay.code_filename + 8],
                 head[lay.code_firstlineno : lay.code_firstlineno + 4],
                 head[lay.code_linetable : lay.code_linetable + 8]]
        if lay.code_qualname is not None:
            parts.append(head[lay.code_qualname : lay.code_qualname + 8])
        return b"".join(parts)

    @staticmethod
    def _alive(head: bytes) -> bool:
        """Does the object whose first bytes are ``head`` look alive (not freed)?"""
        return 0 < _u64(head, 0) <= MAX_REFCNT

    def _sample_guard(self, head: bytes) -> int:
        lay = self.layout
        return code_guard(_u64(head, lay.code_guard_name), _u64(head, lay.code_filename),
                          struct.unpack_from("<I", head, lay.code_firstlineno)[0])

    def symbolize_fresh(self, frames: Sequence[tuple[int, int]], *,
                        guards: Sequence[int] | None = None) -> list[str]:
        """:meth:`symbolize` for a stack seen for the first time, while the process
        runs: every cached code object of it is read again, even one checked in
        this drain.  A code object freed since (a module's top level, run once)
        can have left its address to a new one (the function the new stack
        shows), and a new stack is when that shows.  The names are those of
        the code objects there now, the nearest there is to the sample's
        (with ``guards``: the sample's, or the stale marker)."""
        return self.symbolize(frames, recheck=True, guards=guards)

    def symbolize(self, frames: Sequence[tuple[int, int]], *, recheck: bool = False,
                  guards: Sequence[int] | None = None) -> list[str]:
        """Frames (innermost first, as given) in ``NAME (FILENAME:LINE)`` form.
        ``guards``: each frame's guard read by the BPF program (0: not read),
        see the module doc."""
        if guards is not None and (len(guards) != len(frames) or not any(guards)):
            guards = None
        if not recheck:
            try:
                # Every code object checked in this batch already: C speed.
                if guards is None:
                    return list(map(self._named.__getitem__, frames))
                return list(map(self._named.__getitem__, zip(frames, guards)))
            except (KeyError, TypeError):
                pass
        codes = list(dict.fromkeys(addr & ~ENTRY_BIT for addr, _ in frames))
        cache = self._cache
        # A cached code object with the sample's guard is the sampled one: not read again.
        same = set()
        if guards is not None:
            for (addr, _), g in zip(frames, guards):
                entry = cache.get(addr & ~ENTRY_BIT)
                if g and entry is not None and entry.sample_guard == g:
                    same.add(addr & ~ENTRY_BIT)
        self._revalidate([c for c in codes if c in cache and c not in same], recheck=recheck)
        missing = [c for c in codes if c not in self._cache]
        if missing:
            self._load(missing)
        for code in codes:
            if code in cache:
                cache.move_to_end(code)
        named = self._named
        if len(named) > self.max_named:
            named.clear()
        batch = self._batch
        out = []
        changed = self._changed if not recheck else frozenset()
        for k, (addr, instr) in enumerate(frames):
            code = addr & ~ENTRY_BIT
            g = guards[k] if guards is not None else 0
            entry = cache.get(code)
            if entry is None:
                out.append(f"[unknown python code 0x{code:x}]")
                continue
            if g:
                if entry.sample_guard != g:
                    # Not the sampled code object: freed, another made there since.
                    self._count("guard_stale")
                    out.append(f"[stale python code 0x{code:x}]")
                    continue
            elif code in changed:
                # Another code object than the sample's may be there now.
                out.append(f"[stale python code 0x{code:x}]")
                continue
            frame = entry.frames.get(instr)
            if frame is None and not self._inside(code, entry, instr):
                self._count("outside_code")
                frame = f"[stale python code 0x{code:x}]"
                if len(entry.frames) < 256:
                    entry.frames[instr] = frame
            if frame is None:
                line = self._line(code, entry, instr)
                filename = short_filename(entry.filename) if self.short_filenames else entry.filename
                frame = sanitize_frame(f"{entry.name} ({filename}:{line})")
                if len(entry.frames) < 256:
                    entry.frames[instr] = frame
            # Checked in this batch and unchanged since: the next stack with this frame needs no read.
            current = (entry.checked == batch or self._gone) and code not in self._changed
            if guards is None:
                if current:
                    named[(addr, instr)] = frame
            elif g or current:
                # A guard that matched names this frame whatever happens at the address later.
                named[((addr, instr), g)] = frame
            out.append(frame)
        return out

    def _inside(self, code: int, entry: _Code, instr: int) -> bool:
        """Can ``instr`` be an instruction of ``entry`` (3.11+; before, always)?
        The frame's instruction pointer is one unit before the first
        instruction until that runs, and may be just past the last."""
        adaptive = self.layout.code_adaptive
        if adaptive is None or not entry.units:
            return True
        base = code + adaptive
        return base - 2 <= instr <= base + 2 * entry.units

    def _line(self, code: int, entry: _Code, instr: int) -> int:
        lay = self.layout
        line: int | None
        if lay.code_adaptive is None:
            lasti = instr - (1 << 32) if instr >= 1 << 31 else instr
            if lasti < 0:
                return entry.firstlineno
            if lay.line_format == "lnotab":
                return line_lnotab(entry.linetable, entry.firstlineno, lasti * lay.lasti_unit)
            line = line_310(entry.linetable, entry.firstlineno, lasti * lay.lasti_unit)
        else:
            base = code + lay.code_adaptive
            if instr < base:
                return entry.firstlineno
            line = line_locations(entry.linetable, entry.firstlineno, (instr - base) // 2)
        return entry.firstlineno if line is None else line

    def _revalidate(self, cached: list[int], *, recheck: bool = False) -> None:
        todo = cached if recheck else [c for c in cached if self._cache[c].checked != self._batch]
        if not todo or self._gone:
            return
        heads = self.memory.read_many([(c, self._head_size) for c in todo])
        for code, head in zip(todo, heads):
            entry = self._cache[code]
            if head is None:
                if self.memory.last_errno == 3:  # ESRCH: exited, keep what we know
                    self._gone = True
                    return
                self._evict(code)
                self._count("stale")
            elif self._guard(head) != entry.guard:
                self._evict(code)
                self._count("stale")
                if not recheck:
                    self._changed.add(code)
            else:
                entry.checked = self._batch

    def _load(self, codes: list[int]) -> None:
        if self._gone:
            self.stats["process_gone"] += len(codes)
            return
        lay = self.layout
        heads = self.memory.read_many([(c, self._head_size) for c in codes])
        good: list[tuple[int, bytes]] = []
        for code, head in zip(codes, heads):
            if head is None:
                if self.memory.last_errno == 3:
                    self._gone = True
                self._count("read_failed")
                continue
            ob_type = _u64(head, lay.object_type)
            if not self._is_code_type(ob_type):
                self._count("not_code")
                continue
            if not self._alive(head):
                self._count("freed")
                continue
            good.append((code, head))
        if not good:
            return
        name_field = lay.code_qualname if lay.code_qualname is not None else lay.code_name
        strs = read_objects(
            self.memory, lay,
            [(_u64(h, name_field), MAX_NAME) for _, h in good] + [(_u64(h, lay.code_filename), MAX_PATH) for _, h in good],
            unicode=True,
        )
        tables = read_objects(self.memory, lay, [(_u64(h, lay.code_linetable), MAX_LINETABLE) for _, h in good],
                               unicode=False)
        n = len(good)
        # Still alive, and the same, once its strings are read: else they may be another object's.
        again = self.memory.read_many([(c, self._head_size) for c, _ in good])
        for k, (code, head) in enumerate(good):
            after = again[k]
            if after is None or not self._alive(after) or self._guard(after) != self._guard(head):
                self._count("freed")
                continue
            name, filename, table = strs[k], strs[n + k], tables[k]
            failed = next((x[0] for x in (name, filename, table) if isinstance(x, tuple)), None)
            if failed is not None:
                self._count(failed)
                continue
            if not isinstance(name, str) or not isinstance(filename, str) or not isinstance(table, bytes):
                self._count("read_failed")
                continue
            self.reads += 1
            first = struct.unpack_from("<i", head, lay.code_firstlineno)[0]
            units = _u64(head, lay.object_type + 8) if lay.code_adaptive is not None else 0
            self._cache[code] = _Code(self._guard(head), name, filename, first, table, self._batch,
                                      sample_guard=self._sample_guard(head),
                                      units=units if units < 1 << 31 else 0)
            while len(self._cache) > self.max_entries:
                self._evict(next(iter(self._cache)))

    def _evict(self, code: int) -> None:
        """Drop a cached code object, and every finished frame that names it."""
        del self._cache[code]
        if self._named:
            self._named = {}

    def _is_code_type(self, ob_type: int) -> bool:
        if self._code_type:
            return ob_type == self._code_type
        raw = self.memory.read(ob_type + self.layout.type_name, 8)
        if raw is None:
            return False
        name = self.memory.read(_u64(raw, 0), 8)
        if name is None or name[:5] != b"code\0":
            return False
        self._code_type = ob_type
        return True
