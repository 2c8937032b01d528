"""Mixed mode assembled: watcher + py-spy supervisor + clock uprobe + join.

:class:`MixedMode` is what ``flamed record`` and the daemon's ``python``
window processor drive.  A background thread (the one that forks py-spy, so
``PR_SET_PDEATHSIG`` holds for as long as it runs) polls the process watcher
and ticks the supervisor; every Python process found is ``watch()``-ed on the
sampler and gets a py-spy.  :meth:`MixedMode.process` takes the sampler's
timestamped events and returns those that can be joined now, each with its
mixed stack; an event waits until the py-spy run covering its instant has
finished (at most ``max_delay_s``), so Python samples reach the output one
py-spy window late.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from flamed.errors import CapabilityError
from flamed.model import Stack
from flamed.pyspy.align import AlignedTrace, JoinOptions, JoinStats, align_trace, join_events
from flamed.pyspy.clock import PySpyClock
from flamed.pyspy.clockfit import fit_clock, observed_times, sample_times
from flamed.pyspy.supervisor import CompletedRun, Failure, PySpyOptions, PySpySupervisor
from flamed.pyspy.threadids import ThreadIds
from flamed.pyspy.watcher import ProcessWatcher, PyProcess, WatchOptions, wait_readable
from flamed.sampling.contract import Sampler, SampleEvent, Window
from flamed.sampling.pysource import Claim, ClaimFn, Decision, decide, decide_late
from flamed.sampling.packed import weight_by_tgid

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MixedOptions:
    """Mixed mode as a whole.

    pyspy / watch / join: the parts' options (see their classes).
    clock: calibrate py-spy's clock with the uprobe of bpf/pyspy_clock.bpf.c (default True).
    vm_readv: also trace py-spy's process_vm_readv calls and time samples by their
        reads (a filtered syscall tracepoint: tens of ns on every syscall of the
        host).  Measured less accurate than the increment times, because py-spy
        also reads outside its samples (default False).
    active_only: give py-spy (and timestamped events) only to Python processes
        the sampler saw on a CPU: a found process is a candidate until a drained
        window counts ``active_min_samples`` samples for it, and goes back to
        being one after ``idle_windows`` windows without any (default False;
        the daemon sets it, so idle interpreters cost no py-spy).
    max_delay_s: how long an event waits for its py-spy trace before it is
        emitted under ``[python: no frame]`` (default: 2 windows + 5 s).
    """

    pyspy: PySpyOptions = field(default_factory=PySpyOptions)
    watch: WatchOptions = field(default_factory=WatchOptions)
    join: JoinOptions = field(default_factory=JoinOptions)
    clock: bool = True
    vm_readv: bool = False
    active_only: bool = False
    active_min_samples: int = 1
    idle_windows: int = 6
    max_delay_s: float | None = None

    @property
    def delay_ns(self) -> int:
        d = self.max_delay_s if self.max_delay_s is not None else 2 * self.pyspy.window_s + 5
        return int(d * 1e9)


class MixedMode:
    """Python stacks joined into a sampler's events; see the module doc."""

    def __init__(self, sampler: Sampler | None, options: MixedOptions | None = None, *,
                 proc_root: str = "/proc", on_process: Callable[[PyProcess], None] | None = None,
                 on_exit: Callable[[int], None] | None = None,
                 clock: Callable[[], int] = time.monotonic_ns,
                 claim: ClaimFn | None = None,
                 pyspy_fallback: bool = True) -> None:
        """``claim(pid)``: does the BPF sampler read this process's Python frames
        itself?  ``(True, _)``: yes, no py-spy for it; ``(False, reason)``: no,
        py-spy it; ``(None, _)``: not decided yet (asked again each tick, for
        at most CLAIM_WAIT_S).  ``None``: every process gets py-spy.  The
        decision itself is :func:`flamed.sampling.pysource.decide`'s."""
        self.options = options or MixedOptions()
        self._claim = claim
        self._pyspy_fallback = pyspy_fallback
        self._deferred: dict[int, tuple[PyProcess, int]] = {}  # pid -> (process, first asked ns)
        #: pid -> (source, reason): how each Python process found gets its frames
        #: (``bpf``/``walked``, ``pyspy``/why not BPF, ``none``/why neither).
        self.sources: dict[int, tuple[str, str]] = {}
        #: The same for the last MAX_DECIDED processes, exited ones too (for summaries).
        self.decided: dict[int, tuple[str, str]] = {}
        self.sampler = sampler
        self._now = clock
        self._on_process = on_process
        self._on_exit_cb = on_exit
        self.supervisor = PySpySupervisor(self.options.pyspy, proc_root=proc_root, clock=clock,
                                          on_spawn=self._spawned, ready=self._pyspy_sampling,
                                          on_discard=self._discarded)
        self.watcher = ProcessWatcher(self.options.watch, on_start=self._started, on_exit=self._exited,
                                      on_thread=self._new_thread, proc_root=proc_root, clock=clock)
        self.thread_ids = ThreadIds(proc_root)
        self._gone: set[int] = set()  # exited pids whose thread-id maps the last runs may still need
        self.clock: PySpyClock | None = None
        self.clock_error: str | None = None
        self._clock_tried = False
        #: The clock is attached, or known to be unavailable: py-spy may start.
        self._clock_settled = False
        self._lock = threading.RLock()
        self._traces: list[AlignedTrace] = []
        self._pending: list[SampleEvent] = []
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake_fd = -1  # eventfd: wakes the mixed thread's wait (close, follow, promotions)
        self.stats = JoinStats()
        self.counters: Counter[str] = Counter()
        self.processes: dict[int, PyProcess] = {}
        self.candidates: dict[int, PyProcess] = {}  # found, not yet seen on a CPU (active_only)
        self._idle: dict[int, int] = {}  # watched pid -> windows without a sample
        self.loop_lag_max_ns = 0
        self._next_track_ns = 0
        self._track_now: set[int] = set()  # processes under py-spy that started a thread

    def replace_sampler(self, sampler: Sampler, *, claim: ClaimFn | None,
                        on_exit: Callable[[int], None] | None) -> None:
        """A new sampler took over (the daemon's reload of ``[sampling]``): the claims
        and exits of processes found from now on go to it, not to the closed one (whose
        walker no longer describes anything: every new process waited CLAIM_WAIT_S,
        undecided, then got py-spy); what this watches, it watches too."""
        with self._lock:
            self.sampler = sampler
            self._claim = claim
            self._on_exit_cb = on_exit
            for pid in list(self.processes):
                sampler.watch(pid)

    # -- lifecycle --------------------------------------------------------
    def start(self, *, clock_now: bool = False) -> None:
        """Start the mixed thread.  The py-spy clock (a uprobe program bcc
        compiles: 0.3 s) is set up here with ``clock_now`` (py-spy is sure to
        run), else by the mixed thread before it starts the first py-spy:
        when the BPF walker reads every process, no py-spy runs and no clock
        is compiled."""
        self._clock_tried = self._clock_settled = self.clock is not None
        if clock_now and self.clock is None:
            self._start_clock()
        if self.supervisor.binary is None:
            log.warning("py-spy not found: Python processes keep their native and kernel stacks only")
        self._stop.clear()
        if self._wake_fd < 0:
            self._wake_fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        ready = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            try:
                self.watcher.start()
            except BaseException as e:  # noqa: BLE001 - reported to start()'s caller
                errors.append(e)
                ready.set()
                return
            ready.set()
            self._loop()

        self._thread = threading.Thread(target=run, name="flamed-mixed", daemon=True)
        self._thread.start()
        ready.wait(30)
        if errors:
            raise errors[0]

    def _start_clock(self) -> None:
        """Attach the py-spy clock (or say once why not: ``clock_error``)."""
        self._clock_tried = True
        try:
            self._attach_clock()
        finally:
            with self._lock:
                self._clock_settled = True

    def _attach_clock(self) -> None:
        if not self.options.clock or self.supervisor.binary is None:
            return
        # the sampler's compiled-program cache and compile isolation serve the clock too
        sopts = getattr(self.sampler, "options", None)
        clk = PySpyClock(self.supervisor.binary, vm_readv=self.options.vm_readv,
                         cache_dir=getattr(sopts, "bpf_cache_dir", None),
                         isolated=bool(getattr(sopts, "bpf_compile_isolated", False)))
        try:
            clk.start()
        except CapabilityError as e:
            self.clock_error = str(e)
            log.warning("py-spy clock uprobe unavailable (%s); aligning by py-spy's start time, "
                        "which is off by milliseconds", e)
            return
        with self._lock:
            self.clock = clk

    def follow(self, pid: int) -> None:
        """Record ``pid`` (and, per the watch options, its descendants) from now on.

        Call from a thread that outlives the recording: a py-spy it starts dies with it.
        """
        with self._lock:
            self.watcher.follow(pid)
        self._kick()

    #: How often the loop ticks while py-spy has work (children to start, watch or stop).
    TICK_S = 0.05
    #: How often the threads of processes under py-spy are mapped while they run
    #: (:meth:`ThreadIds.track`: a listing of /proc/PID/task, and two syscalls per new thread).
    TRACK_S = 0.2

    def _kick(self) -> None:
        if self._wake_fd >= 0:
            with contextlib.suppress(OSError):
                os.eventfd_write(self._wake_fd, 1)

    def _wait(self) -> int:
        """Until a process event, a kick, or the next job: a py-spy tick while
        the supervisor has targets or a claim is undecided, else the watcher's next recheck or scan --
        with no Python process this thread wakes once per scan, not 20 times a second.

        Returns the nanoseconds it waited, at most the planned time (what
        is beyond is lag)."""
        with self._lock:
            # A process the walker has not decided on yet is asked again at each tick:
            # waiting for the watcher's next recheck (up to a second) held its py-spy back.
            idle = self.supervisor.idle() and not self._deferred
            timeout = self.watcher.next_due_s() if idle else self.TICK_S
            fds = [self._wake_fd] + ([self.watcher.fileno()] if self.watcher.fileno() >= 0 else [])
        t0 = self._now()
        try:
            ready = wait_readable(fds, timeout)
        except (OSError, ValueError):  # the connector closed meanwhile: tick as before
            self._stop.wait(self.TICK_S)
            ready = []
            timeout = self.TICK_S
        if self._wake_fd in ready:
            with contextlib.suppress(BlockingIOError):
                os.eventfd_read(self._wake_fd)
        return min(self._now() - t0, int(timeout * 1e9))

    def _loop(self) -> None:
        last = self._now()
        waited = 0
        while not self._stop.is_set():
            now = self._now()
            # How late this thread runs (GIL, CPU): py-spy starts and stops wait for it.
            # The planned wait is not lag: with no Python process it lasts until the next scan.
            self.loop_lag_max_ns = max(self.loop_lag_max_ns, now - last - waited)
            last = now
            with self._lock:
                self.watcher.poll(0)
                if self._deferred:
                    self._check_deferred()
                need_clock = not self._clock_tried and not self.supervisor.idle()
            if need_clock:
                # Before the first py-spy starts (the supervisor was told not to start
                # one until then, see _promote); outside the lock (it compiles).
                self._start_clock()
            with self._lock:
                runs = self.supervisor.tick()
                if runs:
                    self._add_runs(runs)
                if now >= self._next_track_ns:
                    self._next_track_ns = now + int(self.TRACK_S * 1e9)
                    self._track_threads(self.supervisor.pids())
                elif self._track_now:
                    self._track_threads(list(self._track_now))
            # The wait happens outside the lock so process() never waits long.
            waited = self._wait()
        with self._lock:
            self._add_runs(self.supervisor.close())
            self.watcher.close()

    def close(self) -> list[tuple[SampleEvent, Stack]]:
        """Stop py-spy children and the thread; returns every event still pending, joined."""
        self._stop.set()
        self._kick()
        if self._thread is not None:
            self._thread.join(timeout=self.options.pyspy.stop_timeout_s + 5)
            alive = self._thread.is_alive()
            self._thread = None
            if not alive and self._wake_fd >= 0:
                os.close(self._wake_fd)
                self._wake_fd = -1
        with self._lock:
            out = self._join(self._pending, final=True)
            self._pending = []
            # The sampler outlives this MixedMode on a reload: its timestamped
            # events for our processes would otherwise go on for nobody.
            if self.sampler is not None:
                for pid in list(self.processes):
                    self.sampler.unwatch(pid)
            self.processes.clear()
        if self.clock is not None:
            self.clock.close()
            self.clock = None
        return out

    # -- watcher callbacks (mixed thread) ---------------------------------
    def _pyspy_sampling(self, pyspy_pid: int) -> bool:
        return self.clock is not None and self.clock.has_hits(pyspy_pid)

    def _discarded(self, pyspy_pid: int) -> None:
        if self.clock is not None:
            self.clock.forget(pyspy_pid)

    def _spawned(self, pyspy_pid: int) -> None:
        if self.clock is not None:
            self.clock.track(pyspy_pid)

    #: How long a process the BPF sampler has not decided on waits before it gets py-spy.
    CLAIM_WAIT_S = 2.0

    def _started(self, proc: PyProcess) -> bool:
        claim: Claim = self._claim(proc.pid) if self._claim is not None else (False, "")
        d = decide(claim, fallback=self._pyspy_fallback, have_pyspy=self.supervisor.binary is not None)
        if d is None:
            self._deferred[proc.pid] = (proc, self._now())
            return True
        return self._apply(proc, d)

    MAX_DECIDED = 4096

    def _decide(self, pid: int, source: str, reason: str) -> None:
        self.sources[pid] = self.decided[pid] = (source, reason)
        if len(self.decided) > self.MAX_DECIDED:
            del self.decided[next(iter(self.decided))]

    def _check_deferred(self) -> None:
        now = self._now()
        for pid, (proc, since) in list(self._deferred.items()):
            assert self._claim is not None
            claim = self._claim(pid)
            if claim[0] is None and now - since < self.CLAIM_WAIT_S * 1e9:
                continue
            del self._deferred[pid]
            self._apply(proc, decide_late(claim, fallback=self._pyspy_fallback,
                                          have_pyspy=self.supervisor.binary is not None))

    def _apply(self, proc: PyProcess, d: Decision) -> bool:
        """Act on the source decided for ``proc`` (False: py-spy had no room for it)."""
        self._decide(proc.pid, d.source, d.reason)
        if d.source == "bpf":
            self.counters["processes_bpf"] += 1
            if self._on_process is not None:
                self._on_process(proc)
            return True
        if d.source == "none":
            if self._pyspy_fallback:
                # Wanted py-spy, found none: the process keeps native and kernel
                # stacks (counted by the sampler as usual); counted once per process.
                self.supervisor.failures[Failure.MISSING_BINARY.value] += 1
            return True
        if self.options.active_only:
            self.candidates[proc.pid] = proc
            return True
        return self._promote(proc)

    def _promote(self, proc: PyProcess) -> bool:
        # A py-spy started before the clock's uprobe is attached has its first
        # increment calls unseen, and the clock fit loses its anchor (the first
        # hit is then a later call): with the walker's refusal in between (policy
        # auto), the process is old enough for py-spy to start right here, while
        # the clock is yet to be compiled.  So py-spy waits for the loop's next
        # tick, which attaches the clock first.
        if not self.supervisor.add(proc.pid, started_ns=proc.seen_ns, start_now=self._clock_settled):
            return False  # the watcher counts it as left out and offers it again later
        self.processes[proc.pid] = proc
        if self.sampler is not None:
            self.sampler.watch(proc.pid)
        if self._on_process is not None:
            self._on_process(proc)
        return True

    def _exited(self, pid: int) -> None:
        self.sources.pop(pid, None)
        self._deferred.pop(pid, None)
        if pid in self.processes:  # only supervised ones can have a thread-id map
            self._gone.add(pid)
        self.candidates.pop(pid, None)
        self._idle.pop(pid, None)
        self.supervisor.remove(pid)
        self.processes.pop(pid, None)
        # The sampler keeps sending what is in flight; unwatching now only
        # stops new events, and the process is gone anyway.
        if self.sampler is not None:
            self.sampler.unwatch(pid)
        if self._on_exit_cb is not None:
            self._on_exit_cb(pid)

    def _new_thread(self, tgid: int) -> None:
        # (watcher callback, mixed thread) Mapped at this loop's turn, while the
        # thread surely runs: a thread of a request may live for milliseconds.
        if tgid in self.processes:
            self._track_now.add(tgid)

    def _track_threads(self, pids: list[int]) -> None:
        """Map the threads of the processes py-spy records while they run: its
        trace comes at the end of a run, when a process or thread that exited
        meanwhile can no longer be read (interpreters before 3.11 name pthread
        ids, and any in a PID namespace names that namespace's tids).  Every
        TRACK_S, and as soon as the proc connector says a thread started (then
        again at the next turns, TICK_S apart, while it is too new to map)."""
        self._track_now.clear()
        for pid in pids:
            proc = self.processes.get(pid)
            if proc is None:
                continue
            if proc.version is not None and _minor(proc.version) >= (3, 11):
                # Named by OS tid: only a PID namespace needs a map, which this learns.
                self.thread_ids.namespaced(pid)
                continue
            self.counters["threads_tracked"] += self.thread_ids.track(pid)
            if self.thread_ids.pending(pid):
                self._track_now.add(pid)

    def _add_runs(self, runs: list[CompletedRun]) -> None:
        if self.clock is not None and runs:
            self.clock.drain()
        for r in runs:
            if ((r.trace.pthread_ids or self.thread_ids.namespaced(r.pid))
                    and self.thread_ids.rekey(r.pid, r.trace) is not None):
                self.counters["runs_threads_unmapped"] += 1
            hits = self.clock.hits(r.pyspy_pid) if self.clock is not None else []
            reads = self.clock.reads(r.pyspy_pid) if self.clock is not None else []
            if self.clock is not None:
                self.clock.forget(r.pyspy_pid)
            fit = fit_clock(r.trace, hits, spawn_ns=r.spawn_ns, interval_ns=r.interval_ns)
            self.counters["runs_calibrated" if fit.calibrated else "runs_uncalibrated"] += 1
            if hits and not fit.calibrated:
                self.counters["runs_clock_unmatched"] += 1  # hits, but no offset pairs them with the changes
            samples = sample_times(hits, r.interval_ns)
            observed = observed_times(samples, reads, r.interval_ns) if reads else None
            if observed is not None:
                self.counters["runs_read_times"] += 1
            aligned = align_trace(r.pid, r.trace, fit, samples, r.interval_ns, observed, hits)
            self._traces.append(aligned)
            log.debug("py-spy %d on pid %d: %s..%s, %d threads, %d samples, clock %s: %d hits from %+.1f ms "
                      "after the spawn, %d of %d changes matched, %+.1f us from the first hit's anchor",
                      r.pyspy_pid, r.pid, aligned.start_ns, aligned.end_ns, len(aligned.threads), len(samples),
                      "uprobe" if fit.calibrated else "guess", len(hits),
                      (hits[0] - r.spawn_ns) / 1e6 if hits else 0.0, fit.matched, fit.expected,
                      (fit.start_ns - fit.anchor_ns) / 1e3 if hits else 0.0)

        busy = self.supervisor.busy_pids() | set(self.supervisor.pids())
        for pid in [p for p in self._gone if p not in busy]:
            self._gone.discard(pid)
            self.thread_ids.forget(pid)

    def observe(self, window: Window) -> None:
        """With ``active_only``: promote candidates the window saw on a CPU, demote idle ones.

        Call with each drained window before :meth:`process` (the daemon's
        processor does), from a long-lived thread.
        """
        if not self.options.active_only:
            return
        with self._lock:
            seen = {tgid: n for tgid, n in weight_by_tgid(window.counts).items() if tgid in self.candidates}
            # A candidate the sampler still watches (for a MixedMode this one
            # replaced, or one that raced it) has its samples as events.
            for ev in window.events:
                if ev.tgid in self.candidates:
                    seen[ev.tgid] = seen.get(ev.tgid, 0) + 1
            for tgid, n in sorted(seen.items()):
                if n >= self.options.active_min_samples:
                    proc = self.candidates.pop(tgid)
                    if self._promote(proc):
                        self._kick()  # the supervisor has a py-spy to start: tick now
                        self.counters["promoted"] += 1
                        self._idle[tgid] = 0
                    else:
                        self.candidates[tgid] = proc
            active = {ev.tgid for ev in window.events}
            for pid in list(self.processes):
                if pid in active:
                    self._idle[pid] = 0
                    continue
                self._idle[pid] = self._idle.get(pid, 0) + 1
                if self._idle[pid] >= self.options.idle_windows:
                    proc = self.processes.pop(pid)
                    self.supervisor.remove(pid)
                    if self.sampler is not None:
                        self.sampler.unwatch(pid)
                    self._idle.pop(pid, None)
                    self.candidates[pid] = proc
                    self.counters["demoted"] += 1

    # -- the join ---------------------------------------------------------
    def process(self, events: list[SampleEvent]) -> list[tuple[SampleEvent, Stack]]:
        """Queue ``events``; return the queued ones whose Python stacks are known now."""
        with self._lock:
            self._pending.extend(events)
            if not self._pending:
                return []
            now = self._now()
            ready: list[SampleEvent] = []
            keep: list[SampleEvent] = []
            ends: dict[int, int] = {}
            for t in self._traces:
                ends[t.pid] = max(ends.get(t.pid, 0), t.end_ns)
            supervised = set(self.supervisor.pids()) | self.supervisor.busy_pids()
            for ev in self._pending:
                if (ev.ktime_ns <= ends.get(ev.tgid, -1) or ev.tgid not in supervised
                        or now - ev.ktime_ns > self.options.delay_ns):
                    ready.append(ev)
                else:
                    keep.append(ev)
            self._pending = keep
            out = self._join(ready, final=False)
            # Traces older than anything that can still arrive are dropped.
            horizon = now - self.options.delay_ns - int(self.options.pyspy.window_s * 1e9)
            self._traces = [t for t in self._traces if t.end_ns >= horizon]
            return out

    def _join(self, events: list[SampleEvent], final: bool) -> list[tuple[SampleEvent, Stack]]:
        if not events:
            return []
        events.sort(key=lambda e: e.ktime_ns)
        stacks, stats = join_events(events, self._traces, self.options.join)
        self.stats.add(stats)
        return list(zip(events, stacks))

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def metrics(self) -> dict[str, int]:
        with self._lock:
            m = {f"pyspy_{k}": v for k, v in self.supervisor.metrics().items()}
            m.update({f"watcher_{k}": v for k, v in self.watcher.metrics().items()})
            for k, v in vars(self.stats).items():
                m[f"join_{k}"] = v
            m.update({k: v for k, v in self.counters.items()})
            m["pending_events"] = len(self._pending)
            m["pthread_ids_mapped"] = self.thread_ids.counters["mapped"]
            m["pthread_ids_unmapped"] = self.thread_ids.counters["unmapped"]
            m["candidates"] = len(self.candidates)
            for src, why in self.sources.values():
                k = f"source_{src}:{why}"
                m[k] = m.get(k, 0) + 1
            m["loop_lag_max_ms"] = self.loop_lag_max_ns // 1_000_000
            if self.clock is not None:
                for k, v in self.clock.stats().items():
                    m[f"clock_hits_{k}"] = v
            return m


def _minor(version: str) -> tuple[int, int]:
    """``"3.11"`` -> (3, 11); (0, 0) when it does not read as one (``"3"``, of a ``python3`` executable)."""
    try:
        major, minor = version.split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return 0, 0
