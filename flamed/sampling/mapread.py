"""Reading and emptying one quiescent generation of the program's maps, into
buffers allocated once (a drain must not allocate and zero megabytes): the
counts, the stack maps, the counters and the off-CPU records."""

from __future__ import annotations

import ctypes as ct
import errno
import logging
import mmap
import os
import struct
from array import array
from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from flamed.sampling.offcpu import OFF_CARRY_KEY, OFF_KEY, OFF_START, OffStart, off_start
from flamed.sampling.program import KEY, KernelProgram
from flamed.sampling.stats import STAT_TO_REASON, SamplerStats

log = logging.getLogger("flamed.bpf")

#: errnos of a kernel without lookup-and-delete on stack-trace maps (524: ENOTSUPP)
_NO_LOOKUP_AND_DELETE = (errno.EINVAL, 524, errno.EOPNOTSUPP)


# ---------------------------------------------------------------------------
# Reading the old generation


#: One row of a count map: tgid, tid, kernel stack id, user stack id, raw
#: comm, Python stack id, unwound stack id, cgroup v2 id, unwound stack's
#: leaf address, samples.
CountRow = tuple[int, int, int, int, bytes, int, int, int, int, int]
#: One ring-buffer event (struct flamed_event): ktime, tgid, tid, cpu,
#: generation, kernel stack id, user stack id, raw comm, unwound stack id,
#: unwound stack's leaf address, Python stack id, timeline flag (1: a copy
#: of a counted sample, for its time only), padding.
EventRow = tuple[int, int, int, int, int, int, int, bytes, int, int, int, int, int]


class CountRows:
    """The rows of a count map as read: their raw keys and counts, unpacked
    only as they are iterated (a window of 100 k keys held as tuples would
    take ~35 MB while it is symbolized), with a few columns read in place."""

    __slots__ = ("_raw", "_values", "_extra")

    def __init__(self, raw: bytes | memoryview, values: Sequence[int], extra: list[CountRow]) -> None:
        """``raw``: the keys end to end; ``values``: their counts.  Either may be
        the reader's buffer: then valid only until :meth:`MapReader.release`."""
        assert KEY.size == 64 and len(raw) == KEY.size * len(values)
        self._raw, self._values, self._extra = raw, values, extra

    def __len__(self) -> int:
        return len(self._values) + len(self._extra)

    def __iter__(self) -> Iterator[CountRow]:
        for k, n in zip(KEY.iter_unpack(self._raw), self._values):
            yield (*k, n)
        yield from self._extra

    # Columns of KEY ("<IIii16sQQQQ", 64 bytes): 16 u32 or 8 u64 a row.
    def tgids(self) -> set[int]:
        return set(memoryview(self._raw).cast("I")[0::16]) | {r[0] for r in self._extra}

    def stack_ids(self) -> set[int]:
        """Kernel and frame-pointer user stack ids (negative ones included).  A row
        with an unwound stack took no frame-pointer walk: its user stack id is
        the key's unset 0, not a stack, and is left out (read, it was a stack
        'lost' in every window)."""
        col = memoryview(self._raw).cast("i")
        native = memoryview(self._raw).cast("Q")[5::8]
        users = {u for u, nid in zip(col[3::16], native) if not nid}
        return (set(col[2::16]) | users | {r[2] for r in self._extra}
                | {r[3] for r in self._extra if not r[6]})

    def native_tgids(self) -> set[int]:
        """The processes with a stack unwound from tables in these rows."""
        return ({t for t, nid in zip(memoryview(self._raw).cast("I")[0::16], memoryview(self._raw).cast("Q")[5::8])
                 if nid} | {r[0] for r in self._extra if r[6]})


class StackValues:
    """The values of a stack map by id, each cut to the part its frame count
    uses (:func:`cut_ustacks`, :func:`cut_pystacks`) and kept end to end.

    A value is as long as the map's depth allows (1.5 KB for a Python stack
    of 128 frames); read whole, 100 k of them were ~40 MB resident during a
    drain.  The ids are kept sorted in an array beside their values'
    positions and found by bisection: a dict of 100 k ids, with an int object
    for each id and each position, took ~8 MB at the drain's peak
    (docs/bpf.md, "The drain's own peak")."""

    __slots__ = ("_ids", "_pos", "_blob", "_offs")

    def __init__(self, ids: Sequence[int], blob: bytes | bytearray, offs: Sequence[int]) -> None:
        """``ids[i]``: the id of the value ``blob[offs[i]:offs[i + 1]]``."""
        assert len(offs) == len(ids) + 1
        order = sorted(range(len(ids)), key=ids.__getitem__)
        self._ids = array("Q", map(ids.__getitem__, order))
        self._pos = array("I", order)
        self._blob, self._offs = blob, offs

    def _find(self, key: int) -> int:
        ids = self._ids
        i = bisect_left(ids, key)
        return self._pos[i] if i < len(ids) and ids[i] == key else -1

    def get(self, key: int) -> memoryview | None:
        i = self._find(key) if key >= 0 else -1
        if i < 0:
            return None
        return memoryview(self._blob)[self._offs[i]: self._offs[i + 1]]

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, key: int) -> bool:
        return key >= 0 and self._find(key) >= 0


_U32 = struct.Struct("<I").unpack_from


def cut_ustacks(raw: memoryview | bytes, size: int, out: bytearray, offs: array[int]) -> None:
    """Append the used part of each ``struct flamed_ustack`` in ``raw`` (``size``
    bytes each: count, end, then its addresses) to ``out``, and each end's
    offset to ``offs``."""
    depth = (size - 8) >> 3
    for i in range(0, len(raw) - size + 1, size):
        n = _U32(raw, i)[0]
        if n > depth:
            n = depth
        out += raw[i: i + 8 + 8 * n]
        offs.append(len(out))


def cut_pystacks(raw: memoryview | bytes, size: int, out: bytearray, offs: array[int]) -> None:
    """Append the used part of each ``struct flamed_pystack`` in ``raw``
    (``size`` bytes each: count, flags, its code addresses, its instruction
    offsets, its guards) to ``out``, and each end's offset to ``offs``: the
    layout of a depth of its own count, which
    :func:`~flamed.sampling.pyframes.parse_pystack` reads."""
    depth = (size - 8) // 16
    instr = 8 + 8 * depth
    guard = instr + 4 * depth
    for i in range(0, len(raw) - size + 1, size):
        n = _U32(raw, i)[0]
        if n > depth:
            n = depth
        out += raw[i: i + 8 + 8 * n]
        out += raw[i + instr: i + instr + 4 * n]
        out += raw[i + guard: i + guard + 4 * n]
        offs.append(len(out))


#: Raw stacks by id: as a drain reads them, or bytes (tests).
RawStacks = StackValues | dict[int, bytes]

#: Entries of a stack map read per batch, each batch cut to what its values use.
STACK_CHUNK = 4096


class StackAddrs(Mapping[int, "array[int]"]):
    """A stack map's stacks as read: id -> addresses, leaf first.

    Kept end to end in one buffer, each stack made an array only when it is
    asked for (the drain names each once): a first drain of 40 k stacks of
    ~30 frames held as lists made 1.1 million ints, 44 MB of small objects
    alive at once and most of the allocator's high-water mark (docs/bpf.md,
    "The first drain's peak")."""

    __slots__ = ("_blob", "_at")

    def __init__(self) -> None:
        self._blob = bytearray()
        #: id -> offset << 8 | frames (a stack has at most 127)
        self._at: dict[int, int] = {}

    def add(self, sid: int, raw: bytes) -> None:
        """The stack ``sid``: its addresses' bytes, 8 each, native order."""
        self._at[sid] = len(self._blob) << 8 | len(raw) >> 3
        self._blob += raw

    def __getitem__(self, sid: int) -> array[int]:
        v = self._at[sid]
        off = v >> 8
        return array("Q", self._blob[off: off + (v & 0xFF) * 8])

    def __iter__(self) -> Iterator[int]:
        return iter(self._at)

    def __len__(self) -> int:
        return len(self._at)

    def __contains__(self, sid: object) -> bool:
        return sid in self._at


class _Scratch:
    """Read buffers in anonymous memory of their own, allocated once (a drain
    must not allocate megabytes) and given back to the kernel after each
    drain (``MADV_DONTNEED``): a drain of 100 k stacks would otherwise leave
    its high-water mark of pages resident for the daemon's whole life."""

    def __init__(self) -> None:
        self._maps: list[mmap.mmap] = []

    def array(self, ctype: Any, n: int) -> Any:
        mm = mmap.mmap(-1, max(1, ct.sizeof(ctype) * n))
        self._maps.append(mm)
        return (ctype * n).from_buffer(mm)

    def release(self) -> None:
        for mm in self._maps:
            try:
                mm.madvise(mmap.MADV_DONTNEED)
            except (OSError, AttributeError):  # not on this platform: kept resident
                return


class MapReader:
    """Reads and empties one (quiescent) generation of the program's maps,
    into buffers allocated once (:class:`_Scratch`)."""

    def __init__(self, program: KernelProgram, stats: SamplerStats) -> None:
        self._program = program
        self._stats = stats
        self._options = program.options
        n = program.options.max_entries
        b = program.bpf
        key_t, leaf_t = b["counts0"].Key, b["counts0"].Leaf
        self._scratch = _Scratch()
        self._keys_buf: Any = self._scratch.array(key_t, n)
        self._vals_buf: Any = self._scratch.array(leaf_t, n)
        self._stack_buf: Any = (ct.c_uint64 * program.options.stack_depth)()
        self._stack_bufs: dict[str, tuple[Any, Any]] = {}  # per stack map kind
        self._global_seen: dict[str, int] = {"IDLE": 0, "FILTERED": 0, "SAMPLES": 0}
        self._lookup_and_delete = True  # until the kernel says otherwise

    def release(self) -> None:
        """The drain is done with the buffers: their pages go back to the kernel."""
        self._scratch.release()

    def take_stats(self, gen: int) -> dict[str, int]:
        """Read and zero the old generation's counters; deltas of the global ones."""
        idx = self._program.stat_idx
        nstats = idx["__N__"]
        t = self._program.bpf["stats"]
        out: dict[str, int] = {}
        zero = t.Leaf()
        for name, i in idx.items():
            if name == "__N__" or name in ("IDLE", "FILTERED"):
                continue
            slot = gen * nstats + i
            vals = t[ct.c_int(slot)]
            total = sum(int(v) for v in vals)
            if total:
                t[ct.c_int(slot)] = zero
            out[STAT_TO_REASON.get(name, name)] = total
        for name in ("IDLE", "FILTERED", "SAMPLES"):
            total = sum(int(v) for v in t[ct.c_int(2 * nstats + idx[name])])
            delta = total - self._global_seen[name]
            self._global_seen[name] = total
            if name == "IDLE":
                self._stats.idle_total += delta
            elif name == "FILTERED":
                self._stats.filtered_total += delta
            else:
                self._stats.bpf_samples_total += delta
        return out

    def take_pystacks(self, gen: int) -> StackValues:
        """Read and delete the old generation's Python stacks: id -> the used
        part of its ``struct flamed_pystack``."""
        return self._take_stack_map(f"pystacks{gen}", self._options.python_stack_entries, cut_pystacks)

    def take_ustacks(self, gen: int) -> StackValues:
        """Read and delete the old generation's unwound stacks: id -> the used
        part of its ``struct flamed_ustack``."""
        return self._take_stack_map(f"ustacks{gen}", self._options.unwind_stack_entries, cut_ustacks)

    def _take_stack_map(self, name: str, cap: int,
                        cut: Callable[[memoryview | bytes, int, bytearray, array[int]], None]) -> StackValues:
        """Read and delete a (quiescent) hash of stacks the program built, keyed by a u64 hash.

        Read :data:`STACK_CHUNK` entries at a time into buffers of that size,
        each value cut to what it uses (``cut``) and appended to one buffer."""
        table = self._program.bpf[name]
        ksz, vsz = ct.sizeof(table.Key), ct.sizeof(table.Leaf)
        assert ksz == 8, name
        chunk = max(1, min(cap, STACK_CHUNK))
        kind = name.rstrip("01")
        if kind not in self._stack_bufs:
            self._stack_bufs[kind] = (self._scratch.array(ct.c_uint8, ksz * chunk),
                                      self._scratch.array(ct.c_uint8, vsz * chunk))
        keys, vals = self._stack_bufs[kind]
        ids: array[int] = array("Q")
        offs: array[int] = array("Q", [0])
        blob = bytearray()
        vmv = memoryview(vals).cast("B")
        for n in self._take_chunks(name, table, keys, ksz, vals, vsz, cap, chunk):
            ids.frombytes(memoryview(keys).cast("B")[: n * ksz])
            cut(vmv[: n * vsz], vsz, blob, offs)
        for kb, vb in self._take_rest(table):
            ids.append(int.from_bytes(kb, "little"))
            cut(vb, vsz, blob, offs)
        return StackValues(ids, blob, offs)

    def _take_into_buffers(self, name: str, cap: int) -> tuple[Any, memoryview, memoryview, int, int]:
        """Batch-read and delete a (quiescent) hash map into this kind's buffers:
        (table, raw keys, raw values, key size, value size); :meth:`_take_rest`
        gives what the batch left."""
        table = self._program.bpf[name]
        ksz, vsz = ct.sizeof(table.Key), ct.sizeof(table.Leaf)
        kind = name.rstrip("01")
        if kind not in self._stack_bufs:
            self._stack_bufs[kind] = (self._scratch.array(ct.c_uint8, ksz * cap),
                                      self._scratch.array(ct.c_uint8, vsz * cap))
        keys, vals = self._stack_bufs[kind]
        total = self._take_batch(name, table, keys, ksz, vals, vsz, cap)
        return table, memoryview(keys).cast("B")[: total * ksz], memoryview(vals).cast("B")[: total * vsz], ksz, vsz

    def _take_raw(self, name: str, cap: int) -> list[tuple[bytes, bytes]]:
        """Read and delete every entry of a (quiescent) hash map, as raw (key, value) bytes."""
        table, kraw, vraw, ksz, vsz = self._take_into_buffers(name, cap)
        total = len(kraw) // ksz
        out = [(bytes(kraw[i * ksz:(i + 1) * ksz]), bytes(vraw[i * vsz:(i + 1) * vsz])) for i in range(total)]
        out.extend(self._take_rest(table))
        return out

    def take_offcpu(self, gen: int) -> list[tuple[CountRow, int]]:
        """Read and delete the old generation's off-CPU counts: (the count row, ns in it), flags."""
        out: list[tuple[CountRow, int]] = []
        for kb, vb in self._take_raw(f"offcpu_counts{gen}", self._options.offcpu_entries):
            tgid, tid, kid, uid, comm, py, nid, cg, leaf, flags, _pad = OFF_KEY.unpack(kb)
            out.append(((tgid, tid, kid, uid, comm, py, nid, cg, leaf, int.from_bytes(vb, "little")), flags))
        return out

    def take_carried(self, gen: int, delete: bool = True) -> dict[tuple[int, int], tuple[OffStart, int]]:
        """The waits spanning a drain that ended in generation ``gen``: (tid,
        start ktime) -> (its start, ns).  ``delete=False``: a look at the
        current generation's, which the program still writes."""
        name = f"offcpu_carried{gen}"
        rows = (self._take_raw(name, self._options.offcpu_carried) if delete
                else self._read_all(self._program.bpf[name], delete=False))
        out: dict[tuple[int, int], tuple[OffStart, int]] = {}
        for kb, vb in rows:
            tid, _pad, kt = OFF_CARRY_KEY.unpack(kb)
            start = off_start(vb[: OFF_START.size])
            out[(tid, kt)] = (start, int.from_bytes(vb[OFF_START.size: OFF_START.size + 8], "little"))
        return out

    def read_starts(self) -> dict[int, OffStart]:
        """The open waits now (tid -> its start), read without deleting: the program owns them."""
        return {int.from_bytes(kb, "little"): off_start(vb)
                for kb, vb in self._read_all(self._program.bpf["offcpu_start"], delete=False)}

    def take_counts(self, gen: int) -> CountRows:
        """Read and delete every entry of the old count map (it is quiescent);
        the rows are read in place: iterate them before :meth:`release`."""
        table = self._program.bpf[f"counts{gen}"]
        keys, vals = self._keys_buf, self._vals_buf
        ksz = KEY.size
        total = self._take_batch(f"counts{gen}", table, keys, ksz, vals, 8, self._options.max_entries)
        # Read in place (valid until release()): a copy of 100 k keys and their
        # counts as ints added ~10 MB to the drain's peak.
        raw = memoryview(keys).cast("B")[: total * ksz]
        values = memoryview(vals).cast("B")[: total * 8].cast("Q")
        extra = [(*KEY.unpack(kb), int.from_bytes(vb, "little")) for kb, vb in self._take_rest(table)]
        return CountRows(raw, values, extra)

    def _take_chunks(self, name: str, table: Any, keys: Any, ksz: int, vals: Any, vsz: int, cap: int,
                     chunk: int = 0) -> Iterator[int]:
        """Read and delete entries of a (quiescent) hash map, one syscall per few
        thousand entries, yielding how many each call read: with ``chunk``, up
        to that many a call into the front of ``keys``/``vals`` (each batch to
        be used before the next); without, all of them end to end.  Stops
        early where the kernel lacks batch operations or a batch fails:
        :meth:`_take_rest` reads the rest."""
        lib = self._program.lib
        fd = table.map_fd
        total = 0
        in_batch = ct.c_uint32(0)  # a bucket index for hash maps
        out_batch = ct.c_uint32(0)
        count = ct.c_uint32(0)
        first = True
        while total < cap:
            count.value = chunk or cap - total
            at = 0 if chunk else total
            res = lib.bpf_lookup_and_delete_batch(
                fd, None if first else ct.byref(in_batch), ct.byref(out_batch),
                ct.byref(keys, ksz * at), ct.byref(vals, vsz * at), ct.byref(count),
            )
            err = ct.get_errno()
            total += count.value
            if count.value:
                yield count.value
            if res != 0:
                if err != errno.ENOENT:
                    log.debug("batch lookup-and-delete of %s failed after %d entries (%s); reading key by key",
                              name, total, os.strerror(err))
                return
            in_batch.value = out_batch.value
            first = False

    def _take_batch(self, name: str, table: Any, keys: Any, ksz: int, vals: Any, vsz: int, cap: int) -> int:
        """Read and delete entries of a (quiescent) hash map into ``keys``/``vals``,
        end to end; how many were read (:meth:`_take_chunks`)."""
        return sum(self._take_chunks(name, table, keys, ksz, vals, vsz, cap))

    def _take_rest(self, table: Any) -> list[tuple[bytes, bytes]]:
        """Whatever :meth:`_take_batch` left (no batch support, a partial batch),
        key by key, as raw (key, value) bytes; when the batch emptied the map
        this is a single get_next_key call."""
        return self._read_all(table, delete=True)

    def _read_all(self, table: Any, *, delete: bool) -> list[tuple[bytes, bytes]]:
        """Every entry of ``table`` key by key, as raw (key, value) bytes; deleted if asked."""
        lib = self._program.lib
        fd = table.map_fd
        key = table.Key()
        nxt = table.Key()
        val = table.Leaf()
        rest: list[tuple[bytes, bytes]] = []
        # Collect first: deleting the current key would restart the walk.
        found: list[bytes] = []
        if lib.bpf_get_next_key(fd, None, ct.byref(nxt)) != 0:
            return rest
        while True:
            found.append(bytes(nxt))
            ct.memmove(ct.byref(key), ct.byref(nxt), ct.sizeof(key))
            if lib.bpf_get_next_key(fd, ct.byref(key), ct.byref(nxt)) != 0:
                break
        for kb in found:
            ct.memmove(ct.byref(key), kb, len(kb))
            if lib.bpf_lookup_elem(fd, ct.byref(key), ct.byref(val)) == 0:
                rest.append((kb, bytes(val)))
                if delete:
                    lib.bpf_delete_elem(fd, ct.byref(key))
        return rest

    def read_stacks(self, gen: int, ids: set[int]) -> StackAddrs:
        """Stack id -> instruction pointers, leaf first; each entry is deleted as it is read.

        One BPF_MAP_LOOKUP_AND_DELETE_ELEM per stack (stack-trace maps have no
        batch operations) instead of a lookup and a delete: half the system
        calls of a drain with 100,000 stacks.  Kernels that refuse it for
        stack-trace maps get the two calls.
        """
        fd = self._program.bpf[f"stacks{gen}"].map_fd
        lib = self._program.lib
        lookup = lib.bpf_lookup_elem
        take = lookup
        if self._lookup_and_delete:
            take = lib.bpf_lookup_and_delete
            take.argtypes, take.restype = [ct.c_int, ct.c_void_p, ct.c_void_p], ct.c_int
        delete = lib.bpf_delete_elem
        buf = self._stack_buf
        pbuf = ct.byref(buf)
        key = ct.c_int(0)
        pkey = ct.byref(key)
        mb = memoryview(buf).cast("B")
        zero8 = bytes(8)
        out = StackAddrs()
        separate_delete = take is lookup
        for sid in ids:
            key.value = sid
            if take(fd, pkey, pbuf) != 0:
                if take is not lookup and ct.get_errno() in _NO_LOOKUP_AND_DELETE:
                    log.info("this kernel has no lookup-and-delete on stack-trace maps; using two calls")
                    self._lookup_and_delete = False
                    take, separate_delete = lookup, True
                    if take(fd, pkey, pbuf) != 0:
                        continue
                else:
                    continue
            if separate_delete:
                delete(fd, pkey)
            # The walk ends at the first zero slot: find it in the bytes (C speed).
            raw = mb.tobytes()
            n = raw.find(zero8)
            while n > 0 and n & 7:  # an unaligned run of zero bytes across two addresses
                n = raw.find(zero8, n + 1)
            out.add(sid, raw[:n] if n >= 0 else raw)
        return out

    def clear_stacks(self, gen: int) -> None:
        """Empty what is left of the old generation's stack map: orphans (a
        stack id whose sample was dropped before it was counted) and ids that
        could not be read."""
        fd = self._program.bpf[f"stacks{gen}"].map_fd
        lib = self._program.lib
        key = ct.c_int(0)
        pkey = ct.byref(key)
        nxt = ct.c_int(0)
        orphans: list[int] = []
        if lib.bpf_get_next_key(fd, None, ct.byref(nxt)) == 0:
            while True:
                orphans.append(nxt.value)
                key.value = nxt.value
                if lib.bpf_get_next_key(fd, pkey, ct.byref(nxt)) != 0:
                    break
        for sid in orphans:
            key.value = sid
            lib.bpf_delete_elem(fd, pkey)
