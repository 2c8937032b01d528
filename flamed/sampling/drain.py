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
import time
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence, Sized
from dataclasses import dataclass, field
from typing import Any

from flamed.model import EMPTY_STACK_FRAME, KERNEL_SUFFIX, Stack
from flamed.sampling.cgroups import CgroupIdentity, CgroupResolver
from flamed.sampling.contract import CountKey, SampleEvent, Window
from flamed.sampling.mapread import CountRow, EventRow, MapReader, RawStacks
from flamed.sampling.offcpu import (
    OFFCPU_BLOCKED_FRAME,
    OFFCPU_GIL_FRAME,
    OFFCPU_PREEMPTED_FRAME,
    OffStart,
    offcpu_stack,
    thread_alive,
)
from flamed.sampling.program import EVENT, KernelProgram
from flamed.sampling.packed import Numbering, PackedBuilder, StackTable
from flamed.sampling.pyframes import (
    NO_THREAD_FRAME,
    PY_ID_NO_THREAD,
    PythonFrames,
    unencoded,
    join_frames,
    parse_pystack,
    splice_into,
    splice_parts,
)
from flamed.sampling.stats import (
    DROPPING_REASONS,
    LOST_REASONS,
    OFF_LOST_TO_REASON,
    OFF_STATS,
    PY_STATS,
    STAT_TO_REASON,
    UW_STATS,
    SamplerStats,
)
from flamed.sampling.symbols import UNKNOWN, Symbolizer
from flamed.sampling.unwind import is_outermost, parse_ustack, truncated_frame
from flamed.sampling.unwind.tables import Unwinder

#: Names other modules import from here (the split of this module kept them).
__all__ = ["DROPPING_REASONS", "LOST_REASONS", "OFF_STATS", "OFFCPU_BLOCKED_FRAME", "OFFCPU_GIL_FRAME",
           "OFFCPU_PREEMPTED_FRAME", "PY_STATS", "STAT_TO_REASON", "UW_STATS", "Drainer", "SamplerStats",
           "placeholder", "offcpu_stack", "task_cgroups"]

log = logging.getLogger("flamed.bpf")

#: A sample whose unwound stack id names no stack the drain could read.
_UW_LOST_FRAME = "[lost stack: unwound]"
#: A sample whose Python stack id names no stack the drain could read.
_PY_LOST_FRAME = "[lost python stack]"


def placeholder(sid: int, kernel: bool) -> Stack:
    """Frames standing for a stack id that is an error (see bpf/flamed.h)."""
    if sid == -errno.EFAULT:
        return ()
    suffix = KERNEL_SUFFIX if kernel else ""
    if sid == -errno.ENODATA:
        return (f"[missing {'kernel' if kernel else 'user'} stack]{suffix}",)
    name = errno.errorcode.get(-sid, str(-sid))
    return (f"[lost stack: {name}]{suffix}",)


def task_cgroups(keys: Iterable[CountRow]) -> dict[int, int]:
    """tgid -> the cgroup id with most of its samples in these rows (a process
    that moved mid-window is named by where it mostly ran)."""
    per: dict[tuple[int, int], int] = {}
    for tgid, _tid, _kid, _uid, _comm, _py, _nid, cg, _leaf, n in keys:
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
        sampled: Callable[[set[int]], None] | None = None,
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
        self._sampled = sampled
        self._cgroups = cgroups
        self._comm_cache: dict[bytes, str] = {}
        #: Where the counts of a window are numbered (the daemon's snapshot ring):
        #: None, a dict of tuples of frames.
        self.numbering: Numbering | None = None
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
        pystacks: RawStacks = reader.take_pystacks(old) if self._python is not None else {}
        ustacks: RawStacks = reader.take_ustacks(old) if self._unwinder is not None else {}
        if self._unwinder is not None:  # their tables are in use: the last ones evicted
            self._unwinder.note_sampled(keys.native_tgids())
        off = _OffRead.take(reader, old, old_epoch) if self.options.offcpu else None
        self._program.bpf.ring_buffer_consume()
        raw_events = [e for e in self._raw_events if e[4] == old]
        self._raw_events = [e for e in self._raw_events if e[4] != old]
        # Copies of counted samples (BpfSamplerOptions.timeline) give times only.
        timeline_rows = [e for e in raw_events if e[11]]
        if timeline_rows:
            raw_events = [e for e in raw_events if not e[11]]
        if self._sampled is not None:  # processes never handed on: read now
            self._sampled(keys.tgids() | {e[1] for e in raw_events})

        ids = keys.stack_ids()
        for e in raw_events:
            ids.add(e[5])
            if not e[8]:  # an unwound stack stands in for the frame-pointer walk (see CountRows.stack_ids)
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
            self._python.begin_drain(old)
        lost = dict.fromkeys(LOST_REASONS, 0)
        for reason, n in counters.items():
            if reason in lost:
                lost[reason] += n
        lost["stack_read_failed"] = sum(1 for i in ids if i not in stacks)
        offcpu_lost = ({reason: counters.get(name, 0) for name, reason in OFF_LOST_TO_REASON.items()}
                       if off is not None else {})
        cgroups = task_cgroups(keys)  # the rows are read in place: before release()
        timeline: list[tuple[SampleEvent, Stack]] = []
        try:
            counts, events = self._symbolize_all(keys, raw_events, stacks, pystacks, ustacks,
                                                 timeline_rows, timeline)
            offcpu: dict[CountKey, int] = {}
            if off is not None:
                offcpu = self._offcpu(off, stacks, pystacks, counters)
                if close_waits:
                    self._close_waits(off, flip_ktime, offcpu)
        finally:
            # The Python and unwound stacks were read in place: only now are the buffers' pages given back.
            reader.release()
        sym.end_drain()
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
            offcpu_lost=offcpu_lost,
            timeline=timeline,
        )

    def _symbolize_all(self, keys: Iterable[CountRow], raw_events: list[EventRow],
                       stacks: Mapping[int, Sequence[int]], pystacks: RawStacks, ustacks: RawStacks,
                       timeline_rows: Sequence[EventRow] = (),
                       timeline: list[tuple[SampleEvent, Stack]] | None = None,
                       ) -> tuple[MutableMapping[CountKey, int], list[SampleEvent]]:
        """The window's counts and events, numbered in :attr:`numbering`'s table when there is one.

        A table out of 2-byte frame numbers is widened and the window named again (once in a daemon's life).
        ``timeline_rows`` (copies of counted samples) are named into ``timeline``, without a table only."""
        numbering = self.numbering
        if numbering is None:
            return self._symbolize(keys, raw_events, stacks, pystacks, ustacks, None, timeline_rows, timeline)
        for _attempt in range(2):
            with numbering.numbering() as table:
                try:
                    return self._symbolize(keys, raw_events, stacks, pystacks, ustacks, table)
                except OverflowError:
                    pass
            numbering.widen(table)
        raise RuntimeError(f"the window's stacks did not fit a table of 4-byte frame numbers ({table.code})")

    def _offcpu(self, off: _OffRead, stacks: Mapping[int, Sequence[int]], pystacks: RawStacks,
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
            rows = [(st[4], tid, st[5], st[6], st[8], st[1], 0, st[2], 0, 1) for (tid, _kt), st in off.to_carry.items()]
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
            # A thread gone is not waiting (it ended without a switch this program saw).
            if ns >= self.options.offcpu_min_us * 1000 and thread_alive(tgid, tid):
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
        keys: Sized,
        ids: set[int],
        ustacks: RawStacks,
        counts: Sized,
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
        keys: Iterable[CountRow],
        raw_events: list[EventRow],
        stacks: Mapping[int, Sequence[int]],
        pystacks: RawStacks | None = None,
        ustacks: RawStacks | None = None,
        table: StackTable | None = None,
        timeline_rows: Sequence[EventRow] = (),
        timeline: list[tuple[SampleEvent, Stack]] | None = None,
    ) -> tuple[MutableMapping[CountKey, int], list[SampleEvent]]:
        """The rows' counts by (tgid, tid, comm, stack), and the events named.

        With ``table`` (under the numbering's hold), the counts are a
        :class:`~flamed.sampling.packed.PackedBuilder` numbered in it
        (OverflowError: the table needs 4-byte frame numbers).

        ``timeline_rows``, copies of counted samples sent for their times
        (without a table only), are appended to ``timeline`` with the stack
        their count key was given; one whose key was not counted (the count
        map was full) is left out."""
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

        def ustack(tgid: int, uid: int, keep: bool = True) -> Stack:
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
                if keep:
                    umemo[(tgid, uid)] = s
            return s

        # An unwound stack is stored without its leaf (the count key has it,
        # bpf/flamed.h): its addresses are read from the buffer for each leaf
        # they were sampled under, and named with it.  (Not kept per stack id:
        # 100 k distinct native stacks of ~30 frames made ~120 MB of lists of ints.)
        nmemo: dict[tuple[int, int, int], Stack] = {}

        def nstack(tgid: int, nid: int, leaf: int, keep: bool = True) -> Stack:
            key = (tgid, nid, leaf)
            s = nmemo.get(key)
            if s is None:
                raw = (ustacks or {}).get(nid)
                got = parse_ustack(raw) if raw is not None else None
                if got is None:
                    s = (_UW_LOST_FRAME,)
                else:
                    ips, end = got
                    s = sym.user_stack(tgid, [leaf, *ips[1:]] if ips else [])
                    if end == "complete" and s and s[0] == UNKNOWN:
                        # A frame-pointer chain ended at rbp == 0 after a
                        # return address outside every mapping: the walk
                        # had lost its way before (the symbolizer cuts the
                        # stack there), it did not reach the outermost frame.
                        end = "no_table"
                    if end != "complete":
                        s = (truncated_frame(end),) + s
                if keep:
                    nmemo[key] = s
            return s

        py = self._python
        depth = self.options.python_depth

        def pyruns(tgid: int, pid_: int) -> list[Stack]:
            raw = (pystacks or {}).get(pid_)
            if pid_ == PY_ID_NO_THREAD:
                return [(NO_THREAD_FRAME,)]
            if raw is None or py is None:
                return [(_PY_LOST_FRAME,)]
            frames, flags, guards = parse_pystack(raw, depth)
            if guards is None:
                return py.stack(tgid, frames, flags, sid=pid_)
            return py.stack(tgid, frames, flags, sid=pid_, guards=guards)

        # Each key's stack is joined from parts named and encoded once each:
        # the user stack (cut where Python frames go when it has any), the
        # Python runs, the kernel stack.  Encoded as tuples of frames, or,
        # with a table, as the bytes of their frame numbers there, so that a
        # window bound for the ring never holds a tuple of frames per key.
        if table is None:
            encode: Callable[[Stack], Any] = unencoded
            join: Callable[[list[Any]], Any] = join_frames
        else:
            encode, join = table.encode_stack, b"".join
        empty = encode((EMPTY_STACK_FRAME,))
        keep = table is None  # tuples of frames kept by ustack/nstack's memos: for the events too
        # A user stack's parts by one int, not a tuple (100 k distinct stacks
        # made ~25 MB of tuples and the ints they held): an unwound stack by
        # its id, leaf and process (>= 2**96: the id is never 0), a
        # frame-pointer one by its process and id (< 2**64).
        uwhole: dict[int, Any] = {}  # encoded whole
        usplit: dict[int, Any] = {}  # SpliceParts, for the keys with Python frames
        kpart: dict[int, Any] = {}
        # By pyid << 32 | tgid (one int, not a tuple of two: there is one entry per Python stack).
        pypart: dict[int, tuple[Any, ...]] = {}

        counts: dict[Any, int] = {}
        tasks: dict[tuple[int, int, bytes], int] = {}
        comm = self._comm
        # The stacks of the keys the timeline's samples were counted under.
        by_key: dict[tuple[int, int, int, int, bytes, int, int, int], Stack] | None = (
            {} if timeline_rows and table is None else None)
        for tgid, tid, kid, uid, rc, pyid, nid, _cg, leaf, n in keys:
            uk = ((nid << 64 | leaf) << 32 | tgid) if nid else (tgid << 32 | (uid & 0xFFFFFFFF))
            whole = uwhole.get(uk)
            user: Stack | None = None
            if whole is None:
                # Named once (its tuple kept only while encoded: the parts are memoized).
                user = nstack(tgid, nid, leaf, keep) if nid else ustack(tgid, uid, keep)
                whole = uwhole[uk] = encode(user)
            if pyid:
                parts = usplit.get(uk)
                if parts is None:
                    if user is None:
                        user = nstack(tgid, nid, leaf, keep) if nid else ustack(tgid, uid, keep)
                    parts = usplit[uk] = splice_parts(user, encode)
                pk = pyid << 32 | tgid
                runs = pypart.get(pk)
                if runs is None:
                    runs = pypart[pk] = tuple(map(encode, pyruns(tgid, pyid)))
                stack = splice_into(parts, runs, join) if runs else whole
            else:
                stack = whole
            k = kpart.get(kid)
            if k is None:
                k = kpart[kid] = encode(kstack(kid))
            stack = (stack + k) or empty
            ck: Any
            if table is None:
                ck = (tgid, tid, comm(rc), stack)
                if by_key is not None:
                    by_key[(tgid, tid, kid, uid, rc, pyid, nid, leaf)] = stack
            else:
                ti = tasks.get((tgid, tid, rc))
                if ti is None:
                    ti = tasks[(tgid, tid, rc)] = table.task_number((tgid, tid, comm(rc)))
                ck = ti << 32 | table.stack_number(stack)
            counts[ck] = counts.get(ck, 0) + n
        events = [
            SampleEvent(
                ktime_ns=kt, tgid=tgid, tid=tid, comm=comm(rc),
                user_stack=nstack(tgid, nid, leaf) if nid else ustack(tgid, uid), kernel_stack=kstack(kid),
                cpu=cpu,
            )
            for kt, tgid, tid, cpu, _gen, kid, uid, rc, nid, leaf, *_py in raw_events
        ]
        events.sort(key=lambda e: (e.ktime_ns, e.cpu, e.tid))
        if by_key is not None and timeline is not None:
            for kt, tgid, tid, cpu, _gen, kid, uid, rc, nid, leaf, pyid, *_flags in timeline_rows:
                got = by_key.get((tgid, tid, kid, uid, rc, pyid, nid, leaf))
                if got is not None:
                    timeline.append((SampleEvent(ktime_ns=kt, tgid=tgid, tid=tid, comm=comm(rc), user_stack=(),
                                                 kernel_stack=(), cpu=cpu), got))
        return (counts if table is None else PackedBuilder(table, counts)), events

