"""Unwind tables on disk and in the BPF maps of bpf/unwind.bpf.c.

:class:`TableCache` builds a binary's rows once (:func:`ehframe.build_table`)
and keeps them on disk under its build id, so a library shared by hundreds of
processes is parsed once, and a restart reuses the work.

:class:`Unwinder` describes processes to the program: for each executable
file mapping of a process it loads the binary's rows into ``uw_rows`` (once
per binary: a contiguous range of one preallocated array, bounded by
``unwind_rows``) and writes the process's sorted mapping list into
``uw_procs``.  When a table does not fit, the tables no process was sampled
with for ``EVICT_IDLE_S`` are evicted, least recently sampled first, before
anything is refused: a bcc tool that compiled once (libLLVM and libclang-cpp,
2 M rows) and then sleeps must not keep the host's other binaries out.  It runs in its own thread: building the table of a large
library takes seconds (libLLVM: ~2.6 s here), and samples taken meanwhile
keep their frame-pointer stacks.
"""

from __future__ import annotations

import array
import ctypes as ct
import logging
import mmap
import os
import queue
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from flamed.procstat import running
from flamed.sampling.mappedfile import mapped_file
from flamed.sampling.unwind import ehframe

log = logging.getLogger("flamed.unwind")

_MAGIC = b"FLUWT001"
_HEADER = struct.Struct("<8sII")  # magic, rows, fdes
_MAP = struct.Struct("<QQQIIIIII")  # struct flamed_uw_map

#: Binaries whose mapping is never worth a table: the kernel's vDSO and
#: friends are not files; everything else file-backed and executable is.
_PSEUDO = ("[vdso]", "[vsyscall]", "[vvar]")


#: .eh_frame bytes per row, roughly (libc 5.4, libLLVM 5.3, CPython 6.4):
#: estimates a table's size before it is built.
_CFI_BYTES_PER_ROW = 5
#: A binary whose table would take more than this fraction of unwind_rows is
#: loaded only when a sample lands in it.
_LAZY_FRACTION = 16
#: A table none of whose processes had an unwound sample for this long may
#: be evicted to make room (a drain interval is 10 s by default).
EVICT_IDLE_S = 30.0
#: How long stopping waits for a table being built (see Unwinder.stop).
BUILDER_STOP_WAIT_S = 1.0


class TableEntry(NamedTuple):
    key: str
    first: int
    rows: int
    name: str = ""
    #: the page index (bpf/flamed.h): its slots sit just before the rows, so
    #: the table's range of uw_rows is [first - index_rows, first + rows)
    index_rows: int = 0
    base: int = 0
    pages: int = 0
    #: names this load of the table in the program's row cache (bpf/unwind.bpf.c): from 1, never
    #: given twice, so that rows reloaded at the same place are not taken for the old ones
    serial: int = 0

    @property
    def slots(self) -> int:
        """Slots of uw_rows the table takes: its rows and its page index."""
        return self.rows + self.index_rows


#: What _load returns for a large table handed to the builder thread.
_BUILDING = TableEntry("(building)", 0, 0)


@dataclass
class UnwindStats:
    """What the unwinder has done, for metrics and status."""

    processes: int = 0  # described to the program now
    binaries: int = 0  # binaries whose rows are loaded
    rows_used: int = 0
    rows_capacity: int = 0
    tables_built: int = 0  # parsed from .eh_frame in this run
    tables_cached: int = 0  # read from the disk cache
    build_seconds: float = 0.0  # spent parsing
    #: binaries left without a table, by reason (no_cfi, rows_full, error)
    skipped: dict[str, int] = field(default_factory=lambda: {"no_cfi": 0, "rows_full": 0, "error": 0})
    #: mappings beyond unwind_maps left out of a process (they use frame pointers)
    mappings_dropped: int = 0
    #: times the rows were full of exited processes' binaries and were reloaded
    resets: int = 0
    #: tables evicted (and their rows) to make room: not sampled for EVICT_IDLE_S
    evicted: int = 0
    evicted_rows: int = 0
    #: rows copied into the mapped uw_rows (the rest went by batch updates)
    rows_mapped: int = 0
    #: the largest tables loaded: (binary, rows, seconds since a process using it was sampled)
    largest: list[tuple[str, int, float]] = field(default_factory=list)

    def copy(self) -> UnwindStats:
        c = UnwindStats(**{k: getattr(self, k) for k in self.__dataclass_fields__})
        c.skipped = dict(self.skipped)
        c.largest = list(self.largest)
        return c


class TableCache:
    """Rows of binaries by build id, built on first need and kept in ``directory``."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        self.built = 0
        self.cached = 0
        self.build_seconds = 0.0
        self._write_warned = False
        #: Built without a directory to keep them in: held until taken once.
        self._held: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def rows(self, path: str, info: ehframe.ElfInfo) -> tuple[str, bytes]:
        """(cache key, packed rows) of the binary at ``path``."""
        key = ehframe.file_key(path, info)
        cached = self.cached_rows(key)
        if cached is not None:
            return key, cached
        return key, self.build(path, info, key)

    def cached_rows(self, key: str) -> bytes | None:
        """The rows of ``key`` if they are built already (no parsing)."""
        with self._lock:
            held = self._held.pop(key, None)
        cached = held if held is not None else self._read(key)
        if cached is not None:
            with self._lock:
                self.cached += 1
        return cached

    def build(self, path: str, info: ehframe.ElfInfo, key: str, *, hold: bool = False) -> bytes:
        """Parse the binary's CFI and keep the rows (on disk; in memory until
        taken when ``hold`` and there is no directory)."""
        t0 = time.perf_counter()
        table = ehframe.build_table(path, info)
        packed = table.pack()
        with self._lock:
            self.build_seconds += time.perf_counter() - t0
            self.built += 1
            if hold and self.directory is None:
                self._held[key] = packed
        self._write(key, packed, table.fdes)
        return packed

    def _file(self, key: str) -> Path | None:
        return self.directory / f"{key}.uwt" if self.directory is not None else None

    def _read(self, key: str) -> bytes | None:
        p = self._file(key)
        if p is None:
            return None
        try:
            data = p.read_bytes()
        except OSError:
            return None
        if len(data) < _HEADER.size:
            return None
        magic, n, _fdes = _HEADER.unpack_from(data)
        body = data[_HEADER.size:]
        if magic != _MAGIC or len(body) != n * ehframe.ROW.size:
            log.info("unwind table cache %s is damaged: rebuilding it", p)
            return None
        return body

    def _write(self, key: str, packed: bytes, fdes: int) -> None:
        p = self._file(key)
        if p is None:
            return
        try:
            p.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
            fd, tmp = tempfile.mkstemp(prefix=".uwt-", dir=p.parent)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(_HEADER.pack(_MAGIC, len(packed) // ehframe.ROW.size, fdes))
                    f.write(packed)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, p)
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
        except OSError as e:
            # A full or read-only disk costs the next start a rebuild, nothing else.
            if not self._write_warned:
                self._write_warned = True
                log.warning("cannot keep unwind tables in %s (%s): they are rebuilt at each start; "
                            "set [sampling] unwind_cache_dir to a writable directory", p.parent, e.strerror)


class _File(NamedTuple):
    entry: TableEntry | None  # the rows, once loaded (None: not yet, or never)
    loads: tuple[tuple[int, int, int, int], ...]
    info: ehframe.ElfInfo | None  # kept while the table is not decided (a large binary not run yet)


class ExecMap(NamedTuple):
    start: int
    end: int
    offset: int
    dev: str
    inode: int
    path: str


def read_exec_maps(pid: int, proc: Path = Path("/proc")) -> list[ExecMap] | None:
    """The executable file mappings of ``pid`` (None when it is gone)."""
    try:
        text = (proc / str(pid) / "maps").read_text(errors="surrogateescape")
    except OSError:
        return None
    return [m for m in map(parse_exec_map, text.splitlines()) if m is not None]


def parse_exec_map(line: str) -> ExecMap | None:
    """One line of /proc/PID/maps, if it maps a file executable."""
    parts = line.split(None, 5)
    if len(parts) < 6 or "x" not in parts[1]:
        return None
    path = parts[5]
    if not path.startswith("/") or path in _PSEUDO:
        return None
    lo, _, hi = parts[0].partition("-")
    return ExecMap(int(lo, 16), int(hi, 16), int(parts[2], 16), parts[3], int(parts[4]), path)


class Unwinder:
    """Keeps ``uw_rows`` and ``uw_procs`` of a loaded program filled (see the module doc)."""

    def __init__(self, bpf: Any, lib: Any, *, rows_capacity: int, max_maps: int, max_procs: int,
                 cache: TableCache, proc: Path = Path("/proc"), skip: frozenset[int] = frozenset(),
                 on_described: Callable[[int, Sequence[int]], None] | None = None) -> None:
        self._bpf = bpf
        self._lib = lib
        self._rows = bpf["uw_rows"]
        self._rows_mmap = _mappable(getattr(self._rows, "map_fd", -1))  # see _write_rows
        self._procs = bpf["uw_procs"]
        self._maps = bpf["uw_maps"]
        self._max_maps = max_maps
        self._max_procs = max_procs
        self._cache = cache
        self._on_described = on_described
        self._proc = proc
        #: Processes never described: the sampler's own (bcc maps libLLVM and
        #: libclang-cpp into it, 2 M rows that would crowd out the host's).
        self._skip = skip
        self._lock = threading.Lock()
        #: (dev, inode, size, mtime) -> the binary's rows in uw_rows, if any
        self._by_file: dict[tuple[int, int, int, int], _File] = {}
        self._by_key: dict[str, TableEntry] = {}
        self._next = 0  # rows in use
        self._serial = 0  # of the last table loaded
        #: free ranges of uw_rows, (first, count), sorted, coalesced
        self._free: list[tuple[int, int]] = [(0, rows_capacity)] if rows_capacity > 0 else []
        #: table key -> monotonic time a process using it last had an unwound sample (or was loaded)
        self._last_used: dict[str, float] = {}
        self._clock = time.monotonic
        #: tables the description in progress has taken (never evicted under it)
        self._picking: set[str] = set()
        self._described: dict[int, tuple[tuple[int, int, int, int, int], ...]] = {}
        self._slots: dict[int, int] = {}  # tgid -> its block of unwind_maps entries in uw_maps
        self._free_slots = list(range(max_procs - 1, -1, -1))
        self._last_reclaim = -float("inf")  # clock of the last look for exited processes (_reclaim_slots)
        self._queue: queue.Queue[int | None] = queue.Queue()
        self._pending: set[int] = set()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._full_warned = False
        self._reset_due = False
        self._last_compact = -float("inf")  # clock of the last reload for scattered free rows
        self._builder: threading.Thread | None = None
        self._builds: queue.Queue[tuple[str, ehframe.ElfInfo, str] | None] = queue.Queue()
        self._building: set[str] = set()  # keys of large tables being built
        self._waiting: dict[str, set[int]] = {}  # key being built -> processes that map it
        self._want_keys: dict[int, set[str]] = {}  # tgid -> large tables to load at its next description
        self._wanted: dict[int, set[int]] = {}  # tgid -> sampled addresses without a table
        self._uses: dict[int, set[str]] = {}  # tgid -> keys of the tables its description uses
        self.stats = UnwindStats(rows_capacity=rows_capacity)

    # -- the worker ---------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="flamed-unwind", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        # The queue may hold many processes (a host full of new ones, a slow
        # machine): the worker ends after the one it is describing, not after
        # the queue, so that no write reaches the maps once they are closed.
        self._stopping.set()
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=30)
            if self._thread.is_alive():
                log.warning("the unwinder's worker did not stop within 30 s")
            self._thread = None
        if self._builder is not None:
            # A large table (libLLVM, libclang-cpp) takes seconds to build, more on
            # a loaded host, and a reload or stop must not wait for it: the builder
            # writes only the table cache (a whole file, renamed into place) and
            # ends after the table it is building.
            self._builds.put(None)
            self._builder.join(timeout=BUILDER_STOP_WAIT_S)
            if self._builder.is_alive():
                log.debug("the unwind table being built is left to finish in the background")
            self._builder = None

    def submit(self, tgid: int, addr: int | None = None, *, load_key: str | None = None) -> None:
        """Describe ``tgid`` (again: its mappings may have changed) soon;
        ``addr``: a sampled address its description lacked a table for;
        ``load_key``: a large table now built, to load for it."""
        if tgid in self._skip:
            return
        with self._lock:
            if addr is not None:
                self._wanted.setdefault(tgid, set()).add(addr)
            if load_key is not None:
                self._want_keys.setdefault(tgid, set()).add(load_key)
            if tgid in self._pending:
                return
            self._pending.add(tgid)
        self._queue.put(tgid)

    def _run(self) -> None:
        while True:
            tgid = self._queue.get()
            if tgid is None or self._stopping.is_set():
                return
            with self._lock:
                want = self._wanted.pop(tgid, set())
                keys = self._want_keys.pop(tgid, set())
            try:
                self.describe(tgid, want, keys)
                self._run_reset_if_due()
            except Exception as e:  # noqa: BLE001 -- one process must not stop the others
                log.warning("describing pid %d to the unwinder failed: %s", tgid, e)
            finally:
                with self._lock:
                    # A miss or a built table that came while it was being
                    # described (submit found it pending, so did not queue
                    # it): described again now.  Left for the next submit,
                    # the table waited for the next miss report, a second
                    # later at best (FLAMED_UW_MISS_NS), or for good.
                    again = tgid in self._wanted or tgid in self._want_keys
                    if not again:
                        self._pending.discard(tgid)
                if again:
                    self._queue.put(tgid)

    def idle(self) -> bool:
        """No process is waiting to be described (nor being described) now."""
        with self._lock:
            return not self._pending

    # -- processes ------------------------------------------------------------
    def described(self, tgid: int) -> bool:
        return tgid in self._described

    def note_sampled(self, tgids: set[int]) -> None:
        """``tgids`` had samples unwound from tables (each drain): their tables are in use."""
        now = self._clock()
        with self._lock:
            for tgid in tgids:
                for key in self._uses.get(tgid, ()):
                    self._last_used[key] = now
            self._refresh_largest(now)

    def _refresh_largest(self, now: float) -> None:
        top = sorted(list(self._by_key.values()), key=lambda e: -e.slots)[:5]
        self.stats.largest = [(e.name, e.slots, round(now - self._last_used.get(e.key, now), 1)) for e in top]

    def describe(self, tgid: int, want: set[int] | None = None, want_keys: set[str] | None = None) -> bool:
        """Load the tables of ``tgid``'s binaries and write its uw_procs entry;
        False when it is gone or has no binary with a table.

        A large binary (its table above 1/16 of ``unwind_rows``: libLLVM,
        a browser) is loaded only once a sample lands in it (an address in
        ``want``, from uw_miss): a process that maps it but does not run it
        (the way every bcc user maps libLLVM) costs no rows.  Until then its
        mapping is listed with no rows, and its frames use frame pointers.
        Its table is built in another thread (``want_keys`` names the tables
        built since, to load now)."""
        maps = read_exec_maps(tgid, self._proc)
        if maps is None:
            self.forget(tgid)
            return False
        want = want or set()
        want_keys = want_keys or set()
        entries: list[tuple[int, int, int, TableEntry, int]] = []  # start, end, bias, table, size
        keys: set[str] = set()
        self._picking = keys
        try:
            for m in maps:
                load = any(m.start <= a < m.end for a in want)
                got = self._table_for(tgid, m, load, want_keys)
                if got is None:
                    continue
                entry, bias = got
                if entry.rows:
                    keys.add(entry.key)
                entries.append((m.start, m.end, bias, entry, m.end - m.start))
        finally:
            self._picking = set()
        if len(entries) > self._max_maps:
            # Keep the largest code: the main program, the interpreter, libc
            # before a small extension module.
            if not self.stats.mappings_dropped:
                log.warning("pid %d has %d executable mappings with unwind tables, more than sampling.unwind_maps "
                            "(%d): the %d smallest keep frame-pointer stacks (cut at their first frame where "
                            "built without frame pointers); raise sampling.unwind_maps (a power of 2, up to 256) "
                            "for processes with many extension modules", tgid, len(entries), self._max_maps,
                            len(entries) - self._max_maps)
            self.stats.mappings_dropped += len(entries) - self._max_maps
            entries = sorted(entries, key=lambda e: -e[4])[: self._max_maps]
        entries.sort(key=lambda e: e[0])
        sig = tuple((e[0], e[1], e[3].first, e[3].rows, e[3].serial) for e in entries)
        if self._described.get(tgid) == sig:
            return bool(entries)
        if not any(e[3].rows for e in entries):
            self.forget(tgid)
            return False
        if not self._free_slots:
            self._reclaim_slots()
        if not self._free_slots:
            # (A process described before keeps its description: a fresh block is
            # written before the switch, and there is none.)
            log.debug("unwind_max_procs reached: pid %d keeps %s", tgid,
                      "its earlier description" if tgid in self._slots else "frame-pointer stacks")
            return False
        # A fresh block, then the switch: a sample never sees a half-written list.
        slot = self._free_slots.pop()
        base = slot * self._max_maps
        packed = b"".join(_MAP.pack(start, end, bias & 0xFFFFFFFFFFFFFFFF, t.first, t.first - t.index_rows,
                                    t.base, t.pages if t.rows else 0, t.serial if t.rows else 0, 0)
                          for start, end, bias, t, _size in entries)
        self._write_array(self._maps, base, packed, _MAP.size, len(entries))
        leaf = self._procs.Leaf()
        ct.memmove(ct.addressof(leaf), struct.pack("<II", slot, len(entries)), 8)
        self._procs[ct.c_uint32(tgid)] = leaf
        old = self._slots.get(tgid)
        if old is not None:
            self._free_slots.append(old)
        self._slots[tgid] = slot
        self._described[tgid] = sig
        self._uses[tgid] = keys
        self.stats.processes = len(self._described)
        if self._on_described is not None:
            # The symbolizer must know every mapping the unwinder walks
            # through: a process that exits before the next drain is named
            # from the mappings it was told of.
            self._on_described(tgid, [e[0] for e in entries])
        return True

    #: Seconds between two looks for exited processes when the slots run out.
    RECLAIM_EVERY_S = 1.0

    def _reclaim_slots(self) -> None:
        """Every slot is taken: free those of described processes that exited.
        Nothing else tells the unwinder of an exit (the watcher reports Python
        processes only), so on a host that starts thousands of processes, or a
        ``record --subprocesses`` of a build, the slots filled with the dead
        and the living kept frame-pointer stacks (and a process described
        again failed: "pop from empty list")."""
        now = self._clock()
        if now - self._last_reclaim < self.RECLAIM_EVERY_S:
            return
        self._last_reclaim = now
        gone = [t for t in list(self._described) if not running(self._proc / str(t) / "stat")]
        for t in gone:
            self.forget(t)
        if gone:
            log.debug("unwind: %d slots of exited processes freed", len(gone))

    def forget(self, tgid: int) -> None:
        self._uses.pop(tgid, None)
        if self._described.pop(tgid, None) is not None:
            try:
                del self._procs[ct.c_uint32(tgid)]
            except KeyError:
                pass
            slot = self._slots.pop(tgid, None)
            if slot is not None:
                self._free_slots.append(slot)
            self.stats.processes = len(self._described)

    def _table_for(self, tgid: int, m: ExecMap, load: bool, want_keys: set[str]) -> tuple[TableEntry, int] | None:
        """The binary's rows (loaded on first need; a large binary only when
        ``load``: else an entry with no rows) and the mapping's bias."""
        path = mapped_file(tgid, m.path, m.inode, m.start, m.end, dev=m.dev, proc=self._proc)
        if path is None:
            return None
        try:
            st = os.stat(path)
        except OSError:
            return None
        fkey = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        known = self._by_file.get(fkey)
        if known is None:
            try:
                info = ehframe.read_elf_info(path)
            except ehframe.UnwindTableError as e:
                log.debug("no unwind table for %s: %s", m.path, e)
                self._by_file[fkey] = _File(None, (), None)
                return None
            known = _File(None, info.loads, info)
            self._by_file[fkey] = known
        if known.entry is None and known.info is not None:
            cfi = known.info.sections.get(".eh_frame") or known.info.sections.get(".debug_frame")
            estimate = (cfi[1] if cfi else 0) // _CFI_BYTES_PER_ROW
            large = estimate > self.stats.rows_capacity // _LAZY_FRACTION
            key = ehframe.file_key(path, known.info) if large else ""
            load = load or key in want_keys
            entry = self._load(path, known.info, m.path, large) if load or not large else _BUILDING
            if entry is _BUILDING:
                # Not run yet, or its table is being built: listed with no rows.
                # Only a process that ran it waits for the build; the others
                # ask through uw_miss when they do.
                if load:
                    with self._lock:
                        self._waiting.setdefault(key, set()).add(tgid)
                bias = mapping_bias(known.loads, m)
                return (TableEntry("", 0, 0), bias) if bias is not None else None
            known = _File(entry, known.loads, None)  # decided: loaded, or never will be
            self._by_file[fkey] = known
        if known.entry is None:
            return None
        bias = mapping_bias(known.loads, m)
        return (known.entry, bias) if bias is not None else None

    def _build_later(self, path: str, info: ehframe.ElfInfo, key: str) -> None:
        with self._lock:
            if key in self._building:
                return
            self._building.add(key)
        if self._builder is None:
            self._builder = threading.Thread(target=self._build_loop, name="flamed-unwind-build", daemon=True)
            self._builder.start()
        self._builds.put((path, info, key))

    def _build_loop(self) -> None:
        while True:
            item = self._builds.get()
            if item is None or self._stopping.is_set():
                return
            path, info, key = item
            try:
                self._cache.build(path, info, key, hold=True)
            except (ehframe.UnwindTableError, OSError) as e:
                log.info("no unwind table for %s: %s", path, e)
            with self._lock:
                self._building.discard(key)
                waiting = self._waiting.pop(key, set())
            # Described again, now that the rows are there to load.
            for tgid in waiting:
                self.submit(tgid, None, load_key=key)

    def _run_reset_if_due(self) -> None:
        if self._reset_due:
            self._reset()

    def _reset(self) -> None:
        """Rows are full and binaries no live process uses hold a good part
        of them, or the free rows are scattered in ranges too small for a
        table that fits beside the live ones: drop every table and describe
        the live processes again (their tables come back from the disk cache
        in milliseconds, one after the other).  Their samples use frame
        pointers meanwhile."""
        self._reset_due = False
        live = list(self._described)
        log.info("unwind tables: %d of %d rows in use, %d by binaries of exited processes: reloading the "
                 "tables of the %d processes described", self._next, self.stats.rows_capacity,
                 self._next - self._live_rows(), len(live))
        for tgid in live:
            self.forget(tgid)
        self._by_file.clear()
        self._by_key.clear()
        self._last_used.clear()
        self._next = 0
        self._free = [(0, self.stats.rows_capacity)] if self.stats.rows_capacity > 0 else []
        self._full_warned = False
        self.stats.resets += 1
        for tgid in live:
            self.describe(tgid)
        self.stats.rows_used = self._next
        self.stats.binaries = len(self._by_key)

    def _live_rows(self, also: set[str] | frozenset[str] = frozenset()) -> int:
        """Rows of the tables described processes use (and of the tables ``also`` names)."""
        live = set(also).union(*self._uses.values())
        return sum(e.slots for k, e in self._by_key.items() if k in live)

    def _load(self, path: str, info: ehframe.ElfInfo, name: str, large: bool = False) -> TableEntry | None:
        try:
            key = ehframe.file_key(path, info)
            have = self._by_key.get(key)
            if have is not None:
                return have
            packed = self._cache.cached_rows(key)
            if packed is None:
                if large:
                    # Seconds of parsing (libLLVM: ~3 s): in the builder thread,
                    # so the descriptions of other processes do not wait.
                    self._build_later(path, info, key)
                    return _BUILDING
                packed = self._cache.build(path, info, key)
        except (ehframe.UnwindTableError, OSError) as e:
            log.info("no unwind table for %s: %s", name, e)
            self.stats.skipped["error"] += 1
            return None
        finally:
            self.stats.tables_built = self._cache.built
            self.stats.tables_cached = self._cache.cached
            self.stats.build_seconds = self._cache.build_seconds
        have = self._by_key.get(key)
        if have is not None:
            return have
        n = len(packed) // ehframe.ROW.size
        if n == 0:
            self.stats.skipped["no_cfi"] += 1
            return None
        base, pages, index = ehframe.page_index(packed)
        k = len(index) // ehframe.ROW.size
        slot = self._alloc(n + k)
        if slot is None and self._evict_for(n + k):
            slot = self._alloc(n + k)
        if slot is None:
            # Live: the tables of described processes, and those the
            # description in progress took (a reload would drop them too).
            live = self._live_rows(also=self._picking)
            garbage = self._next - live
            # Free rows in ranges each too small, though the tables in use
            # leave room enough once loaded one after the other: a reload,
            # at most once per EVICT_IDLE_S (it costs every process its
            # tables for the milliseconds of the reload).
            scattered = (self.stats.rows_capacity - live >= n + k
                         and self._clock() - self._last_compact >= EVICT_IDLE_S)
            if (garbage >= max(n + k, self.stats.rows_capacity // 4) or scattered) and not self._reset_due:
                self._reset_due = True  # after this description: see _reset
                self._last_compact = self._clock()
            self.stats.skipped["rows_full"] += 1
            if not self._full_warned:
                self._full_warned = True
                log.warning("unwind tables are full (%d of %d rows, all sampled within %g s): %s (%d rows) and "
                            "binaries after it keep frame-pointer stacks; raise [sampling] unwind_rows",
                            self._next, self.stats.rows_capacity, EVICT_IDLE_S, name, n)
            return None
        first = slot + k
        # The rows first, then the index that leads a search to them.
        self._write_rows(first, packed, n)
        self._write_rows(slot, index, k)
        self._next += n + k
        self._serial = self._serial % 0xFFFFFFFF + 1
        entry = TableEntry(key, first, n, os.path.basename(name), k, base, pages, self._serial)
        self._by_key[key] = entry
        self._last_used[key] = self._clock()
        self.stats.binaries = len(self._by_key)
        self.stats.rows_used = self._next
        log.debug("unwind table of %s: %d rows at %d", name, n, first)
        return entry

    # -- rows: ranges and eviction --------------------------------------------
    def _alloc(self, n: int) -> int | None:
        """The first free range of ``n`` contiguous rows (first fit), or None."""
        for i, (lo, cnt) in enumerate(self._free):
            if cnt >= n:
                if cnt == n:
                    del self._free[i]
                else:
                    self._free[i] = (lo + n, cnt - n)
                return lo
        return None

    def _release(self, first: int, n: int) -> None:
        free = sorted([*self._free, (first, n)])
        out: list[tuple[int, int]] = []
        for lo, cnt in free:
            if out and out[-1][0] + out[-1][1] == lo:
                out[-1] = (out[-1][0], out[-1][1] + cnt)
            else:
                out.append((lo, cnt))
        self._free = out

    def _evict_for(self, n: int) -> bool:
        """Evict tables not sampled for EVICT_IDLE_S, least recently sampled
        first, until ``n`` contiguous rows are free; True if they are.  The
        processes using an evicted table lose their description at once (no
        sample may read rows about to be reused) and are described again
        without it (its mapping then uses frame pointers until a sample lands
        in it and asks for it again through uw_miss)."""
        now = self._clock()
        in_use = set().union(*self._uses.values()) if self._uses else set()
        # Tables of no described process (they exited) first, then the least recently sampled.
        idle = sorted((k in in_use, self._last_used.get(k, 0.0), k) for k in self._by_key
                      if k not in self._picking
                      and (k not in in_use or now - self._last_used.get(k, 0.0) >= EVICT_IDLE_S))
        evicted = False
        for _used, _t, key in idle:
            entry = self._by_key.pop(key)
            self._last_used.pop(key, None)
            users = [t for t, keys in self._uses.items() if key in keys]
            for tgid in users:
                self.forget(tgid)
            for fkey in [f for f, known in self._by_file.items() if known.entry is not None and known.entry.key == key]:
                del self._by_file[fkey]  # read again (its ELF facts) when next needed
            self._release(entry.first - entry.index_rows, entry.slots)
            self._next -= entry.slots
            self.stats.evicted += 1
            self.stats.evicted_rows += entry.slots
            evicted = True
            log.info("unwind tables: evicted %s (%d rows, %s) to make room", entry.name or key, entry.rows,
                     f"not sampled for {now - _t:.0f} s" if _used else "no process uses it")
            for tgid in users:
                self.submit(tgid)
            if any(cnt >= n for _lo, cnt in self._free):
                break
        if evicted:
            self.stats.binaries = len(self._by_key)
            self.stats.rows_used = self._next
        return any(cnt >= n for _lo, cnt in self._free)

    def _write_rows(self, first: int, packed: bytes, n: int) -> None:
        """Write ``n`` rows at ``first`` of uw_rows: copied into the map's pages
        (it is mappable), else by batch updates.  The pages are mapped only
        for the copy, so they never count in the daemon's RSS."""
        size = ehframe.ROW.size
        # The kernel lays array elements out 8-byte aligned: rows of 8 bytes are contiguous.
        if self._rows_mmap and size % 8 == 0:
            lo = first * size
            base = lo - lo % mmap.PAGESIZE
            try:
                with mmap.mmap(self._rows.map_fd, lo + n * size - base, flags=mmap.MAP_SHARED,
                               prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=base) as mm:
                    mm[lo - base:lo - base + n * size] = packed[:n * size]
                self.stats.rows_mapped += n
                return
            except (OSError, ValueError) as e:
                # A kernel or map without BPF_F_MMAPABLE: batch updates from now on.
                self._rows_mmap = False
                log.info("unwind rows cannot be mapped (%s): written by batch updates", e)
        self._write_array(self._rows, first, packed, size, n)

    def _write_array(self, table: Any, first: int, packed: bytes, size: int, n: int) -> None:
        """Write ``n`` values of ``size`` bytes at indices ``first``.. of an array map."""
        chunk = 65536
        for lo in range(0, n, chunk):
            cnt = min(chunk, n - lo)
            keys = (ct.c_uint32 * cnt).from_buffer(array.array("I", range(first + lo, first + lo + cnt)))
            vals = ct.create_string_buffer(packed[lo * size:(lo + cnt) * size], cnt * size)
            count = ct.c_uint32(cnt)
            res = self._lib.bpf_update_batch(table.map_fd, ct.byref(keys), ct.byref(vals), ct.byref(count))
            if res != 0:
                err = ct.get_errno()
                # Without batch updates (older kernels): one value at a time.
                leaf_t = table.Leaf
                for i in range(cnt):
                    leaf = leaf_t.from_buffer_copy(packed[(lo + i) * size:(lo + i + 1) * size])
                    table[ct.c_int(first + lo + i)] = leaf
                log.debug("batch update of an unwind map failed (%s): wrote one by one", os.strerror(err))


#: bpf(2)'s BPF_F_MMAPABLE map flag.
_BPF_F_MMAPABLE = 1 << 10


def _mappable(fd: int) -> bool:
    """Is ``fd`` an array map created with BPF_F_MMAPABLE (its fdinfo says so)?
    Anything else (a kernel that dropped the flag, a stand-in in tests) gets batch updates."""
    try:
        info = Path(f"/proc/self/fdinfo/{fd}").read_text()
    except (OSError, ValueError):
        return False
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    try:
        return int(fields["map_type"]) == 2 and bool(int(fields["map_flags"], 16) & _BPF_F_MMAPABLE)
    except (KeyError, ValueError):
        return False


def mapping_bias(loads: tuple[tuple[int, int, int, int], ...], m: ExecMap) -> int | None:
    """address - bias = file vaddr, for the executable segment the mapping maps.

    Only executable segments (PF_X) are candidates: with lld's layout the
    read-only segment before the code can end inside the page where the
    code segment begins, so both contain the mapping's file offset."""
    for vaddr, offset, filesz, flags in loads:
        page = offset & ~0xFFF
        if flags & 1 and page <= m.offset < offset + max(filesz, 1):
            return m.start - m.offset + offset - vaddr
    return None
