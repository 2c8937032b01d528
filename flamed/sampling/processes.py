"""The process manager: learns of the processes the program samples and hands
each to the handlers that want it.

The program reports a process image (tgid + comm) the first time it samples
it, through the ``new_images`` perf buffer.  The priming thread reads the
image's identity and maps while it runs, so a process that exits before the
next drain still gets its user frames named, then hands it to every
:class:`ProcessHandler` (the CPython walker's and the unwinder's feeds are in
flamed.sampling.feeds).  A process that later exits is dropped by each handler
once the next drain has named its samples in flight.

Everything known about one process is in its :class:`Process` record, one per
tgid, in one :class:`ProcessTable`: the manager's own flags, and each handler's
state in a :class:`Slot` of the record.  A new concern is a new handler with a
slot of its own, not a new set keyed by pid.
"""

from __future__ import annotations

import contextlib
import ctypes as ct
import heapq
import logging
import os
import select
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar, cast

from flamed.errors import FlamedError
from flamed.procstat import EXITED, PF_KTHREAD, read_stat, running
from flamed.sampling.stats import SamplerStats
from flamed.sampling.program import BpfSamplerOptions, KernelProgram
from flamed.sampling.symbols import ProcessIdentity, Symbolizer, read_identity

log = logging.getLogger("flamed.bpf")

_S = TypeVar("_S")

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

#: struct flamed_task of bpf/flamed.h, as ``new_images`` reports it: tgid, comm
#: (the sampled thread's), the low half of the exec count (0: unknown).
_IMAGE = struct.Struct("<I16sI")


def _age_s(ident: ProcessIdentity) -> float:
    """Seconds since the process started (/proc/PID/stat's start time is in
    clock ticks since boot)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME) - ident.start_time / _CLK_TCK


def _alive(pid: int) -> bool:
    """Is ``pid`` a user process that has not exited?  Not a zombie, not a
    kernel thread (no maps to read, ever).  A process in the middle of exec
    is one: its new memory has no code mapped yet (start_code 0, no
    executable mapping) for a moment.  Taken for a kernel thread there, its
    failed first read was not tried again; the program reports an image once,
    so the process was then never read while it ran (about 1 CPython process
    in 300 had no Python frame at all)."""
    fields = read_stat(f"/proc/{pid}/stat")
    if not fields or len(fields) < 7 or fields[0] in EXITED:
        return False
    try:
        return not int(fields[6]) & PF_KTHREAD
    except ValueError:
        return False


# ---------------------------------------------------------------------------
# Per-process records


@dataclass(eq=False)
class Process:
    """What the sampler keeps about one process (tgid)."""

    tgid: int
    #: Its samples are sent as timestamped events, not counted.
    watched: bool = False
    #: In the program's pid filter (``options.pids``).
    filtered: bool = False
    #: Exited or exec'd: the handlers drop it after the next drain.
    exited: bool = False
    #: The handlers' own state, by :class:`Slot`.
    slots: dict[Slot[Any], object] = field(default_factory=dict)

    @property
    def idle(self) -> bool:
        """Nothing left to remember: the record may go."""
        return not (self.watched or self.filtered or self.exited or self.slots)


class Slot(Generic[_S]):
    """A handler's place in every :class:`Process` record, typed: ``make``
    builds the handler's state of a process the first time it needs one."""

    def __init__(self, make: Callable[[], _S]) -> None:
        self._make = make

    def get(self, proc: Process | None) -> _S | None:
        if proc is None:
            return None
        return cast("_S | None", proc.slots.get(self))

    def of(self, proc: Process) -> _S:
        state = proc.slots.get(self)
        if state is None:
            state = proc.slots[self] = self._make()
        return cast("_S", state)

    def clear(self, proc: Process) -> None:
        proc.slots.pop(self, None)


class ProcessTable:
    """The :class:`Process` records by tgid.  Writers hold the sampler's lock;
    a lone :meth:`get` may do without."""

    def __init__(self) -> None:
        self._procs: dict[int, Process] = {}

    def get(self, tgid: int) -> Process | None:
        return self._procs.get(tgid)

    def ensure(self, tgid: int) -> Process:
        p = self._procs.get(tgid)
        if p is None:
            p = self._procs[tgid] = Process(tgid)
        return p

    def release(self, proc: Process) -> None:
        """Drop ``proc``'s record if nothing is left in it."""
        if proc.idle and self._procs.get(proc.tgid) is proc:
            del self._procs[proc.tgid]

    def __iter__(self) -> Iterator[Process]:
        return iter(list(self._procs.values()))

    def __len__(self) -> int:
        return len(self._procs)


# ---------------------------------------------------------------------------
# Handlers


class ProcessHandler:
    """Something that wants to know of every process the program samples.

    The manager calls these in the priming thread unless said otherwise; the
    defaults do nothing.
    """

    def open(self, program: KernelProgram) -> None:
        """The program is loaded, not yet attached (the sampler's thread):
        open perf buffers, fill maps."""

    def attach(self, tgid: int) -> None:
        """``tgid``'s maps were read for the first time (the symbolizer has them)."""

    def refresh(self, tgid: int) -> None:
        """``tgid``'s maps were read again: libraries may have been mapped since."""

    def due(self) -> float | None:
        """When (``time.monotonic()``) work of its own is next due; None: none."""
        return None

    def work(self) -> None:
        """The priming thread woke up and read the processes reported: the
        handler's own pending work."""

    def settle(self, table: ProcessTable) -> None:
        """A drain named its window (the drain's thread, under the lock): drop
        the processes marked ``exited``, and whatever else only now may go."""

    def close(self) -> None:
        """The sampler tears down, before the program is unloaded (under the lock)."""


# ---------------------------------------------------------------------------
# The manager


#: The value of a pid filter entry the program wrote at a fork (bpf/profile.bpf.c,
#: FLAMED_FOLLOWED); user space writes 1.
FOLLOWED = 2

#: The flags of a :class:`Process` the program reads, and the map of each.
_FLAG_MAPS = {"watched": "watched", "filtered": "filter_pids"}


class ProcessManager:
    """New process images, the priming thread that reads them, and the
    handlers each is handed to; the watched set and the pid filter.

    ``lock`` is the sampler's: the priming thread takes it to touch shared
    state, a drain holds it throughout.  ``symbolizer`` may be set later
    (the sampler makes its default one at start).
    """

    #: A process first read within PRIME_YOUNG_S of its start is read again
    #: PRIME_REREAD_S later: right after exec the dynamic loader has not
    #: mapped the libraries yet.  Measured with bench/short_lived.py, 20 ms
    #: processes at 999 Hz: 2.0 % of their samples stayed [unknown] without
    #: the second read, 0.5 % with it; a read costs ~90 us of CPU.
    PRIME_REREAD_S = 0.02
    PRIME_YOUNG_S = 0.1
    #: A first read that fails while the process is still there (it read
    #: the identity of an image that exec replaced in the middle of the
    #: read) is tried again PRIME_REREAD_S later, up to this many times.
    #: Without it, about 1 in 200 short Python processes started from a Python
    #: parent was never described (tests/integration/test_python_bpf.py).
    PRIME_FIRST_TRIES = 4

    def __init__(
        self,
        options: BpfSamplerOptions,
        program: KernelProgram,
        stats: SamplerStats,
        lock: threading.RLock,
        symbolizer: Symbolizer | None,
    ) -> None:
        self.options = options
        self.program = program
        self.lock = lock
        self.symbolizer = symbolizer
        self.table = ProcessTable()
        #: The sampler was closed: nothing is read or written any more.
        self.closed = False
        #: Set when the priming thread must stop; long loops of handlers check it.
        self.stopping = threading.Event()
        self._stats = stats
        self._handlers: list[ProcessHandler] = []
        self._primer: threading.Thread | None = None
        self._prime_wake = -1  # eventfd: close() and wake() wake the priming thread's epoll wait with it
        self._wake_lock = threading.Lock()
        self._new_images: list[int] = []  # tgids reported, filled by perf_buffer_poll's callback
        #: tgid -> the exec count of its latest report (when the program knows it), beside _new_images
        self._reported_exec: dict[int, int] = {}
        #: tgid -> the exec count of the image its last first read read (see _renamed)
        self._read_exec: dict[int, int] = {}
        #: (due, tgid, tries) of reads to repeat, in due order: tries 0 is the
        #: second read of a young process, tries >= 1 a first read that failed
        #: while the process was still there (it was exec'ing).
        self._reprime: deque[tuple[float, int, int]] = deque()
        self._prime_tokens = float(options.prime_rate)  # token bucket of prime_rate reads per second
        self._prime_refill = time.monotonic()
        #: Processes handed to the priming thread's first read (or found gone
        #: by it), by tgid: the number of the last drain that sampled them.
        #: A sampled process missing here had its report lost, throttled, or
        #: never sent (its pid and comm already in the program's ``seen``):
        #: the drain queues it in ``_late``.
        self._handed: dict[int, int] = {}
        self._late: deque[int] = deque()
        #: The second reads :meth:`_prime_remapped` will make: (due, tgid), a
        #: heap, and what each asks, by tgid (in at most one entry): addresses
        #: of its code the symbolizer may not know of, or None (read its maps
        #: again whatever they hold).  Under ``_remaps_lock``: any thread asks.
        self._remap_due: list[tuple[float, int]] = []
        self._remap_wanted: dict[int, set[int] | None] = {}
        self._remaps_lock = threading.Lock()
        self._new_code_reports = False  # the program's reports of new code are read (see open)
        #: The identity of the image each first read read, by tgid: a process
        #: said to have exec'd that runs it still was read after its exec.
        self._read_images: dict[int, ProcessIdentity] = {}
        self._drains = 0
        for t in options.pids or ():
            self.table.ensure(t).filtered = True

    def add(self, handler: ProcessHandler) -> None:
        """Hand every process to ``handler`` too, after those added before."""
        self._handlers.append(handler)

    # -- the loaded program ------------------------------------------------
    def open(self) -> None:
        """The program is loaded: write the watched set and the pid filter,
        open the reports of new images, let the handlers open theirs."""
        for p in self.table:
            for flag, name in _FLAG_MAPS.items():
                if getattr(p, flag):
                    self.program.map_set(name, p.tgid, ct.c_uint32)
        self._count_watched()
        if self.options.prime:
            self.program.bpf["new_images"].open_perf_buffer(
                self._on_new_image, page_cnt=self.options.prime_pages, lost_cb=self._on_new_image_lost
            )
            if self.options.new_code:
                self.program.bpf["new_code"].open_perf_buffer(
                    self._on_new_code, page_cnt=self.options.prime_pages, lost_cb=self._on_new_code_lost
                )
                self._new_code_reports = True
        for h in self._handlers:
            h.open(self.program)

    def close(self) -> None:
        for h in self._handlers:
            h.close()

    # -- what the sampler is told -----------------------------------------
    def watch(self, tgid: int) -> None:
        self._mark(tgid, "watched", True)

    def unwatch(self, tgid: int) -> None:
        self._mark(tgid, "watched", False)

    def watched(self) -> frozenset[int]:
        with self.lock:
            return frozenset(p.tgid for p in self.table if p.watched)

    def add_pid(self, tgid: int) -> None:
        self._need_pid_filter()
        self._mark(tgid, "filtered", True)

    def remove_pid(self, tgid: int) -> None:
        self._need_pid_filter()
        self._mark(tgid, "filtered", False)

    def follow_children_of(self, tgid: int, on: bool) -> None:
        if not self.options.follow_forks:
            raise FlamedError("follow_children_of needs follow_forks")
        with self.lock:
            if self.program.bpf is not None:
                (self.program.map_set if on else self.program.map_del)("fork_parents", tgid, ct.c_uint32)

    def _mark(self, tgid: int, flag: Literal["watched", "filtered"], on: bool) -> None:
        """Set or clear one of the flags the program reads from a map, in the
        record and (once loaded) in the map."""
        with self.lock:
            p = self.table.ensure(tgid) if on else self.table.get(tgid)
            if p is not None:
                setattr(p, flag, on)
                self.table.release(p)
            if self.program.bpf is not None and not (on and flag == "filtered" and self._followed(tgid)):
                (self.program.map_set if on else self.program.map_del)(_FLAG_MAPS[flag], tgid, ct.c_uint32)
                if flag == "watched":
                    self._count_watched()

    def _followed(self, tgid: int) -> bool:
        """Is ``tgid`` in the pid filter as the program put it there at its fork
        (``follow_forks``)?  Then it stays as it is: the program takes it out
        at its exit, which an entry user space wrote would outlive."""
        if not self.options.follow_forks:
            return False
        try:
            return int(self.program.bpf["filter_pids"][ct.c_uint32(tgid)].value) == FOLLOWED
        except KeyError:
            return False

    def _count_watched(self) -> None:
        """Tell the program how many processes are watched (after the map changed:
        while it reads 0 it does not look there; bpf/profile.bpf.c)."""
        self.program.array_set("watched_count", 0, len(self.watched()))

    def _need_pid_filter(self) -> None:
        if self.options.pids is None:
            raise FlamedError("the pid filter is off (options.pids is None); set pids=frozenset() to use add_pid")

    def forget(self, pid: int) -> None:
        """``pid`` exited or exec'd: its symbols go now (the symbolizer keeps
        them until its next drain), the handlers drop it after the next drain.
        Unless the image it runs now is the one last read (the program
        reported the exec'd image, and the priming thread read it, before
        this was said): nothing known of it is stale then."""
        if self._current_image_read(pid):
            return
        with self.lock:
            if self.symbolizer is not None:
                self.symbolizer.forget(pid)
            if self._handlers:
                self.table.ensure(pid).exited = True

    def _current_image_read(self, pid: int) -> bool:
        """Is ``pid`` alive, running the image the priming thread read last?"""
        read = self._read_images.get(pid)
        return read is not None and read_identity(pid) == read

    def settle(self) -> None:
        """After a drain named its window: the handlers drop what exited.  A
        process forgotten because it exec'd (it is still there) is read again
        at once, as the new image it is: otherwise it stayed undescribed, its
        Python frames and unwinding gone, until a later drain found it never
        read (a drain interval, 10 s by default).  One whose new image was
        read since (the program reports an exec'd image at its first sample)
        keeps what the handlers made of it."""
        for p in self.table:
            if p.exited and self._current_image_read(p.tgid):
                p.exited = False
                self.table.release(p)
        self._unfilter_gone()
        for h in self._handlers:
            h.settle(self.table)
        again = False
        for p in self.table:
            if p.exited:
                p.exited = False
                self._handed.pop(p.tgid, None)  # its pid may come back as another process
                self._read_images.pop(p.tgid, None)
                self._read_exec.pop(p.tgid, None)
                self.table.release(p)
                if self.options.prime and _alive(p.tgid):
                    self._late.append(p.tgid)
                    again = True
        if again:
            self.wake()

    def _unfilter_gone(self) -> None:
        """Take the processes that exited out of the pid filter: user space
        added them, and nothing else would (the program takes out only those it
        followed at their fork).  A recording that found thousands of short
        processes over its life (``record --subprocesses`` of a build or a test
        run) would otherwise fill the map, and its pids, reused, be sampled."""
        if self.options.pids is None or self.program.bpf is None:
            return
        for p in self.table:
            if p.filtered and not running(f"/proc/{p.tgid}/stat"):
                p.filtered = False
                self.program.map_del("filter_pids", p.tgid, ct.c_uint32)
                self.table.release(p)

    #: A process not sampled for this many drains is forgotten by the late
    #: check: if its pid comes back as another process, that one is read.
    HANDED_KEEP_DRAINS = 8

    def sampled(self, tgids: set[int]) -> None:
        """A drain read samples of ``tgids`` (the drain's thread, under the
        lock).  Those the priming thread never read are queued for it now:
        without this, a process whose first-sample report was lost (a full
        perf buffer), refused for ``prime_rate``, or never sent (its pid and
        comm were still in the program's ``seen`` from an earlier process)
        would never reach the handlers: no Python frames read by the program
        and no unwinding for its whole life."""
        if not self._handlers or not self.options.prime:
            return
        self._drains += 1
        d = self._drains
        handed = self._handed
        late = False
        for t in tgids:
            if t <= 0:
                continue
            if t in handed:
                handed[t] = d
            elif t not in self._late:  # (queued already when it exec'd: see settle)
                self._late.append(t)
                late = True
        if d % self.HANDED_KEEP_DRAINS == 0:
            for t, last in list(handed.items()):
                if last < d - self.HANDED_KEEP_DRAINS:
                    handed.pop(t, None)
            for t in [t for t in self._read_images if t not in handed]:
                self._read_images.pop(t, None)
                self._read_exec.pop(t, None)
        if late:
            self.wake()

    # -- the priming thread --------------------------------------------------
    def start_priming(self) -> None:
        self._prime_wake = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._primer = threading.Thread(target=self._prime_loop, name="flamed-prime", daemon=True)
        self._primer.start()

    def wake(self) -> None:
        """Have the priming thread look at its handlers' due work now: a
        retry queued from another thread (a claim asked from mixed mode) is
        otherwise seen only at the thread's next wake-up, which on a quiet
        host is the next exec anywhere, seconds later.  A no-op in the
        priming thread itself (it recomputes what is due before it waits)."""
        if threading.current_thread() is self._primer:
            return
        with self._wake_lock:
            if self._prime_wake >= 0 and not self.stopping.is_set():
                with contextlib.suppress(OSError):
                    os.eventfd_write(self._prime_wake, 1)

    def stop_priming(self) -> None:
        self.stopping.set()
        if self._prime_wake >= 0:
            with contextlib.suppress(OSError):
                os.eventfd_write(self._prime_wake, 1)
        t = self._primer
        if t is not None and t is not threading.current_thread():
            t.join(timeout=10)
            if t.is_alive():
                log.warning("the priming thread did not stop within 10 s")
                return  # it may still wait on the eventfd: leave it open
        if self._prime_wake >= 0 and (t is None or not t.is_alive()):
            with self._wake_lock:
                os.close(self._prime_wake)
                self._prime_wake = -1

    def _prime_loop(self) -> None:
        # Latency matters here (a process's maps and its Python description
        # must be read while it runs, within milliseconds of its first
        # sample), CPU does not (a few reads a second): run ahead of ordinary
        # work on a busy host.  Not permitted without CAP_SYS_NICE: fine.
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), -10)
        except OSError:
            pass
        # One epoll over the perf buffers and the close() eventfd, with no
        # timeout unless a second read or a handler's retry is due: an idle
        # host wakes this thread only when a process execs.
        readers = list(self.program.bpf.perf_buffers.values())
        ep = select.epoll()
        try:
            for r in readers:
                ep.register(self.program.lib.perf_reader_fd(r), select.EPOLLIN)
            ep.register(self._prime_wake, select.EPOLLIN)
            self._prime_wait(ep, readers)
        finally:
            ep.close()

    def _prime_wait(self, ep: select.epoll, readers: list[Any]) -> None:
        failures = 0
        arr = (ct.c_void_p * len(readers))(*readers)
        while not self.stopping.is_set():
            try:
                due = [d for d in (self._reprime[0][0] if self._reprime else None, self._remap_next(),
                                   *(h.due() for h in self._handlers)) if d is not None]
                wait = max(0.0, min(due) - time.monotonic()) if due else -1.0
                if ep.poll(wait) and not self.stopping.is_set():
                    with contextlib.suppress(BlockingIOError):
                        os.eventfd_read(self._prime_wake)  # a wake(): reset it
                if self.stopping.is_set():
                    break  # close() joins this thread before it tears the buffers down
                # Reads every buffer's pending records and calls their callbacks.
                self.program.lib.perf_reader_consume(len(readers), arr)
                self._prime_reported()
                self._prime_remapped()
                self._prime_late()
                self._prime_again()
                for h in self._handlers:
                    h.work()
                failures = 0
            except Exception as e:  # noqa: BLE001 -- keep sampling; the drain reads maps anyway
                failures += 1
                if failures in (1, 100):
                    log.warning("reading the maps of new processes failed: %s", e)
                if self.stopping.wait(0.1):
                    break

    def _on_new_image(self, _cpu: int, data: Any, size: int) -> None:
        if size >= 4:
            tgid = ct.cast(data, ct.POINTER(ct.c_uint32))[0]
            self._new_images.append(tgid)
            if size >= _IMAGE.size:
                self._reported_exec[tgid] = _IMAGE.unpack(ct.string_at(data, _IMAGE.size))[2]

    def remap(self, tgid: int, addrs: Sequence[int]) -> None:
        """``tgid`` has code at ``addrs`` (any thread): the unwinder found
        these mappings, or a stack met one of these addresses outside every
        mapping it was told of.  Unless the symbolizer's mappings of ``tgid``
        hold them all, the priming thread reads them again
        (:meth:`_prime_remapped`).  Without this, a library loaded after the
        second read (an extension module and what it links: ``import
        hashlib`` brings libcrypto) stayed unknown to the symbolizer until a
        drain found the process alive; one that exited first had every stack
        through that library cut to ``[unknown]``."""
        self._ask_remap(tgid, set(addrs), time.monotonic() + self.REMAP_DELAY_S)
        self.wake()

    def _on_new_code(self, _cpu: int, data: Any, size: int) -> None:
        # A process read before mapped code (bpf/profile.bpf.c,
        # flamed_code_mapped): read its maps again.
        if size >= 4:
            tgid = ct.cast(data, ct.POINTER(ct.c_uint32))[0]
            self._ask_remap(tgid, None, time.monotonic() + self.REMAP_DELAY_S)

    def _remap_next(self) -> float | None:
        """When the next second read is due, if any."""
        with self._remaps_lock:
            return self._remap_due[0][0] if self._remap_due else None

    def _ask_remap(self, tgid: int, addrs: set[int] | None, due: float) -> None:
        """A second read of ``tgid`` at ``due``, merged into the one it waits
        for if any (None, read whatever the maps hold, takes over addresses)."""
        with self._remaps_lock:
            if tgid not in self._remap_wanted:
                self._remap_wanted[tgid] = addrs
                heapq.heappush(self._remap_due, (due, tgid))
            elif addrs is None:
                self._remap_wanted[tgid] = None
            else:
                known = self._remap_wanted[tgid]
                if known is not None:
                    known.update(addrs)

    #: A second read is made REMAP_DELAY_S after the report that asks for
    #: it: the dynamic loader maps a library and those it links one after
    #: the other (a process start, an ``import``), and one read then sees
    #: them all.  7 interpreters starting at once asked for ~30 reads each
    #: without the wait, enough to take the whole prime_rate budget from the
    #: first reads of other processes (which then had no Python frames).
    REMAP_DELAY_S = 0.01
    #: Second reads leave this share of prime_rate to first reads: they wait
    #: (REMAP_RETRY_S) while fewer tokens than that are left.
    REMAP_RESERVE = 0.5
    REMAP_RETRY_S = 0.05

    def _prime_remapped(self) -> None:
        """Second reads asked for by :meth:`remap` and the program's reports
        of new code, once due: of processes read before, whose mappings read
        so far lack an address named (or any address, for a report of new
        code)."""
        now = time.monotonic()
        sym = self.symbolizer
        while not self.stopping.is_set():
            with self._remaps_lock:
                if not self._remap_due or self._remap_due[0][0] > now:
                    return
                _due, tgid = heapq.heappop(self._remap_due)
                addrs = self._remap_wanted.pop(tgid, None)
            if sym is None:
                continue
            with self.lock:
                if self.closed or not sym.primed(tgid):
                    continue
                if addrs is not None and not any(sym.maps_lack(tgid, a) for a in addrs):
                    continue
            rate = self.options.prime_rate
            if not self._prime_token(reserve=max(0.0, min(self.REMAP_RESERVE * rate, rate - 1.0))):
                if _alive(tgid):  # asked again later, behind the first reads
                    self._ask_remap(tgid, addrs, now + self.REMAP_RETRY_S)
                continue
            if self._read_and_prime(tgid, first=False) is not None:
                self._stats.prime_remapped_total += 1

    def _on_new_code_lost(self, lost: int) -> None:
        self._stats.new_code_lost_total += int(lost)

    def _on_new_image_lost(self, lost: int) -> None:
        self._stats.prime_lost_total += int(lost)

    def _prime_token(self, reserve: float = 0.0) -> bool:
        """May the priming thread read /proc once more now (prime_rate),
        leaving ``reserve`` tokens?  Refusals are counted as throttled only
        without a reserve (a read that waits for its turn is not refused)."""
        now = time.monotonic()
        rate = self.options.prime_rate
        self._prime_tokens = min(float(rate), self._prime_tokens + (now - self._prime_refill) * rate)
        self._prime_refill = now
        if self._prime_tokens >= 1.0 + reserve:
            self._prime_tokens -= 1.0
            return True
        if not reserve:
            self._stats.prime_throttled_total += 1
        return False

    def _may_read(self) -> bool:
        """May the priming thread read /proc for one process now?  False
        when over ``prime_rate``; without a symbolizer nothing will be read,
        and no token is taken."""
        return self.symbolizer is None or self._prime_token()

    def _read_and_prime(self, tgid: int, *, first: bool, tries: int | None = None) -> ProcessIdentity | None:
        """Read ``tgid``'s identity and maps and hand them to the symbolizer
        (in the priming thread; the caller took a token, :meth:`_may_read`);
        the identity primed, or ``None`` when gone or closed.  Only first
        reads are counted as primed or missed.  ``tries``: how many times this
        first read failed already; a failed one of a process still there is
        tried again soon."""
        sym = self.symbolizer
        if sym is None:
            return None
        prepared = sym.prepare(tgid)  # /proc reads: outside the lock, a drain may hold it
        if prepared is None and tries is not None and tries + 1 < self.PRIME_FIRST_TRIES and _alive(tgid):
            self._reprime.append((time.monotonic() + self.PRIME_REREAD_S, tgid, tries + 1))
            return None
        with self.lock:
            if self.closed:
                return None
            if prepared is None:
                if first:
                    self._stats.prime_missed_total += 1
                return None
            sym.prime(tgid, prepared)
            if first:
                self._stats.primed_total += 1
                self._read_images[tgid] = prepared[0]
                if self._new_code_reports:  # its code mapped from now on is reported
                    self.program.map_set("read_tgids", tgid, ct.c_uint32)
        return prepared[0]

    def _prime_reported(self) -> None:
        """First reads of every process image reported since the last call,
        but for a thread renamed in an image read already (:meth:`_renamed`)."""
        tasks, self._new_images = self._new_images, []
        execs, self._reported_exec = self._reported_exec, {}
        for tgid in dict.fromkeys(tasks):
            if self.stopping.is_set():
                break
            try:
                self._prime_reported_one(tgid, execs.get(tgid, 0))
            except Exception as e:  # noqa: BLE001 -- one process's failure must not drop the batch's others
                self._stats.prime_failed_total += 1
                if self._stats.prime_failed_total in (1, 100):
                    log.warning("reading the new process %d failed: %s", tgid, e)

    def _prime_reported_one(self, tgid: int, exec_id: int) -> None:
        if self._renamed(tgid, exec_id):
            self._handed[tgid] = self._drains
            self._stats.prime_renamed_total += 1
            return
        before = self._read_images.get(tgid)
        self._prime_first(tgid, 0)
        read = self._read_images.get(tgid)
        if exec_id and read is not None and read is not before:
            self._read_exec[tgid] = exec_id
        elif read is not before:
            self._read_exec.pop(tgid, None)

    def _renamed(self, tgid: int, exec_id: int) -> bool:
        """Is this report of an image read already?  The program reports an
        image per (tgid, comm, exec count), and the comm is the sampled
        thread's: each thread that names itself (pthread_setname_np,
        prctl(PR_SET_NAME), a pool's "worker-N") is reported once more.  The
        same exec count and the same identity (start time, start of code and
        stack) as at the last first read: the same image, nothing to read
        again.  Before, each such report had the handlers describe the process
        anew: its Python frames and unwinding were gone until the new
        description was installed, and the names of its code objects read so
        far were dropped (a process that then exited kept them unnamed).
        Without the exec count (unknown to the program) every report is read."""
        return bool(exec_id) and self._read_exec.get(tgid) == exec_id and self._current_image_read(tgid)

    def _prime_late(self) -> None:
        """First reads of the processes a drain sampled that were never read
        (see :meth:`sampled`), unless their report came meanwhile."""
        while self._late and not self.stopping.is_set():
            tgid = self._late.popleft()
            if tgid in self._handed:
                continue
            if self._prime_first(tgid, 0):  # refused again: left for the next drain, not counted twice
                self._stats.prime_late_total += 1

    def _prime_first(self, tgid: int, tries: int) -> bool:
        """The first read of a process image, then the handlers; False when
        refused for ``prime_rate`` (left for the next drain that samples it)."""
        if not self._may_read():
            return False
        ident = self._read_and_prime(tgid, first=True, tries=tries)
        if ident is None and tries + 1 >= self.PRIME_FIRST_TRIES and _alive(tgid):
            # Every try failed and it still runs: not handed, so the next
            # drain that samples it has it read (its image is reported once).
            self._handed.pop(tgid, None)
            return True
        self._handed[tgid] = self._drains  # read, gone, or to be read again soon: not a late one
        if ident is None:
            return True
        if _age_s(ident) < self.PRIME_YOUNG_S:
            self._reprime.append((time.monotonic() + self.PRIME_REREAD_S, tgid, 0))
        for h in self._handlers:
            h.attach(tgid)
        return True

    def _prime_again(self) -> None:
        """The due second reads of recently primed young processes, and the
        first reads to try again."""
        now = time.monotonic()
        while self._reprime and self._reprime[0][0] <= now:
            _due, tgid, tries = self._reprime.popleft()
            if tries:
                self._prime_first(tgid, tries)
            elif self._may_read() and self._read_and_prime(tgid, first=False) is not None:
                for h in self._handlers:
                    h.refresh(tgid)
