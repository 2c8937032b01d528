"""The main loop: drains on a wall-clock grid and hands each window on.

Runs in the one thread that gets signals, and owns what that thread alone
touches: the sampler, the window processors and the push queue.

* every ``drain_interval`` (on a wall-clock grid, so files start on round
  times) drain the sampler into a :class:`~flamed.sampling.contract.Window`, run the
  window processors, count leftover events, and store the window in the
  ring (snapshots), the push queue and the current rotation period (files);
* when the period reaches its boundary, close it into a file;
* between drains, sleep on an event that signals, snapshot and flush requests
  set, and ping the systemd watchdog at half its period.

Other threads only *ask* (:meth:`DrainLoop.request_drain`,
:meth:`DrainLoop.request_flush`...) and wait; they never touch the sampler
or the files themselves, so a slow client cannot delay a drain.
"""

from __future__ import annotations

import logging
import math
import os
import select
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from flamed.daemon.config import DaemonConfig
from flamed.daemon.logs import logs_past_fd2
from flamed.daemon.losses import LossAdvisor, placeholder_stacks
from flamed.daemon.metrics import DaemonMetrics
from flamed.daemon.notify import Notifier, watchdog_interval
from flamed.daemon.processors import WindowProcessor
from flamed.daemon.pyroscope import Pusher
from flamed.daemon.ring import RingWindow, WindowRing
from flamed.daemon.sampler_stats import SamplerAccounting
from flamed.daemon.store import ProfileStore
from flamed.errors import FlamedError
from flamed.sampling.contract import CountKey, Sampler, Window
from flamed.sampling.memory import trim_heap

log = logging.getLogger("flamed.daemon")

#: Snapshots may force a drain, but not more often than this (seconds).
MIN_DRAIN_SPACING = 0.2
#: How long a request waits for the main loop to drain or flush.
LOOP_WAIT_TIMEOUT = 60.0

_FlushWaiter = tuple[threading.Event, list[str | None]]


def detach(sampler: Sampler, context: str) -> None:
    """Stop ``sampler`` taking samples while its maps stay readable (if it can; a failure only warns)."""
    stop = getattr(sampler, "stop", None)
    if callable(stop):
        try:
            stop()
        except Exception as e:
            log.warning("%s: %s", context, e)


class Wakeup:
    """What the loop sleeps on between drains: an eventfd, where a
    :class:`threading.Event` was.  Signal handlers set it, and a Python signal
    handler runs in the main thread between any two bytecodes, the loop's own
    sleep included: an ``Event.set()`` there, landing while the loop held the
    Event's lock (entering or leaving its wait, or clearing it), waited on that
    lock forever, and the daemon stopped draining (a burst of SIGHUPs hung it
    within a few hundred).  Writing to an eventfd takes no Python lock."""

    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        weakref.finalize(self, os.close, self.fd)
        # poll, not select: on a host with hundreds of CPUs the perf events' fds
        # can take this one past select's 1,024.
        self._poll = select.poll()
        self._poll.register(self.fd, select.POLLIN)

    def set(self) -> None:
        """Wake the loop (any thread, or a signal handler)."""
        try:
            os.eventfd_write(self.fd, 1)
        except OSError:
            pass  # the counter at its maximum is set all the same

    def wait(self, timeout: float) -> bool:
        """Sleep up to ``timeout`` seconds unless set; was it set?  (One thread waits: the loop's.)"""
        return bool(self._poll.poll(max(0, math.ceil(timeout * 1000))))

    def clear(self) -> None:
        try:
            os.eventfd_read(self.fd)
        except BlockingIOError:
            pass


class DrainLoop:
    def __init__(self, config: DaemonConfig, *, store: ProfileStore, ring: WindowRing, metrics: DaemonMetrics,
                 notifier: Notifier, clock_ns: Callable[[], int]) -> None:
        self.config = config  # the running configuration: a reload replaces it
        self.store = store
        self.ring = ring
        self.metrics = metrics
        self.notifier = notifier
        self.clock_ns = clock_ns
        self.sampler: Sampler | None = None
        self.processors: list[WindowProcessor] = []
        self.pusher: Pusher | None = None
        self.sampler_stats = SamplerAccounting(metrics)
        self._wake = Wakeup()
        self._lock = threading.Lock()
        self._stop = False
        self._stop_reason = ""
        self._reload = False
        self._drain_wanted = False
        self._flush_waiters: list[_FlushWaiter] = []
        self.last_drain_ns = 0
        self.last_drain_seconds = 0.0
        # The loop's schedule (run() sets them; a reload's wait for a new sampler serves on them).
        self._wd: float | None = None
        self._next_ping = 0.0
        self._next_drain = 0
        self.totals = {"windows": 0, "samples": 0, "weight": 0}
        self.lost_totals: dict[str, int] = {}
        self._losses = LossAdvisor()

    # -- requests from other threads and signal handlers -----------------
    def request_stop(self, reason: str = "") -> None:
        """Stop after the drain under way (any thread, or a signal handler: ``reason``
        names the signal, logged by the loop)."""
        self._stop_reason = self._stop_reason or reason
        self._stop = True
        self._wake.set()

    @property
    def stop_requested(self) -> bool:
        return self._stop

    def request_reload(self) -> None:
        self._reload = True
        self._wake.set()

    def request_drain(self) -> None:
        self._drain_wanted = True
        self._wake.set()

    def request_flush(self, timeout: float = LOOP_WAIT_TIMEOUT) -> str | None:
        """Close the current period into a file now; returns its path (None if nothing to write)."""
        ev = threading.Event()
        holder: list[str | None] = [None]
        with self._lock:
            self._flush_waiters.append((ev, holder))
        self._wake.set()
        if not ev.wait(timeout):
            raise FlamedError(f"the daemon did not flush within {timeout:g} s")
        return holder[0]

    def answer_late_flushes(self) -> None:
        """Flush requests that came in while stopping: the last rotation answered them."""
        with self._lock:
            waiters, self._flush_waiters = self._flush_waiters, []
        for ev, holder in waiters:
            holder[0] = self.store.last_written
            ev.set()

    # -- the loop --------------------------------------------------------
    def run(self, reload: Callable[[], None]) -> None:
        """Drain until a stop is requested; ``reload`` runs here, between drains, when one is asked for."""
        self._wd = watchdog_interval()
        self._next_ping = time.monotonic()
        self._next_drain = self._next_grid(self.clock_ns())
        while True:
            self._ping()
            if self._stop:
                if self._stop_reason:
                    log.info("%s: draining and writing the last window", self._stop_reason)
                return
            if self._reload:
                self._reload = False
                reload()
                self._next_drain = self._next_grid(self.clock_ns())
            self._serve_once()

    def _ping(self) -> None:
        now_mono = time.monotonic()
        if self._wd is not None and now_mono >= self._next_ping:
            self.notifier.watchdog()
            self._next_ping = now_mono + self._wd

    def _serve_once(self) -> None:
        """One turn of the loop: the drain (and flushes) due now, then sleep until the next is due."""
        now = self.clock_ns()
        if self._next_drain - now > self._step_ns():
            # The wall clock went back (an NTP step, date -s): the grid point
            # planned before would be that far away, with no drain meanwhile.
            log.warning("the wall clock went back %.3f s; drains follow it", (self._next_drain - now) / 1e9
                        - self.config.sampling.drain_interval)
            self._next_drain = self._next_grid(now)
        with self._lock:
            flushes = self._flush_waiters
            self._flush_waiters = []
        scheduled = now >= self._next_drain
        forced = bool(flushes) or (
            self._drain_wanted and now - self.last_drain_ns >= MIN_DRAIN_SPACING * 1e9
        )
        if scheduled or forced:
            self._drain_wanted = False
            if scheduled:
                self.metrics.drain_lateness.observe(max(0, now - self._next_drain) / 1e9)
            written_before = self.store.files_written
            self.drain_once(rotate_now=bool(flushes))
            if scheduled:
                self._next_drain = self._next_grid(self.clock_ns())
            for ev, holder in flushes:
                # None when this flush wrote nothing (e.g. the disk refuses writes)
                holder[0] = self.store.last_written if self.store.files_written != written_before else None
                ev.set()
        wait = (self._next_drain - self.clock_ns()) / 1e9
        if self._drain_wanted:
            wait = min(wait, MIN_DRAIN_SPACING)
        if self._wd is not None:
            wait = min(wait, self._next_ping - time.monotonic())
        self._wake.wait(max(0.0, wait))
        self._wake.clear()

    def _step_ns(self) -> int:
        return int(self.config.sampling.drain_interval * 1e9)

    def _next_grid(self, now_ns: int) -> int:
        step = self._step_ns()
        return (now_ns // step + 1) * step

    # -- windows ---------------------------------------------------------
    def drain_once(self, *, rotate_now: bool = False, final: bool = False, close_waits: bool = False) -> None:
        assert self.sampler is not None
        self.store.check_dir()  # removed under us: made again and locked again before another daemon takes it
        t0 = time.perf_counter()
        try:
            window = self._drain(close_waits=final or close_waits)
        except Exception as e:
            # A failed drain loses nothing yet (the sampler keeps counting); report and retry next time.
            self.metrics.drain_errors.inc()
            log.error("drain failed: %s", e, exc_info=not isinstance(e, FlamedError))
            if rotate_now:
                self.store.rotate()
            return
        self._take_window(window, time.perf_counter() - t0, final=final)
        if rotate_now or self.store.due(window.end_ns, self._next_grid(window.end_ns)):
            self.store.rotate()
        elif self.store.backlog:
            self.store.write_pending()
        # The drain's transient objects are gone, and the text of a file just
        # written: their pages back to the kernel.  (Trimmed before the
        # rotation, the file's ~60 MB at 100 k distinct stacks stayed
        # resident until the next drain: docs/bpf.md, "... the trim after the file".)
        trim_heap()
        self.notifier.status(self.status_line())

    def _take_window(self, window: Window, drain_seconds: float, *, final: bool = False) -> None:
        """Hand a drained window on: processors, the ring, the file being filled, the pusher.

        ``drain_seconds``: the drain's time so far; what is done here (packing
        the window for the ring, mostly) is added to it in the drain histogram."""
        t_in = time.perf_counter()
        m = self.metrics
        # Beyond the Sampler protocol: BpfSampler.stats() tells how the drain went.
        stats_fn = getattr(self.sampler, "stats", None)
        if callable(stats_fn):
            try:
                self.sampler_stats.take(stats_fn())
            except (AttributeError, TypeError, ValueError):
                pass
            self._warn_full_maps(window)
        for p in self.processors:
            try:
                if final:
                    p.finish(window)  # the last window: everything still pending goes in
                else:
                    p.process(window)
            except Exception:
                m.processor_errors.labels(processor=p.name).inc()
                log.exception("window processor %s failed; its events are kept as native stacks", p.name)
        counts = window.counts
        # Events nobody claimed keep their native and kernel frames: nothing is dropped.
        for ev in window.events:
            key: CountKey = (ev.tgid, ev.tid, ev.comm, ev.user_stack + ev.kernel_stack)
            counts[key] = counts.get(key, 0) + 1
        window.events = []
        self.last_drain_ns = window.end_ns
        m.drains.inc()
        m.samples.inc(window.samples)
        m.observe_lost(window.lost)
        self._warn_losses(window, counts)
        m.unique_stacks.set(len(counts))
        m.window_seconds.set((window.end_ns - window.start_ns) / 1e9)
        self.totals["windows"] += 1
        self.totals["samples"] += window.samples
        self.totals["weight"] += sum(counts.values())
        for r, n in window.lost.items():
            self.lost_totals[r] = self.lost_totals.get(r, 0) + n
        rw = RingWindow(window.start_ns, window.end_ns, counts, window.samples, dict(window.lost),
                        window.sample_rate, identities=window.identities)
        off: RingWindow | None = None
        if self.offcpu_enabled():
            # Off-CPU time (ns) of the same window: a ring window, a push and a file of its own kind.
            offcpu = dict(getattr(window, "offcpu", {}) or {})
            off = RingWindow(window.start_ns, window.end_ns, offcpu, 0, {}, None,
                             identities=window.identities, kind="offcpu")
            ns = sum(offcpu.values())
            self.totals["offcpu_ns"] = self.totals.get("offcpu_ns", 0) + ns
            m.offcpu_seconds.inc(ns / 1e9)
        # Packed once (flamed/daemon/ring.py): the ring, the file being filled and the pusher share them.
        rw = self.ring.pack(rw)
        if off is not None:
            off = self.ring.pack(off)
            self.ring.add(rw, off)
        else:
            self.ring.add(rw)
        if self.pusher is not None:
            self.pusher.submit(rw)  # a deque append: the network is the pusher thread's
            if off is not None:
                self.pusher.submit(off)
        self.store.add(window.start_ns, window.end_ns, rw.counts, window.samples, window.lost, window.sample_rate,
                       window.identities)
        if off is not None:
            self.store.add_offcpu(window.start_ns, window.end_ns, off.counts, window.identities)
        # The drain's own keys are garbage now: only the packed copies stay.
        window.counts = {}
        window.offcpu = {}
        self.last_drain_seconds = drain_seconds + (time.perf_counter() - t_in)
        m.drain_duration.observe(self.last_drain_seconds)
        _, ns = self.ring.stats()
        by_kind = self.ring.windows_by_kind()
        if self.offcpu_enabled():
            by_kind.setdefault("offcpu", 0)
        for kind, n in by_kind.items():
            m.ring_windows.labels(kind=kind).set(n)
        m.ring_stacks.set(ns)

    def _warn_full_maps(self, window: Window) -> None:
        """Name the setting of a program map found full (Python or unwound stacks lost)."""
        full = self.sampler_stats.new_full
        if not full:
            return
        sc = self.config.sampling
        settings = {"sampling.python_stack_map_size": sc.python_stack_map_size,
                    "sampling.unwind_stack_map_size": sc.unwind_stack_map_size}
        # The Python walker also runs at each switch off the CPU (off-CPU time on): its
        # map's losses are a share of all its walks, not of the samples alone.
        walks = self.sampler_stats.new_full_of if self.offcpu_enabled() else None
        for advice in self._losses.advise_maps(full, window.samples, settings, walks=walks):
            log.log(advice.level, "%s", advice.message)

    def _warn_losses(self, window: Window, counts: Mapping[CountKey, int]) -> None:
        """Say what the window lost and only what would cure it (flamed/daemon/losses.py)."""
        # Off-CPU waits take their stacks from the same stack map (bpf/offcpu.bpf.c): the
        # recorded ones' losses are their own (offcpu_lost), their placeholders in their own counts.
        offcpu = self.offcpu_enabled()
        lost = dict(window.lost)
        if offcpu:
            for r, n in (getattr(window, "offcpu_lost", None) or {}).items():
                lost[r] = lost.get(r, 0) + n
        if not any(lost.get(r, 0) for r in ("map_full", "kernel_stack_enomem", "user_stack_enomem",
                                            "kernel_stack_eexist", "user_stack_eexist")):
            return
        off: Mapping[CountKey, int] = (getattr(window, "offcpu", None) or {}) if offcpu else {}
        stacks = placeholder_stacks(key[3] for part in (counts, off) for key in part)
        settings = {"sampling.counts_map_size": self.config.sampling.counts_map_size,
                    "sampling.stack_map_size": self.config.sampling.stack_map_size}
        waits = (self.sampler_stats.new_offcpu_waits or 0) if offcpu else None
        for advice in self._losses.advise(window.samples, lost, stacks, settings, offcpu_waits=waits):
            log.log(advice.level, "%s", advice.message)

    def offcpu_enabled(self) -> bool:
        """Does the running sampler measure off-CPU time ([sampling] off_cpu with the BPF sampler)?"""
        opts = getattr(self.sampler, "options", None)
        return bool(getattr(opts, "offcpu", False))

    def _drain(self, *, close_waits: bool = False) -> Window:
        """One drain; ``close_waits`` (the sampler's last): off-CPU waits still open are counted up to now."""
        assert self.sampler is not None
        # The BPF sampler numbers its windows' stacks straight into the ring's
        # table (flamed/sampling/packed.py); any sampler may be new since the last drain.
        number_into = getattr(self.sampler, "number_into", None)
        if callable(number_into):
            number_into(self.ring)
        if close_waits and self.offcpu_enabled():
            drain: Any = self.sampler.drain
            return drain(close_waits=True)  # type: ignore[no-any-return]
        return self.sampler.drain()

    # -- the sampler -----------------------------------------------------
    def prepare_sampler(self, fresh: Sampler) -> None:
        """Compile and load ``fresh`` (its ``prepare()``, if it has one) in a thread of its own
        while this loop keeps draining the running sampler on its grid: windows, files,
        flushes and snapshots go on during a reload's compile, which takes seconds (tens
        of seconds on a loaded host).  Raises what the preparation raised."""
        prepare = getattr(fresh, "prepare", None)
        if not callable(prepare):
            return
        if self.sampler is None or self._next_drain == 0:
            prepare()  # no loop running yet (start-up, a test): nothing to keep draining
            return
        done = threading.Event()
        failed: list[BaseException] = []

        def run() -> None:
            try:
                prepare()
            except BaseException as e:  # handed to the loop's thread below
                failed.append(e)
            finally:
                done.set()
                self._wake.set()

        t0 = time.monotonic()
        drains = self.totals["windows"]
        with logs_past_fd2():  # the load captures fd 2 meanwhile: the drains' log lines go past it
            t = threading.Thread(target=run, name="flamed-reload-prepare", daemon=True)
            t.start()
            while not done.is_set():
                self._ping()
                self._serve_once()
            t.join()
        log.info("reload: the new sampler was ready after %.2f s; the old one drained meanwhile (%d drains)",
                 time.monotonic() - t0, self.totals["windows"] - drains)
        if failed:
            raise failed[0]

    def replace_sampler(self, fresh: Sampler) -> None:
        """Hand over to ``fresh`` (started): the old sampler's last window goes into the current period."""
        assert self.sampler is not None
        # Detach the old program at once (its maps stay readable), so the two
        # sample together only for the moment between attach and detach.
        detach(self.sampler, "reload: stopping the old sampler")
        self.drain_once(close_waits=True)
        retired = self.bpf_samples_total(live=True)
        self.sampler.close()
        self.sampler = fresh
        self.sampler_stats.sampler_replaced(retired)
        for p in self.processors:
            p.sampler_changed(fresh)

    def bpf_samples_total(self, *, live: bool = False) -> int | None:
        """Samples the BPF program(s) counted since start (its never-reset counter), if the sampler tells.

        ``live`` asks the sampler (main thread only: it waits for a running
        drain); otherwise the figure as of the last drain.
        """
        st: Any = self.sampler_stats.last
        if live:
            stats_fn = getattr(self.sampler, "stats", None)
            st = stats_fn() if callable(stats_fn) else None
        return self.sampler_stats.bpf_samples_total(st)

    def status_line(self) -> str:
        return (f"{self.totals['samples']} samples in {self.totals['windows']} windows; "
                f"{self.store.files_written} files written"
                + (f"; WRITE ERROR: {self.store.last_error}" if self.store.last_error else ""))
