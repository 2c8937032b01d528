"""The BPF stack sampler: bpf/profile.bpf.c loaded with bcc, drained into Windows.

:class:`BpfSampler` implements :class:`flamed.sampling.contract.Sampler` by
composing the sampling side's parts:

* flamed.sampling.program: the options, the program text, and
  :class:`~flamed.sampling.program.KernelProgram` (compile, load, attach one
  perf event per CPU, map writes, teardown);
* flamed.sampling.processes: the process manager (new process images, the
  priming thread, the watched set and the pid filter), which hands each
  process to the feeds of flamed.sampling.feeds (CPython walker, unwinder);
* flamed.sampling.drain: generations read and cleared into a symbolized
  :class:`~flamed.sampling.contract.Window`, and :class:`SamplerStats`.

How and why is in docs/bpf.md; what can degrade a sample, and how it shows,
in flamed.sampling.drain.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flamed.errors import FlamedError
from flamed.sampling.cgroups import CgroupError, CgroupFilter, CgroupResolver, find_v2_hierarchy
from flamed.sampling.contract import Window
from flamed.sampling.drain import DROPPING_REASONS, LOST_REASONS, Drainer, SamplerStats
from flamed.sampling.feeds import PythonFeed, UnwindFeed
from flamed.sampling.kallsyms import KallsymsPreload
from flamed.sampling.processes import ProcessManager
from flamed.sampling.packed import Numbering
from flamed.sampling.program import (
    EVENTS,
    MAX_FREQUENCY,
    BpfProgram,
    BpfSamplerOptions,
    KernelProgram,
    bpf_program,
    default_bpf_dir,
    online_cpus,
    print_bpf,
    task_fsbase_offset,
)
from flamed.sampling.pyframes import PythonFrames
from flamed.sampling.symbols import Resolver, Symbolizer, default_resolver
from flamed.sampling.unwind.tables import Unwinder

#: Importable from here: the sampler's public API.
__all__ = [
    "DROPPING_REASONS",
    "EVENTS",
    "LOST_REASONS",
    "MAX_FREQUENCY",
    "BpfProgram",
    "BpfSampler",
    "BpfSamplerOptions",
    "SamplerStats",
    "bpf_program",
    "default_bpf_dir",
    "from_config",
    "online_cpus",
    "options_from_config",
    "print_bpf",
    "program_text_for_config",
    "task_fsbase_offset",
]


log = logging.getLogger("flamed.bpf")


def _default_resolver(pid: int, kernel: KallsymsPreload | None = None) -> Resolver:
    """kallsyms read by flamed for the kernel (bcc's needs euid 0; ``kernel``:
    read ahead in a thread); flamed's perf-map and vDSO reader per process
    (bcc's per-process cache closes stray fds before bcc 0.33:
    :class:`flamed.sampling.symbols.ProcResolver`)."""
    if pid < 0 and kernel is not None:
        return kernel.take()
    return default_resolver(pid)


class BpfSampler:
    """bpf/profile.bpf.c through bcc; implements :class:`flamed.sampling.contract.Sampler`.

    ``symbolizer`` and ``clock`` (wall-clock ns) can be passed in; the
    defaults are bcc's symbol caches and :func:`time.time_ns`.
    ``cgroup_resolver`` names the cgroups of the samples (``Window.identities``);
    by default one on this host's cgroup v2 hierarchy, none without one.
    """

    def __init__(
        self,
        options: BpfSamplerOptions = BpfSamplerOptions(),
        *,
        symbolizer: Symbolizer | None = None,
        clock: Callable[[], int] = time.time_ns,
        python_frames: PythonFrames | None = None,
        cgroup_resolver: CgroupResolver | None = None,
    ) -> None:
        options.validate()
        self._cgroups = cgroup_resolver
        self.options = options
        self._python = python_frames if python_frames is not None else (PythonFrames() if options.python else None)
        self._fsbase_offset = -1
        self._clock = clock
        self._lock = threading.RLock()
        self._stats = SamplerStats(frequency=options.frequency)
        self._program = KernelProgram(options)
        self._processes = ProcessManager(options, self._program, self._stats, self._lock, symbolizer)
        # Handed each process in this order: the unwinder's table loads start
        # before a Python probe, which may take milliseconds.
        self._unwind_feed = UnwindFeed(self._processes) if options.unwind else None
        self._python_feed = PythonFeed(self._processes, self._python) if self._python is not None else None
        for feed in (self._unwind_feed, self._python_feed):
            if feed is not None:
                self._processes.add(feed)
        self._drainer: Drainer | None = None
        self._numbering: Numbering | None = None
        self._cgroup_filter: _FollowedCgroups | None = None
        self._started = False
        self._prepared = False  # compiled and loaded, not attached (prepare())
        self._t_prepare = 0.0
        self._no_cgroups = False  # looked for a cgroup v2 hierarchy and found none

    # -- Sampler protocol -------------------------------------------------
    def prepare(self) -> None:
        """Everything :meth:`start` does before the program is attached: the compile
        (or the cached image), the maps, the verifier.  Takes seconds, and samples
        nothing yet: the daemon runs it beside the sampler it replaces on reload
        (which keeps draining meanwhile), then :meth:`start` attaches in milliseconds."""
        with self._lock:
            if self._prepared or self._started:
                return
            if self._processes.closed:
                raise FlamedError("sampler already closed; make a new one")
            try:
                self._prepare()
            except BaseException:
                self._teardown()
                raise
            self._prepared = True

    def start(self) -> None:
        with self._lock:
            if self._started:
                return
            if self._processes.closed:
                raise FlamedError("sampler already closed; make a new one")
            try:
                if not self._prepared:
                    self._prepare()
                    self._prepared = True
                self._attach()
            except BaseException:
                self._teardown()
                raise
            self._started = True
            if self.options.prime:
                self._processes.start_priming()

    def drain(self, *, close_waits: bool = False) -> Window:
        """See the protocol; ``close_waits`` (off-CPU): also count the waits
        still open up to now and forget them, for the last drain of a recording."""
        with self._lock:
            if not self._started or self._processes.closed or self._drainer is None:
                raise FlamedError("sampler not started")
            return self._drainer.drain(close_waits=close_waits)

    def number_into(self, numbering: Numbering | None) -> None:
        """Drain windows whose counts are numbered in ``numbering``'s table (the
        daemon's snapshot ring: flamed/sampling/packed.py), not as tuples of frames."""
        self._numbering = numbering
        if self._drainer is not None:
            self._drainer.numbering = numbering

    def watch(self, tgid: int) -> None:
        self._processes.watch(tgid)

    def unwatch(self, tgid: int) -> None:
        self._processes.unwatch(tgid)

    def close(self) -> None:
        self._processes.stop_priming()
        with self._lock:
            if self._processes.closed:
                return
            self._processes.closed = True
            self._teardown()

    def stop(self) -> None:
        """Stop sampling but keep the maps: a last :meth:`drain` then returns
        everything up to now (what a daemon does on SIGTERM)."""
        with self._lock:
            self._program.stop()

    # -- beyond the protocol ---------------------------------------------
    def __enter__(self) -> BpfSampler:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def event(self) -> str:
        """``cycles`` or ``cpu-clock``: the perf event in use (after start)."""
        return self._program.event_name

    @property
    def watched(self) -> frozenset[int]:
        return self._processes.watched()

    def add_pid(self, tgid: int) -> None:
        """Add a process to the pid filter (``options.pids`` must be set)."""
        self._processes.add_pid(tgid)

    def remove_pid(self, tgid: int) -> None:
        self._processes.remove_pid(tgid)

    def follow_children_of(self, tgid: int, on: bool = True) -> None:
        """With ``follow_forks``: while on, the processes ``tgid`` starts are put in
        the pid filter at their fork (``tgid`` itself is not sampled).  ``flamed
        record`` sets it around the start of its command, which is then filtered
        in before it can start anything of its own."""
        self._processes.follow_children_of(tgid, on)

    def forget(self, pid: int) -> None:
        """``pid`` exited or exec'd: drop its symbols once the next drain has
        symbolized the samples it still has in flight."""
        self._processes.forget(pid)

    def poll_events(self) -> int:
        """Move events from the ring buffer into the sampler (returned by the
        next drain).  Call it between drains when watched processes produce
        more events per drain interval than the ring buffer holds; returns how
        many were read."""
        with self._lock:
            if self._drainer is None:
                return 0
            return self._drainer.poll_events()

    def stats(self) -> SamplerStats:
        with self._lock:
            s = self._stats.copy()
            sym = self._processes.symbolizer
            if sym is not None:
                s.symbol_processes = sym.stats.processes
                s.symbol_addresses = sym.stats.addresses_cached
            return s

    def program(self) -> BpfProgram:
        return bpf_program(self.options, fsbase_offset=self._fsbase_offset)

    @property
    def unwinder(self) -> Unwinder | None:
        """The native unwinder's tables (``options.unwind``), for tests and status."""
        return self._unwind_feed.unwinder if self._unwind_feed is not None else None

    def unwind_ready(self, tgid: int) -> bool:
        """Has ``tgid`` been described to the unwinder (its stacks are unwound from tables)?"""
        return self._unwind_feed is not None and self._unwind_feed.ready(tgid)

    @property
    def python_frames(self) -> PythonFrames | None:
        """The CPython side (``options.python``), for metrics and status."""
        return self._python

    def python_claim(self, tgid: int) -> tuple[bool | None, str]:
        """Does the program read ``tgid``'s Python frames itself?  ``(True,
        "walked")``; ``(False, reason)`` (then py-spy may); ``(None, "")``: not
        ready yet, ask again.  Probes the process now if it has not been."""
        if self._python_feed is None:
            return False, "bpf_walker_off"
        return self._python_feed.claim(tgid)

    # -- start and teardown ------------------------------------------------
    def _prepare(self) -> None:
        program = self._program
        startup = self._stats.startup
        t0 = time.perf_counter()
        self._t_prepare = t0
        # Before the compile: a typo in a cgroup filter fails in milliseconds.
        followed = self._follow_cgroups()
        # The kernel's symbols are read while the program compiles: the first
        # drain needs them, and the compile leaves a CPU free.
        kernel = KallsymsPreload() if self._processes.symbolizer is None else None
        program.load(self._fsbase)
        t1 = time.perf_counter()
        startup["compile_s"] = round(t1 - t0, 3)  # BTF offsets, bcc's clang compile or the cache, maps, the verifier
        if program.load_info is not None:
            startup["program_s"] = round(program.load_info.seconds, 3)  # the compile or the cached image, maps
            self._stats.program = program.load_info.how
        sym = self._processes.symbolizer = (
            self._processes.symbolizer
            or Symbolizer(resolver_factory=lambda pid: _default_resolver(pid, kernel)))
        program.fill_filters()
        if followed is not None:
            followed.fill(self._stats)
            self._cgroup_filter = followed
        self._processes.open()
        self._drainer = Drainer(program, self._stats, sym, python=self._python, unwinder=self.unwinder,
                                clock=self._clock, settle=self._settle, cgroups=self.cgroup_resolver,
                                sampled=self._processes.sampled)
        self._drainer.numbering = self._numbering

    def _attach(self) -> None:
        program = self._program
        startup = self._stats.startup
        t2 = time.perf_counter()
        program.attach()
        startup["attach_s"] = round(time.perf_counter() - t2, 3)  # perf events per CPU, tracepoints, uprobes
        # From the prepare's start: a sampler prepared beside another (reload) counts its wait too.
        startup["sampler_s"] = round(time.perf_counter() - self._t_prepare, 3)
        self._stats.event = program.event_name
        self._stats.cpus = program.cpus

    @property
    def cgroup_resolver(self) -> CgroupResolver | None:
        """The resolver of the samples' cgroup ids (made on first use); None without cgroup v2."""
        if self._cgroups is None and not self._no_cgroups:
            hierarchy, why = find_v2_hierarchy()
            if hierarchy is None:
                self._no_cgroups = True
                log.info("no cgroup v2 hierarchy (%s): samples carry no service or container identity", why)
            else:
                self._cgroups = CgroupResolver(hierarchy)
        return self._cgroups

    def _follow_cgroups(self) -> _FollowedCgroups | None:
        if not self.options.filters_cgroups:
            return None
        resolver = self.cgroup_resolver
        if resolver is None:
            _, why = find_v2_hierarchy()
            raise CgroupError(f"cgroups/units filters need cgroup v2, and there is none: {why}")
        specs = self.options.cgroup_specs(resolver.hierarchy)
        cgroup_filter = CgroupFilter(specs, resolver, require_present=not self.options.cgroups_missing_ok)
        return _FollowedCgroups(cgroup_filter, self._program, self.options.filter_max)

    def _fsbase(self) -> int:
        """Where the kernel keeps a task's fs base, for the CPython walker (-1: unknown or not needed)."""
        if self.options.python:
            self._fsbase_offset = task_fsbase_offset()
            if self._python is not None:
                self._python.fsbase_known = self._fsbase_offset >= 0
        return self._fsbase_offset

    def _settle(self) -> None:
        """The end of each drain: exited processes go, CPUs come online."""
        self._processes.settle()
        if self._cgroup_filter is not None:
            self._cgroup_filter.refresh(self._stats)
        if self._program.refresh_cpus():
            self._stats.cpus = self._program.cpus

    def _teardown(self) -> None:
        self._program.detach()
        self._processes.close()
        self._program.close()
        if self._processes.symbolizer is not None:
            self._processes.symbolizer.close()
        self._drainer = None
        self._cgroup_filter = None


class _FollowedCgroups:
    """The BPF cgroup filter map kept equal to a :class:`CgroupFilter`'s ids.

    A restarted unit gets a new cgroup (a new id) at the same path, so the
    ids are looked up again at every drain, not once at start.
    """

    def __init__(self, cgroup_filter: CgroupFilter, program: KernelProgram, capacity: int) -> None:
        self.filter = cgroup_filter
        self.program = program
        self.capacity = capacity
        self.in_map: set[int] = set()
        self._overflow_logged = False

    def fill(self, stats: SamplerStats) -> None:
        where = self.filter.resolver.hierarchy.mount_point
        for spec in self.filter.missing():
            log.warning("cgroup filter %s: no such cgroup under %s yet; its tasks are sampled once it appears",
                        spec, where)
        self._write(self.filter.ids(), stats)

    def refresh(self, stats: SamplerStats) -> None:
        found = self.filter.refresh()
        for change in found.changes:
            log.info("%s", change)
        stats.cgroup_filter_changes_total += len(found.changes)
        if found or len(self.in_map) < len(self.filter.ids()):
            self._write(self.filter.ids(), stats)

    def _write(self, ids: frozenset[int], stats: SamplerStats) -> None:
        gone = self.in_map - ids
        room = self.capacity - (len(self.in_map) - len(gone))
        new = sorted(ids - self.in_map)
        if len(new) > room and not self._overflow_logged:
            self._overflow_logged = True
            log.warning("cgroup filter: %d cgroups match, the filter map holds %d; the rest are not sampled "
                        "(name fewer or deeper cgroups)", len(ids), self.capacity)
        new = new[:max(room, 0)]
        self.program.update_cgroup_filter(new, gone)
        self.in_map = (self.in_map - gone) | set(new)
        stats.cgroup_filter_ids = len(self.in_map)


# ---------------------------------------------------------------------------
# The daemon's [sampling] table


def options_from_config(cfg: Any) -> BpfSamplerOptions:
    """BpfSamplerOptions from the daemon's ``SamplingConfig`` (or anything with
    the same attribute names).  Empty filter lists mean "no filter"; keys the
    config does not have keep the sampler's defaults."""
    d = BpfSamplerOptions()

    def get(name: str, default: Any) -> Any:
        return getattr(cfg, name, default)

    def filt(name: str) -> frozenset[Any] | None:
        v = get(name, None)
        return frozenset(v) if v else None

    cpus = get("cpus", None)
    bpf_dir = get("bpf_dir", None)
    return BpfSamplerOptions(
        frequency=int(get("frequency", d.frequency)),
        event=str(get("event", d.event)),
        cpus=tuple(cpus) if cpus else None,
        include_idle=bool(get("include_idle", d.include_idle)),
        pids=filt("pids"),
        tids=filt("tids"),
        cgroups=filt("cgroups"),
        units=filt("units"),
        comms=filt("comms"),
        stack_storage_size=int(get("stack_map_size", get("stack_storage_size", d.stack_storage_size))),
        stack_depth=int(get("stack_depth", d.stack_depth)),
        max_entries=int(get("counts_map_size", get("max_entries", d.max_entries))),
        ringbuf_pages=int(get("ringbuf_pages", d.ringbuf_pages)),
        prime=bool(get("prime_new_processes", get("prime", d.prime))),
        prime_rate=int(get("prime_rate", d.prime_rate)),
        new_code=bool(get("reread_new_code", d.new_code)),
        bpf_dir=Path(bpf_dir) if bpf_dir else None,
    )


def from_config(cfg: Any) -> BpfSampler:
    """The daemon's sampler: a :class:`BpfSampler` for its ``[sampling]`` table."""
    return BpfSampler(options_from_config(cfg))


def program_text_for_config(cfg: Any) -> str:
    """``flamed daemon --print-bpf``: the flags and source that would load."""
    opts = options_from_config(cfg)
    return bpf_program(opts, fsbase_offset=task_fsbase_offset() if opts.python else -1).render()
