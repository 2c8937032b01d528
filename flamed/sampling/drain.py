"""Draining the program's maps into a :class:`~flamed.sampling.contract.Window`.

The program counts ``{tgid, tid, comm, kernel stack id, user stack id,
cgroup id}`` in two generations of maps.  :meth:`Drainer.drain` flips the generation, waits
until no program still writes the old one, reads and clears it (in batches,
into buffers allocated once) and returns it symbolized.  How and why is in
docs/bpf.md.

Everything that can degrade a sample is counted (``Window.lost``; reasons in
:data:`LOST_REASONS`) and shown as a placeholder frame:

* ``[lost stack: EEXIST]`` / ``[lost stack: ENOMEM]`` (``_[k]`` on the kernel
  side): no stack id; raise ``stack_storage_size``.
* ``[missing user stack]`` / ``[missing kernel stack]_[k]``: the task was
  interrupted on that side but no frame could be read.

Only ``map_full`` drops a sample (raise ``max_entries``); a watched task's
sample that finds the ring buffer full (``ringbuf_full``) is counted instead
of sent, so for every window::

    window.samples == sum(window.counts.values()) + len(window.events) + window.lost["map_full"]
"""

from __future__ import annotations

import contextlib
import ctypes as ct
import errno
import logging
import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from flamed.model import EMPTY_STACK_FRAME, KERNEL_SUFFIX, Stack
from flamed.sampling.cgroups import CgroupIdentity, CgroupResolver
from flamed.sampling.contract import CountKey, SampleEvent, Window
from flamed.sampling.program import EVENT, KEY, KernelProgram
from flamed.sampling.pyframes import NO_THREAD_FRAME, PY_ID_NO_THREAD, PythonFrames, parse_pystack, splice
from flamed.sampling.symbols import Symbolizer
from flamed.sampling.unwind import is_outermost, parse_ustack, truncated_frame
from flamed.sampling.unwind.tables import Unwinder, UnwindStats

log = logging.getLogger("flamed.bpf")

#: Window.lost keys, in this order, always all present.
LOST_REASONS = (
    "map_full",
    "ringbuf_full",
    "kernel_stack_eexist",
    "kernel_stack_enomem",
    "kernel_stack_error",
    "kernel_stack_missing",
    "user_stack_eexist",
    "user_stack_enomem",
    "user_stack_error",
    "user_stack_missing",
    "stack_read_failed",
)
#: The reasons that drop a sample (the others degrade its stack or its path).
DROPPING_REASONS = ("map_full",)

STAT_TO_REASON = {
    "MAP_FULL": "map_full",
    "RINGBUF_FULL": "ringbuf_full",
    "KSTACK_EEXIST": "kernel_stack_eexist",
    "KSTACK_ENOMEM": "kernel_stack_enomem",
    "KSTACK_ERROR": "kernel_stack_error",
    "KSTACK_MISSING": "kernel_stack_missing",
    "USTACK_EEXIST": "user_stack_eexist",
    "USTACK_ENOMEM": "user_stack_enomem",
    "USTACK_ERROR": "user_stack_error",
    "USTACK_MISSING": "user_stack_missing",
}


#: FLAMED_STAT_PY_* counters, by the names _take_stats gives them.
PY_STATS = ("PY_SAMPLES", "PY_STACKS", "PY_NO_THREAD", "PY_NO_FRAME", "PY_READ_FAULT", "PY_TRUNCATED",
             "PY_STACKS_FULL", "PY_NS")
#: FLAMED_STAT_UW_* counters, by the names _take_stats gives them.
UW_STATS = ("UW_SAMPLES", "UW_COMPLETE", "UW_NO_TABLE", "UW_UNSUPPORTED", "UW_DEPTH", "UW_READ_FAULT",
             "UW_STACKS_FULL", "UW_FP_FRAMES", "UW_NS", "UW_TAIL_FAILED")
#: A sample whose unwound stack id names no stack the drain could read.
_UW_LOST_FRAME = "[lost stack: unwound]"
#: A sample whose Python stack id names no stack the drain could read.
_PY_LOST_FRAME = "[lost python stack]"

#: FLAMED_STAT_OFF_* counters (bpf/offcpu.bpf.c) by the names _take_stats gives
#: them, then the drain's own: waits spanning a drain whose stacks were not
#: kept (CARRY_MISSING: the record came without its start having been seen;
#: CARRY_OVERFLOW: more open waits than ``offcpu_starts``) or whose end never
#: came (CARRY_EXPIRED: the start vanished without a record, e.g. the record
#: map was full).
OFF_STATS = ("OFF_SWITCHES", "OFF_STARTS", "OFF_START_FULL", "OFF_BELOW", "OFF_COUNTED", "OFF_MAP_FULL",
             "OFF_CARRIED", "OFF_CARRY_FULL", "OFF_STALE", "CARRY_MISSING", "CARRY_EXPIRED", "CARRY_OVERFLOW")
#: The leaf frame of an off-CPU stack: why the task left the CPU.
OFFCPU_BLOCKED_FRAME = "[off-cpu: blocked]"
OFFCPU_PREEMPTED_FRAME = "[off-cpu: preempted]"
_OFF_PREEMPTED = 1  # FLAMED_OFF_PREEMPTED
# struct flamed_offcpu_start, flamed_offcpu_key, flamed_offcpu_carry_key of bpf/flamed.h.
OFF_START = struct.Struct("<QQQIIiiII16s")
OFF_KEY = struct.Struct("<IIii16sQQQII")
OFF_CARRY_KEY = struct.Struct("<IIQ")
#: One open wait as the program remembered it: start ktime, Python stack id,
#: cgroup id, epoch, tgid, kernel stack id, user stack id, flags, raw comm.
OffStart = tuple[int, int, int, int, int, int, int, int, bytes]


#: errnos of a kernel without lookup-and-delete on stack-trace maps (524: ENOTSUPP)
_NO_LOOKUP_AND_DELETE = (errno.EINVAL, 524, errno.EOPNOTSUPP)


def placeholder(sid: int, kernel: bool) -> Stack:
    """Frames standing for a stack id that is an error (see bpf/flamed.h)."""
    if sid == -errno.EFAULT:
        return ()
    suffix = KERNEL_SUFFIX if kernel else ""
    if sid == -errno.ENODATA:
        return (f"[missing {'kernel' if kernel else 'user'} stack]{suffix}",)
    name = errno.errorcode.get(-sid, str(-sid))
    return (f"[lost stack: {name}]{suffix}",)


# ---------------------------------------------------------------------------
# Counters for metrics


@dataclass
class SamplerStats:
    """Cumulative counters and last-drain figures, for metrics and status."""

    event: str = ""  # "cycles" or "cpu-clock" once started
    frequency: int = 0
    cpus: tuple[int, ...] = ()
    samples_total: int = 0  # sum of Window.samples over all drains
    #: The program's own never-reset count of samples that passed the filters,
    #: as of the last drain.  After stop() and a final drain it equals
    #: samples_total: no sample was lost or counted twice between windows.
    bpf_samples_total: int = 0
    counted_total: int = 0
    events_total: int = 0  # samples sent as events (watched processes)
    idle_total: int = 0  # idle samples skipped (include_idle=False)
    filtered_total: int = 0  # samples the filters excluded
    cgroup_filter_ids: int = 0  # cgroup ids in the BPF filter map now
    cgroup_filter_changes_total: int = 0  # filtered cgroups created, removed or re-created since start
    lost_total: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LOST_REASONS, 0))
    drains_total: int = 0
    quiesce_timeouts: int = 0
    last_drain_seconds: float = 0.0  # whole drain, symbolization included
    last_symbolize_seconds: float = 0.0
    last_drain_cpu_seconds: float = 0.0  # CPU time of the draining thread (less than wall on a busy host)
    last_keys: int = 0  # count-map entries read in the last drain
    last_stack_ids: int = 0  # distinct stack ids read in the last drain
    last_unwound_stacks: int = 0  # distinct unwound user stacks read in the last drain
    last_stacks: int = 0  # distinct (tgid, tid, comm, stack) in the last Window
    last_events: int = 0
    count_map_fill: float = 0.0  # last_keys / max_entries
    stack_map_fill: float = 0.0  # stack ids used / stack map buckets
    max_entries: int = 0
    stack_buckets: int = 0
    symbol_processes: int = 0  # processes with a live symbol cache
    symbol_addresses: int = 0  # cached address -> frame results
    #: Process images whose maps were read when first sampled; those already
    #: gone by then; reports the perf buffer lost (user space fell behind).
    #: The user frames of the last two are named only if alive at the drain.
    primed_total: int = 0
    prime_missed_total: int = 0
    prime_lost_total: int = 0
    prime_throttled_total: int = 0  # skipped: over prime_rate
    #: FLAMED_STAT_PY_* summed over drains (PY_SAMPLES, PY_STACKS, PY_NO_THREAD...).
    python_total: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PY_STATS, 0))
    #: FLAMED_STAT_UW_* summed over drains (UW_SAMPLES, UW_COMPLETE, UW_NO_TABLE...).
    unwind_total: dict[str, int] = field(default_factory=lambda: dict.fromkeys(UW_STATS, 0))
    #: The unwinder's tables and processes (``options.unwind``), as of the last drain.
    unwind: UnwindStats | None = None
    #: Off-CPU counters summed over drains (``options.offcpu``; :data:`OFF_STATS`).
    offcpu_total: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OFF_STATS, 0))
    #: Waits spanning a drain whose stacks are kept in user space now.
    offcpu_carried_open: int = 0

    def copy(self) -> SamplerStats:
        c = SamplerStats(**{f.name: getattr(self, f.name) for f in fields(self)})
        c.lost_total = dict(self.lost_total)
        c.python_total = dict(self.python_total)
        c.unwind_total = dict(self.unwind_total)
        c.offcpu_total = dict(self.offcpu_total)
        c.unwind = self.unwind.copy() if self.unwind is not None else None
        return c




# ---------------------------------------------------------------------------
# Reading the old generation


#: One row of a count map: tgid, tid, kernel stack id, user stack id, raw
#: comm, Python stack id, unwound stack id, cgroup v2 id, samples.
CountRow = tuple[int, int, int, int, bytes, int, int, int, int]
#: One ring-buffer event (struct flamed_event): ktime, tgid, tid, cpu,
#: generation, kernel stack id, user stack id, raw comm, unwound stack id.
EventRow = tuple[int, int, int, int, int, int, int, bytes, int]


class MapReader:
    """Reads and empties one (quiescent) generation of the program's maps,
    into buffers allocated once: a drain must not allocate and zero megabytes."""

    def __init__(self, program: KernelProgram, stats: SamplerStats) -> None:
        self._program = program
        self._stats = stats
        self._options = program.options
        n = program.options.max_entries
        b = program.bpf
        key_t, leaf_t = b["counts0"].Key, b["counts0"].Leaf
        self._keys_buf: Any = (key_t * n)()
        self._vals_buf: Any = (leaf_t * n)()
        self._stack_buf: Any = (ct.c_uint64 * program.options.stack_depth)()
        self._stack_bufs: dict[str, tuple[Any, Any]] = {}  # per stack map kind
        self._global_seen: dict[str, int] = {"IDLE": 0, "FILTERED": 0, "SAMPLES": 0}
        self._lookup_and_delete = True  # until the kernel says otherwise

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

    def take_pystacks(self, gen: int) -> dict[int, bytes]:
        """Read and delete the old generation's Python stacks: id -> raw
        ``struct flamed_pystack``."""
        return self._take_stack_map(f"pystacks{gen}", self._options.python_stack_entries)

    def take_ustacks(self, gen: int) -> dict[int, bytes]:
        """Read and delete the old generation's unwound stacks: id -> raw
        ``struct flamed_ustack``."""
        return self._take_stack_map(f"ustacks{gen}", self._options.unwind_stack_entries)

    def _take_stack_map(self, name: str, cap: int) -> dict[int, bytes]:
        """Read and delete a (quiescent) hash of stacks the program built, keyed by a u64 hash."""
        return {int.from_bytes(k, "little"): v for k, v in self._take_raw(name, cap)}

    def _take_raw(self, name: str, cap: int) -> list[tuple[bytes, bytes]]:
        """Read and delete every entry of a (quiescent) hash map, as raw (key, value) bytes."""
        table = self._program.bpf[name]
        ksz, vsz = ct.sizeof(table.Key), ct.sizeof(table.Leaf)
        kind = name.rstrip("01")
        if kind not in self._stack_bufs:
            self._stack_bufs[kind] = ((ct.c_uint8 * (ksz * cap))(), (ct.c_uint8 * (vsz * cap))())
        keys, vals = self._stack_bufs[kind]
        total = self._take_batch(name, table, keys, ksz, vals, vsz, cap)
        kraw, vraw = memoryview(keys)[: total * ksz], memoryview(vals)[: total * vsz]
        out = [(bytes(kraw[i * ksz:(i + 1) * ksz]), bytes(vraw[i * vsz:(i + 1) * vsz])) for i in range(total)]
        out.extend(self._take_rest(table))
        return out

    def take_offcpu(self, gen: int) -> list[tuple[CountRow, int]]:
        """Read and delete the old generation's off-CPU counts: (the count row, ns in it), flags."""
        out: list[tuple[CountRow, int]] = []
        for kb, vb in self._take_raw(f"offcpu_counts{gen}", self._options.offcpu_entries):
            tgid, tid, kid, uid, comm, py, nid, cg, flags, _pad = OFF_KEY.unpack(kb)
            out.append(((tgid, tid, kid, uid, comm, py, nid, cg, int.from_bytes(vb, "little")), flags))
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
            start = _off_start(vb[: OFF_START.size])
            out[(tid, kt)] = (start, int.from_bytes(vb[OFF_START.size: OFF_START.size + 8], "little"))
        return out

    def read_starts(self) -> dict[int, OffStart]:
        """The open waits now (tid -> its start), read without deleting: the program owns them."""
        return {int.from_bytes(kb, "little"): _off_start(vb)
                for kb, vb in self._read_all(self._program.bpf["offcpu_start"], delete=False)}

    def take_counts(self, gen: int) -> list[CountRow]:
        """Read and delete every entry of the old count map (it is quiescent)."""
        table = self._program.bpf[f"counts{gen}"]
        keys, vals = self._keys_buf, self._vals_buf
        ksz = KEY.size
        total = self._take_batch(f"counts{gen}", table, keys, ksz, vals, 8, self._options.max_entries)
        raw = bytes(memoryview(keys).cast("B")[: total * ksz])
        values = memoryview(vals).cast("B")[: total * 8].cast("Q").tolist()
        out = [(*k, n) for k, n in zip(KEY.iter_unpack(raw), values)]
        out.extend((*KEY.unpack(kb), int.from_bytes(vb, "little")) for kb, vb in self._take_rest(table))
        return out

    def _take_batch(self, name: str, table: Any, keys: Any, ksz: int, vals: Any, vsz: int, cap: int) -> int:
        """Read and delete entries of a (quiescent) hash map into ``keys``/``vals``,
        one syscall per few thousand entries; how many were read.  Stops early
        where the kernel lacks batch operations: :meth:`_take_rest` reads the rest."""
        lib = self._program.lib
        fd = table.map_fd
        total = 0
        in_batch = ct.c_uint32(0)  # a bucket index for hash maps
        out_batch = ct.c_uint32(0)
        count = ct.c_uint32(0)
        first = True
        while total < cap:
            count.value = cap - total
            res = lib.bpf_lookup_and_delete_batch(
                fd, None if first else ct.byref(in_batch), ct.byref(out_batch),
                ct.byref(keys, ksz * total), ct.byref(vals, vsz * total), ct.byref(count),
            )
            err = ct.get_errno()
            total += count.value
            if res != 0:
                if err != errno.ENOENT:
                    log.debug("batch lookup-and-delete of %s failed after %d entries (%s); reading key by key",
                              name, total, os.strerror(err))
                break
            in_batch.value = out_batch.value
            first = False
        return total

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

    def read_stacks(self, gen: int, ids: set[int]) -> dict[int, list[int]]:
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
        mv = mb.cast("Q")
        zero8 = bytes(8)
        out: dict[int, list[int]] = {}
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
            # The walk ends at the first zero slot: find it in the bytes (C speed)
            # and make ints only of the frames before it.
            raw = mb.tobytes()
            n = raw.find(zero8)
            while n > 0 and n & 7:  # an unaligned run of zero bytes across two addresses
                n = raw.find(zero8, n + 1)
            out[sid] = mv[: n >> 3].tolist() if n >= 0 else mv.tolist()
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



def _off_start(raw: bytes) -> OffStart:
    kt, py, cg, epoch, tgid, kid, uid, flags, _pad, comm = OFF_START.unpack(raw)
    return (kt, py, cg, epoch, tgid, kid, uid, flags, comm)


def _thread_alive(tgid: int, tid: int) -> bool:
    try:
        with open(f"/proc/{tgid}/task/{tid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


def offcpu_frame(flags: int) -> str:
    """The leaf frame saying why a task left the CPU."""
    return OFFCPU_PREEMPTED_FRAME if flags & _OFF_PREEMPTED else OFFCPU_BLOCKED_FRAME


#: Leaf kernel frames of the tracing machinery itself (the raw tracepoint's
#: runner and the off-CPU program), above __schedule in every off-CPU stack.
_TRACING_FRAME = ("bpf_prog_", "bpf_trace_run", "__bpf_trace_", "__traceiter_")


def offcpu_stack(stack: Stack, flags: int) -> Stack:
    """An off-CPU stack as shown: the tracing frames cut, the reason as leaf."""
    n = len(stack)
    while n and stack[n - 1].endswith(KERNEL_SUFFIX) and stack[n - 1].startswith(_TRACING_FRAME):
        n -= 1
    return stack[:n] + (offcpu_frame(flags),)


def task_cgroups(keys: list[CountRow]) -> dict[int, int]:
    """tgid -> the cgroup id with most of its samples in these rows (a process
    that moved mid-window is named by where it mostly ran)."""
    per: dict[tuple[int, int], int] = {}
    for tgid, _tid, _kid, _uid, _comm, _py, _nid, cg, n in keys:
        per[(tgid, cg)] = per.get((tgid, cg), 0) + n
    best: dict[int, tuple[int, int]] = {}
    for (tgid, cg), n in per.items():
        if tgid not in best or n > best[tgid][1]:
            best[tgid] = (cg, n)
    return {tgid: cg for tgid, (cg, _n) in best.items()}


@dataclass
class _OffRead:
    """What one drain reads of the off-CPU maps, right after the quiesce."""

    #: Waits that began and ended in the old generation: (count row, flags).
    rows: list[tuple[CountRow, int]]
    #: Waits that began in the old generation and are still open, or ended
    #: since the flip: their stacks must be named before the ids die.
    to_carry: dict[tuple[int, int], OffStart]
    #: Waits that began before the old generation and ended in it.
    ended: dict[tuple[int, int], tuple[OffStart, int]]
    #: Every wait whose kept stacks may still be asked for.
    live: set[tuple[int, int]]
    #: The waits still open when read.
    open_waits: set[tuple[int, int]] = field(default_factory=set)

    @classmethod
    def take(cls, reader: MapReader, old: int, old_epoch: int) -> _OffRead:
        rows = reader.take_offcpu(old)
        ended = reader.take_carried(old)
        # The open waits first, then the records of those that ended since
        # the flip: a wait ending in between is found in the second (the
        # program writes the record before it deletes the start).
        starts = reader.read_starts()
        since = reader.take_carried(old ^ 1, delete=False)
        to_carry = {(tid, st[0]): st for tid, st in starts.items() if st[3] == old_epoch}
        to_carry.update((ck, st) for ck, (st, _ns) in since.items() if st[3] == old_epoch)
        open_waits = {(tid, st[0]) for tid, st in starts.items()}
        return cls(rows, to_carry, ended, open_waits | set(since), open_waits)

    def stack_ids(self) -> set[int]:
        ids = {i for row, _f in self.rows for i in (row[2], row[3])}
        ids.update(i for st in self.to_carry.values() for i in (st[5], st[6]))
        return ids


# ---------------------------------------------------------------------------
# The drain


class Drainer:
    """The generations of one loaded program, drained into Windows.

    ``settle`` runs after each drain symbolized its window, inside the
    drain's time: what may only be forgotten once the samples in flight are
    named (exited processes), and CPUs that came online.
    """

    def __init__(
        self,
        program: KernelProgram,
        stats: SamplerStats,
        symbolizer: Symbolizer,
        *,
        python: PythonFrames | None,
        unwinder: Unwinder | None,
        clock: Callable[[], int],
        settle: Callable[[], None],
        cgroups: CgroupResolver | None = None,
    ) -> None:
        self.options = program.options
        self._program = program
        self._reader = MapReader(program, stats)
        self._stats = stats
        stats.max_entries = self.options.max_entries
        stats.stack_buckets = 1 << max(0, (self.options.stack_storage_size - 1).bit_length())
        # What a window is named with, and what is settled after.
        self._symbolizer = symbolizer
        self._python = python
        self._unwinder = unwinder
        self._settle = settle
        self._cgroups = cgroups
        self._comm_cache: dict[bytes, str] = {}
        self._raw_events: list[EventRow] = []
        program.bpf["events"].open_ring_buffer(self._on_event)
        self._gen = 0
        #: What `generation` holds: the program uses its parity, the off-CPU
        #: program also the whole number (which drain a wait began before).
        self._epoch = 0
        program.write_gen(0)
        #: Waits spanning a drain: (tid, start ktime) -> (tgid, comm, stack,
        #: flags), kept from the drain of the generation they began in until
        #: their end arrives (docs/offcpu.md).
        self._carry: dict[tuple[int, int], tuple[int, str, Stack, int]] = {}
        self._clock = clock
        self._window_start = clock()

    def _on_event(self, _ctx: Any, data: Any, size: int) -> int:
        if size < EVENT.size:
            return 0
        self._raw_events.append(EVENT.unpack(ct.string_at(data, EVENT.size)))
        return 0

    def poll_events(self) -> int:
        """Move events from the ring buffer into the next window; how many."""
        before = len(self._raw_events)
        self._program.bpf.ring_buffer_consume()
        return len(self._raw_events) - before

    def drain(self, *, close_waits: bool = False) -> Window:
        """Flip, quiesce, read and clear the old generation; symbolize it.

        ``close_waits``: also count the off-CPU waits still open, up to now,
        and forget them (the last drain of a recording: a thread blocked at
        its end keeps its wait so far)."""
        t0 = time.perf_counter()
        c0 = time.thread_time()
        old = self._gen
        old_epoch = self._epoch
        self._epoch += 1
        self._gen = self._epoch & 1
        self._program.write_gen(self._epoch)
        end_ns = self._clock()
        flip_ktime = time.monotonic_ns()  # bpf_ktime_get_ns()'s clock
        start_ns, self._window_start = self._window_start, end_ns
        self._quiesce()

        reader = self._reader
        counters = reader.take_stats(old)
        keys = reader.take_counts(old)
        pystacks = reader.take_pystacks(old) if self._python is not None else {}
        ustacks = reader.take_ustacks(old) if self._unwinder is not None else {}
        if self._unwinder is not None:  # their tables are in use: the last ones evicted
            self._unwinder.note_sampled({k[0] for k in keys if k[6]})
        off = _OffRead.take(reader, old, old_epoch) if self.options.offcpu else None
        self._program.bpf.ring_buffer_consume()
        raw_events = [e for e in self._raw_events if e[4] == old]
        self._raw_events = [e for e in self._raw_events if e[4] != old]

        ids: set[int] = set()
        for _tgid, _tid, kid, uid, _comm, _py, _nid, _cg, _n in keys:
            ids.add(kid)
            ids.add(uid)
        for e in raw_events:
            ids.add(e[5])
            ids.add(e[6])
        if off is not None:
            ids |= off.stack_ids()
        ids = {i for i in ids if i >= 0}
        stacks = reader.read_stacks(old, ids)
        reader.clear_stacks(old)
        t1 = time.perf_counter()

        sym = self._symbolizer
        sym.begin_drain()
        if self._python is not None:
            self._python.begin_drain()
        lost = dict.fromkeys(LOST_REASONS, 0)
        for reason, n in counters.items():
            if reason in lost:
                lost[reason] += n
        lost["stack_read_failed"] = sum(1 for i in ids if i not in stacks)
        counts, events = self._symbolize(keys, raw_events, stacks, pystacks, ustacks)
        offcpu: dict[CountKey, int] = {}
        if off is not None:
            offcpu = self._offcpu(off, stacks, pystacks, counters)
            if close_waits:
                self._close_waits(off, flip_ktime, offcpu)
        sym.end_drain()
        cgroups = task_cgroups(keys)
        identities = self._identify(cgroups, {e[1] for e in raw_events})
        self._settle()
        t2 = time.perf_counter()

        samples = counters.get("SAMPLES", 0)
        self._account(counters, lost, keys, ids, ustacks, counts, events)
        s = self._stats
        s.last_drain_seconds = t2 - t0
        s.last_drain_cpu_seconds = time.thread_time() - c0
        s.last_symbolize_seconds = t2 - t1
        return Window(
            start_ns=start_ns,
            end_ns=end_ns,
            counts=counts,
            events=events,
            samples=samples,
            lost=lost,
            sample_rate=float(self.options.frequency),
            cgroups=cgroups,
            identities=identities,
            offcpu=offcpu,
        )

    def _offcpu(self, off: _OffRead, stacks: dict[int, list[int]], pystacks: dict[int, bytes],
                counters: dict[str, int]) -> dict[CountKey, int]:
        """The window's off-CPU time by stack (ns), the marker frame at the leaf.

        Waits that began and ended in this generation come counted by stack
        ids.  Open waits of this generation have their stacks named now and
        kept, since their ids die with this drain; waits that began earlier
        and ended in this generation are added to the stacks kept for them.
        """
        out: dict[CountKey, int] = {}
        for flags in {f for _row, f in off.rows}:
            rows = [row for row, f in off.rows if f == flags]
            named, _ = self._symbolize(rows, [], stacks, pystacks, {})
            for (tgid, tid, comm, stack), ns in named.items():
                k = (tgid, tid, comm, offcpu_stack(stack, flags))
                out[k] = out.get(k, 0) + ns
        carry = self._carry
        n = dict.fromkeys(("CARRY_MISSING", "CARRY_EXPIRED", "CARRY_OVERFLOW"), 0)
        if off.to_carry:
            rows = [(st[4], tid, st[5], st[6], st[8], st[1], 0, st[2], 1) for (tid, _kt), st in off.to_carry.items()]
            named, _ = self._symbolize(rows, [], stacks, pystacks, {})
            by_tid = {tid: (tgid, comm, stack) for (tgid, tid, comm, stack) in named}
            room = self.options.offcpu_starts - len(carry)
            for (tid, kt), st in off.to_carry.items():
                if room <= 0:
                    n["CARRY_OVERFLOW"] += 1
                    continue
                tgid, comm, stack = by_tid[tid]
                carry[(tid, kt)] = (tgid, comm, stack, st[7])
                room -= 1
        for (tid, kt), (_st, ns) in off.ended.items():
            kept = carry.pop((tid, kt), None)
            if kept is None:
                n["CARRY_MISSING"] += 1
                continue
            tgid, comm, stack, flags = kept
            k = (tgid, tid, comm, offcpu_stack(stack, flags))
            out[k] = out.get(k, 0) + ns
        for ck in [ck for ck in carry if ck not in off.live]:
            del carry[ck]
            n["CARRY_EXPIRED"] += 1
        counters.update(n)
        self._stats.offcpu_carried_open = len(carry)
        return out

    def _close_waits(self, off: _OffRead, now_ktime: int, out: dict[CountKey, int]) -> None:
        """Count the open waits kept in user space up to ``now_ktime`` into
        ``out`` and forget them, in the program too (counted once)."""
        table = self._program.bpf["offcpu_start"]
        every = self.options.offcpu_every
        for tid, kt in off.open_waits:
            kept = self._carry.pop((tid, kt), None)
            if kept is None:
                continue
            with contextlib.suppress(KeyError):
                del table[table.Key(tid)]
            tgid, comm, stack, flags = kept
            ns = now_ktime - kt
            # A thread gone is not waiting (its switch-in was missed: OFF_STALE's case).
            if ns >= self.options.offcpu_min_us * 1000 and _thread_alive(tgid, tid):
                k = (tgid, tid, comm, offcpu_stack(stack, flags))
                out[k] = out.get(k, 0) + ns * every
        self._stats.offcpu_carried_open = len(self._carry)

    def _identify(self, cgroups: dict[int, int], event_tgids: set[int]) -> dict[int, CgroupIdentity]:
        """tgid -> the identity of its cgroup id, for the ids that resolve.

        An id the resolver cannot place yet (a cgroup created since its last
        walk, while walks are rate-limited) is looked up through the
        process's /proc/PID/cgroup, which is kept only if it names the same id.
        Watched processes' events carry no cgroup id: theirs is read from /proc.
        """
        resolver = self._cgroups
        out: dict[int, CgroupIdentity] = {}
        if resolver is None:
            return out
        for tgid, cg in cgroups.items():
            ident = resolver.resolve(cg)
            if ident is None and tgid > 0:
                ident = resolver.identity_of_pid(tgid)
                if ident is not None and ident.cgroup_id != cg:
                    ident = None
            if ident is not None:
                out[tgid] = ident
        for tgid in event_tgids - out.keys():
            ident = resolver.identity_of_pid(tgid)
            if ident is not None:
                out[tgid] = ident
        return out

    def _account(
        self,
        counters: dict[str, int],
        lost: dict[str, int],
        keys: list[CountRow],
        ids: set[int],
        ustacks: dict[int, bytes],
        counts: dict[CountKey, int],
        events: list[SampleEvent],
    ) -> None:
        """The cumulative and last-drain figures of one drain."""
        samples = counters.get("SAMPLES", 0)
        s = self._stats
        s.samples_total += samples
        s.counted_total += counters.get("COUNTED", 0)
        s.events_total += counters.get("EVENTS", 0)
        for name in PY_STATS:
            s.python_total[name] += counters.get(name, 0)
        for name in UW_STATS:
            s.unwind_total[name] += counters.get(name, 0)
        for name in OFF_STATS:
            s.offcpu_total[name] += counters.get(name, 0)
        if self._unwinder is not None:
            s.unwind = self._unwinder.stats.copy()
        for r, n in lost.items():
            s.lost_total[r] += n
        s.drains_total += 1
        s.last_keys = len(keys)
        s.last_stack_ids = len(ids)
        s.last_unwound_stacks = len(ustacks)
        s.last_stacks = len(counts)
        s.last_events = len(events)
        s.count_map_fill = len(keys) / self.options.max_entries
        s.stack_map_fill = len(ids) / s.stack_buckets if s.stack_buckets else 0.0

    def _quiesce(self) -> None:
        """Wait until every program that may have read the old generation is done.

        A program's per-CPU sequence is odd while it runs.  The short sleep
        first makes the flip visible everywhere (the sleep's context switch is
        a full barrier) and lets the microseconds-long programs finish; then
        any CPU still odd (a vCPU the hypervisor paused mid-program) is waited
        for until its sequence moves.
        """
        time.sleep(0.0005)
        names = ("inflight", "offcpu_inflight") if self.options.offcpu else ("inflight",)
        busy = {(name, cpu): v for name in names
                for cpu, v in enumerate(self._program.read_percpu(name, 0)) if v & 1}
        deadline = time.monotonic() + self.options.quiesce_timeout
        while busy and time.monotonic() < deadline:
            time.sleep(0.0002)
            now = {name: self._program.read_percpu(name, 0) for name in names}
            busy = {nc: v for nc, v in busy.items() if now[nc[0]][nc[1]] == v}
        if busy:
            self._stats.quiesce_timeouts += 1
            log.warning("CPUs %s still in the BPF program after %.1fs; draining anyway",
                        sorted({cpu for _name, cpu in busy}), self.options.quiesce_timeout)

    def _comm(self, raw: bytes) -> str:
        c = self._comm_cache.get(raw)
        if c is None:
            c = raw.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            if len(self._comm_cache) > 65536:
                self._comm_cache.clear()
            self._comm_cache[raw] = c
        return c

    def _symbolize(
        self,
        keys: list[CountRow],
        raw_events: list[EventRow],
        stacks: dict[int, list[int]],
        pystacks: dict[int, bytes] | None = None,
        ustacks: dict[int, bytes] | None = None,
    ) -> tuple[dict[CountKey, int], list[SampleEvent]]:
        sym = self._symbolizer
        kmemo: dict[int, Stack] = {}
        umemo: dict[tuple[int, int], Stack] = {}
        read_failed = ("[lost stack: read failed]",)

        def kstack(kid: int) -> Stack:
            s = kmemo.get(kid)
            if s is None:
                if kid < 0:
                    s = placeholder(kid, True)
                else:
                    ips = stacks.get(kid)
                    s = sym.kernel_stack(ips) if ips is not None else (read_failed[0] + KERNEL_SUFFIX,)
                kmemo[kid] = s
            return s

        unwinding = self._unwinder is not None

        def ustack(tgid: int, uid: int) -> Stack:
            s = umemo.get((tgid, uid))
            if s is None:
                if uid < 0:
                    s = placeholder(uid, False)
                else:
                    ips = stacks.get(uid)
                    s = sym.user_stack(tgid, ips) if ips is not None else read_failed
                    if unwinding and s and not is_outermost(s[0]):
                        # A frame-pointer stack where tables are expected: a
                        # process sampled before it was described, or whose
                        # binaries have none.  Its end is not known to be the end.
                        s = (truncated_frame("no_table"),) + s
                umemo[(tgid, uid)] = s
            return s

        nmemo: dict[tuple[int, int], Stack] = {}

        def nstack(tgid: int, nid: int) -> Stack:
            s = nmemo.get((tgid, nid))
            if s is None:
                raw = (ustacks or {}).get(nid)
                if raw is None:
                    s = (_UW_LOST_FRAME,)
                else:
                    ips, end = parse_ustack(raw)
                    s = sym.user_stack(tgid, ips)
                    if end != "complete":
                        s = (truncated_frame(end),) + s
                nmemo[(tgid, nid)] = s
            return s

        py = self._python
        pymemo: dict[tuple[int, int], list[Stack]] = {}
        depth = self.options.python_depth

        def pyruns(tgid: int, pid_: int) -> list[Stack]:
            r = pymemo.get((tgid, pid_))
            if r is None:
                raw = (pystacks or {}).get(pid_)
                if pid_ == PY_ID_NO_THREAD:
                    r = [(NO_THREAD_FRAME,)]
                elif raw is None or py is None:
                    r = [(_PY_LOST_FRAME,)]
                else:
                    frames, flags = parse_pystack(raw, depth)
                    r = py.stack(tgid, frames, flags)
                pymemo[(tgid, pid_)] = r
            return r

        counts: dict[CountKey, int] = {}
        comm = self._comm
        for tgid, tid, kid, uid, rc, pyid, nid, _cg, n in keys:
            user = nstack(tgid, nid) if nid else ustack(tgid, uid)
            if pyid:
                stack = splice(user, pyruns(tgid, pyid)) + kstack(kid)
            else:
                stack = user + kstack(kid)
            ck = (tgid, tid, comm(rc), stack or (EMPTY_STACK_FRAME,))
            counts[ck] = counts.get(ck, 0) + n
        events = [
            SampleEvent(
                ktime_ns=kt, tgid=tgid, tid=tid, comm=comm(rc),
                user_stack=nstack(tgid, nid) if nid else ustack(tgid, uid), kernel_stack=kstack(kid), cpu=cpu,
            )
            for kt, tgid, tid, cpu, _gen, kid, uid, rc, nid in raw_events
        ]
        events.sort(key=lambda e: (e.ktime_ns, e.cpu, e.tid))
        return counts, events

