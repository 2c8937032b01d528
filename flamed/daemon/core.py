"""The daemon: a drain loop in the main thread, control and metrics in threads.

Main loop (one thread, the one that gets signals):

* every ``drain_interval`` (on a wall-clock grid, so files start on round
  times) drain the sampler into a :class:`~flamed.sampling.contract.Window`, run the
  window processors, count leftover events, and store the window in the
  ring (snapshots) and the current rotation period (files);
* when the period reaches its boundary, close it into a file;
* between drains, sleep on an event that signals, snapshot and flush requests
  set, and ping the systemd watchdog at half its period.

Control-socket threads only *ask* the loop for a drain or a flush and wait
for the ring; they never touch the sampler or the files themselves, so a
slow client cannot delay a drain.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from types import FrameType
from typing import Any

from flamed import __version__
from flamed import outputs
from flamed.daemon.config import DaemonConfig, load_config
from flamed.daemon.control import ControlServer, Peer
from flamed.daemon.fleet import windows_pprof
from flamed.daemon.logs import setup_logging
from flamed.daemon.losses import LossAdvisor, placeholder_stacks
from flamed.daemon.metrics import DaemonMetrics, MetricsServer
from flamed.daemon.notify import Notifier, watchdog_interval
from flamed.daemon.pyroscope import Pusher, Target
from flamed.daemon.processors import ProcessorContext, WindowProcessor, processor_options
from flamed.daemon.protocol import (
    ProtocolError,
    SnapshotFilter,
    SnapshotRequest,
    encode_header,
    error_header,
    parse_request,
)
from flamed.daemon.ring import RingWindow, WindowRing
from flamed.daemon.samplers import make_sampler
from flamed.daemon.statelock import StateDirLock
from flamed.daemon.store import ProfileStore
from flamed.errors import ConfigError, FlamedError
from flamed.outputs import OutputOptions
from flamed.sampling.contract import CountKey, Sampler, Window, counts_to_profile

log = logging.getLogger("flamed.daemon")

SamplerFactory = Callable[[DaemonConfig], Sampler]
#: Snapshots may force a drain, but not more often than this (seconds).
MIN_DRAIN_SPACING = 0.2
#: How long a request waits for the main loop to drain or flush.
LOOP_WAIT_TIMEOUT = 60.0


def _default_factory(cfg: DaemonConfig) -> Sampler:
    return make_sampler(cfg.sampling, cfg.output.state_dir)


class Daemon:
    def __init__(
        self,
        config: DaemonConfig,
        *,
        config_path: str | None = None,
        overrides: Mapping[str, Any] | None = None,
        sampler_factory: SamplerFactory = _default_factory,
        clock_ns: Callable[[], int] = time.time_ns,
        notifier: Notifier | None = None,
        listen_fd: int | None = None,
        manage_logging: bool = False,
        processor_classes: list[type[WindowProcessor]] | None = None,
        on_ready: Callable[[Daemon], None] | None = None,
    ) -> None:
        self.config = config
        self.config_path = config_path
        self.overrides = dict(overrides or {})
        self.sampler_factory = sampler_factory
        self.clock_ns = clock_ns
        self.notifier = notifier if notifier is not None else Notifier()
        self.manage_logging = manage_logging
        # None: the processors discovered in flamed/daemon/processors/ (tests pass their own).
        self.processor_classes = processor_classes
        self.on_ready = on_ready  # called once everything is up (the CLI prints the client commands)
        self.metrics = DaemonMetrics()
        self.registry = self.metrics.registry
        self.ring = WindowRing(config.snapshot.ring_seconds, config.snapshot.ring_max_stacks, clock_ns=clock_ns)
        self.store = ProfileStore(config.output, config.retention, self.metrics, clock_ns=clock_ns)
        self.state_lock = StateDirLock(self.store.dir)
        self.metrics_server = MetricsServer(self.registry, self.metrics, self.pprof_profile)
        self.metrics_server.configure(config.metrics)
        self.control = ControlServer(config.control, self.handle_request, self.metrics, listen_fd=listen_fd)
        self.pusher: Pusher | None = None
        self.sampler: Sampler | None = None
        self.processors: list[WindowProcessor] = []
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._stop = False
        self._reload = False
        self._drain_wanted = False
        self._flush_waiters: list[tuple[threading.Event, list[str | None]]] = []
        self.stopping = threading.Event()
        self.ready = threading.Event()
        self.started_ns = 0
        self.last_drain_ns = 0
        self.totals = {"windows": 0, "samples": 0, "weight": 0}
        self.lost_totals: dict[str, int] = {}
        self.last_drain_seconds = 0.0
        self._losses = LossAdvisor()
        self._bpf_retired = 0  # BPF samples counted by samplers replaced on reload
        self._sampler_stats: Any = None  # the sampler's stats() as of the last drain
        self._primed_seen: dict[str, int] = {}  # the sampler's priming totals already counted

    # -- requests from other threads and signal handlers -----------------
    def request_stop(self) -> None:
        self._stop = True
        self._wake.set()

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

    def install_signals(self) -> None:
        def on_stop(signum: int, frame: FrameType | None) -> None:
            log.info("%s: draining and writing the last window", signal.Signals(signum).name)
            self.request_stop()

        def on_hup(signum: int, frame: FrameType | None) -> None:
            self.request_reload()

        signal.signal(signal.SIGTERM, on_stop)
        signal.signal(signal.SIGINT, on_stop)
        signal.signal(signal.SIGHUP, on_hup)

    # -- lifecycle -------------------------------------------------------
    def start(self) -> None:
        """Everything up to READY; raises FlamedError (CapabilityError...) when it cannot run."""
        cfg = self.config
        self.started_ns = self.clock_ns()
        self.metrics.up_since.set(self.started_ns / 1e9)
        try:
            self.store.ensure_dir()
        except OSError as e:
            raise FlamedError(f"cannot create state directory {self.store.dir}: {e.strerror}; "
                              "set output.state_dir or --state-dir to a writable directory") from None
        # Every value is checked before anything compiles (the BPF program takes
        # seconds): a bad [processors.*] value is a config error (exit 2) at once.
        procs = self._processor_options(cfg)
        # Before recovery: it deletes temp files and sidecars another daemon may be writing.
        self.state_lock.acquire()
        try:
            self.store.recover()
            self.store.apply_retention()
            self.sampler = self.sampler_factory(cfg)
            self.sampler.start()
        except BaseException:
            self.state_lock.release()
            raise
        try:
            self._start_processors(cfg, procs)
            _release_heap()  # after every compile (sampler, Python clock)
            try:
                self.metrics_server.start(cfg.metrics.address)
            except OSError as e:
                raise FlamedError(f"cannot serve metrics on {cfg.metrics.address}: {e.strerror}; "
                                  "set metrics.address (or --metrics-address) to a free HOST:PORT, "
                                  "or to \"\" to disable") from None
            self.control.start()
            if cfg.pyroscope.server_address:
                self.pusher = Pusher(cfg.pyroscope, self.metrics, host=self.store.host,
                                     root=cfg.output.root_frame)
        except BaseException:
            self._close_all()
            raise
        self.last_drain_ns = self.started_ns
        self.ready.set()
        self.notifier.ready(self._status_line())
        log.info("flamed %s sampling at %d Hz, drain every %g s, files every %g s in %s",
                 __version__, cfg.sampling.frequency, cfg.sampling.drain_interval,
                 cfg.output.rotate_interval, self.store.dir)
        if self.on_ready is not None:
            self.on_ready(self)

    def run(self) -> int:
        """Start, loop until stopped, write everything, return the exit code."""
        self.start()
        try:
            self._loop()
        finally:
            self._shutdown()
        return 0

    def _loop(self) -> None:
        wd = watchdog_interval()
        next_ping = time.monotonic()
        next_drain = self._next_grid(self.clock_ns())
        while True:
            now_mono = time.monotonic()
            if wd is not None and now_mono >= next_ping:
                self.notifier.watchdog()
                next_ping = now_mono + wd
            if self._stop:
                return
            if self._reload:
                self._reload = False
                self._do_reload()
                next_drain = self._next_grid(self.clock_ns())
            now = self.clock_ns()
            with self._lock:
                flushes = self._flush_waiters
                self._flush_waiters = []
            scheduled = now >= next_drain
            forced = bool(flushes) or (
                self._drain_wanted and now - self.last_drain_ns >= MIN_DRAIN_SPACING * 1e9
            )
            if scheduled or forced:
                self._drain_wanted = False
                if scheduled:
                    self.metrics.drain_lateness.observe(max(0, now - next_drain) / 1e9)
                written_before = self.store.files_written
                self._drain_once(rotate_now=bool(flushes))
                if scheduled:
                    next_drain = self._next_grid(self.clock_ns())
                for ev, holder in flushes:
                    # None when this flush wrote nothing (e.g. the disk refuses writes)
                    holder[0] = self.store.last_written if self.store.files_written != written_before else None
                    ev.set()
            wait = (next_drain - self.clock_ns()) / 1e9
            if self._drain_wanted:
                wait = min(wait, MIN_DRAIN_SPACING)
            if wd is not None:
                wait = min(wait, next_ping - time.monotonic())
            self._wake.wait(max(0.0, wait))
            self._wake.clear()

    def _next_grid(self, now_ns: int) -> int:
        step = int(self.config.sampling.drain_interval * 1e9)
        return (now_ns // step + 1) * step

    def _shutdown(self) -> None:
        self.stopping.set()
        self.notifier.stopping()
        try:
            if self.sampler is not None:
                stop = getattr(self.sampler, "stop", None)
                if callable(stop):
                    # Detach first, keep the maps: the last drain then holds every sample up to now.
                    try:
                        stop()
                    except Exception as e:
                        log.warning("stopping the sampler: %s", e)
                self._drain_once(rotate_now=True, final=True)
                self._log_stop_accounting()
            if self.store.backlog:
                log.error("exiting with %d profile file(s) (%d bytes) that could not be written: %s",
                          len(self.store.backlog), self.store.backlog_bytes, self.store.last_error)
        finally:
            # Flush requests that came in while stopping: the last rotation above answered them.
            with self._lock:
                waiters, self._flush_waiters = self._flush_waiters, []
            for ev, holder in waiters:
                holder[0] = self.store.last_written
                ev.set()
            self.ring.wake_all()
            self._close_all()
            log.info("stopped")

    def _log_stop_accounting(self) -> None:
        """Compare what the BPF program counted with what went into the windows' counts.

        The windows' sample counters are not the check: an event a processor
        holds back (a Python sample waiting for its py-spy trace) is counted in
        the window it arrived in but written in a later one, or never.  So the
        written side is the windows' weight, plus the samples the program
        counted but could not key (map_full, reported as lost).
        """
        bpf = self.bpf_samples_total(live=True)
        if bpf is None:
            return
        written = self.totals["weight"]
        unkeyed = self.lost_totals.get("map_full", 0)
        # The fault tests compare these with the files' weights and sidecar sample counts.
        log.info("stopping: the BPF program counted %d samples since start; %d went into windows "
                 "(%d written, %d lost for want of room in the counts map)", bpf, written + unkeyed, written,
                 unkeyed)
        missing = bpf - written - unkeyed
        if missing:
            log.warning("stopping: %d of the %d samples the BPF program counted are not in the windows "
                        "(%s); this is a bug, please report it with this log", abs(missing), bpf,
                        "missing" if missing > 0 else "more written than counted")

    def _close_all(self) -> None:
        self.control.stop()
        for p in self.processors:
            try:
                p.close()
            except Exception:
                log.exception("processor %s failed to close", p.name)
        self.processors = []
        if self.sampler is not None:
            self.sampler.close()
        if self.pusher is not None:
            # The last window was just queued: give it a moment to reach the server.
            self.pusher.stop(min(self.config.pyroscope.timeout, 5.0))
            self.pusher = None
        self.metrics_server.stop()
        # Last: everything that writes into the state directory is done.
        self.state_lock.release()

    # -- drain -----------------------------------------------------------
    def _drain_once(self, *, rotate_now: bool = False, final: bool = False) -> None:
        assert self.sampler is not None
        t0 = time.perf_counter()
        try:
            window = self.sampler.drain()
        except Exception as e:
            # A failed drain loses nothing yet (the sampler keeps counting); report and retry next time.
            self.metrics.drain_errors.inc()
            log.error("drain failed: %s", e, exc_info=not isinstance(e, FlamedError))
            if rotate_now:
                self.store.rotate()
            return
        self._take_window(window, time.perf_counter() - t0, final=final)
        if rotate_now or self.store.due(window.end_ns, int(self.config.sampling.drain_interval * 0.5e9)):
            self.store.rotate()
        elif self.store.backlog:
            self.store.write_pending()
        self.notifier.status(self._status_line())

    def _take_window(self, window: Window, drain_seconds: float, *, final: bool = False) -> None:
        m = self.metrics
        # Beyond the Sampler protocol: BpfSampler.stats() tells how the drain went.
        stats_fn = getattr(self.sampler, "stats", None)
        if callable(stats_fn):
            try:
                st = stats_fn()
                self._sampler_stats = st  # for status(): the sampler's lock is held during drains
                m.symbolize_duration.observe(float(st.last_symbolize_seconds))
                m.map_fill.labels(map="counts").set(float(st.count_map_fill))
                m.map_fill.labels(map="stacks").set(float(st.stack_map_fill))
                self._count_primed(st)
                self._count_python(st)
                self._count_unwind(st)
            except (AttributeError, TypeError, ValueError):
                pass
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
        self.last_drain_seconds = drain_seconds
        self.last_drain_ns = window.end_ns
        m.drains.inc()
        m.drain_duration.observe(drain_seconds)
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
                        window.sample_rate)
        self.ring.add(rw)
        if self.pusher is not None:
            self.pusher.submit(rw)  # a deque append: the network is the pusher thread's
        self.store.add(window.start_ns, window.end_ns, counts, window.samples, window.lost, window.sample_rate)
        nw, ns = self.ring.stats()
        m.ring_windows.set(nw)
        m.ring_stacks.set(ns)

    def _warn_losses(self, window: Window, counts: Mapping[CountKey, int]) -> None:
        """Say what the window lost and only what would cure it (flamed/daemon/losses.py)."""
        lost = window.lost
        if not any(lost.get(r, 0) for r in ("map_full", "kernel_stack_enomem", "user_stack_enomem",
                                            "kernel_stack_eexist", "user_stack_eexist")):
            return
        stacks = placeholder_stacks(key[3] for key in counts)
        settings = {"sampling.counts_map_size": self.config.sampling.counts_map_size,
                    "sampling.stack_map_size": self.config.sampling.stack_map_size}
        for advice in self._losses.advise(window.samples, lost, stacks, settings):
            log.log(advice.level, "%s", advice.message)

    def _count_python(self, st: Any) -> None:
        """The sampler's FLAMED_STAT_PY_* totals into flamed_python_bpf_samples_total."""
        totals = getattr(st, "python_total", None)
        if not isinstance(totals, dict):
            return
        for result, name in (("stack", "PY_STACKS"), ("no_thread", "PY_NO_THREAD"), ("no_frame", "PY_NO_FRAME"),
                             ("read_fault", "PY_READ_FAULT"), ("truncated", "PY_TRUNCATED"),
                             ("stacks_full", "PY_STACKS_FULL")):
            v = int(totals.get(name, 0))
            key = "py:" + result
            last = self._primed_seen.get(key, 0)
            self.metrics.python_bpf_samples.labels(result=result).inc(v - last if v >= last else v)
            self._primed_seen[key] = v

    def _count_unwind(self, st: Any) -> None:
        """The sampler's FLAMED_STAT_UW_* totals and table figures into the unwind metrics."""
        totals = getattr(st, "unwind_total", None)
        if not isinstance(totals, dict):
            return
        m = self.metrics
        for result, name in (("complete", "UW_COMPLETE"), ("no_table", "UW_NO_TABLE"),
                             ("unsupported_rule", "UW_UNSUPPORTED"), ("depth_limit", "UW_DEPTH"),
                             ("read_fault", "UW_READ_FAULT"), ("stacks_full", "UW_STACKS_FULL")):
            self._inc_from_total(m.unwind_stacks.labels(result=result), "uw:" + result, int(totals.get(name, 0)))
        self._inc_from_total(m.unwind_fp_frames, "uw:fp", int(totals.get("UW_FP_FRAMES", 0)))
        u = getattr(st, "unwind", None)
        if u is None:
            return
        m.unwind_rows.labels(state="used").set(u.rows_used)
        m.unwind_rows.labels(state="capacity").set(u.rows_capacity)
        m.unwind_binaries.set(u.binaries)
        m.unwind_processes.set(u.processes)
        for reason, v in u.skipped.items():
            self._inc_from_total(m.unwind_skipped.labels(reason=reason), "uwskip:" + reason, int(v))
        self._inc_from_total(m.unwind_built.labels(source="built"), "uwb:built", int(u.tables_built))
        self._inc_from_total(m.unwind_built.labels(source="cache"), "uwb:cache", int(u.tables_cached))

    def _inc_from_total(self, counter: Any, key: str, v: int) -> None:
        """Advance ``counter`` to a cumulative total (a new sampler after a reload starts again from 0)."""
        last = self._primed_seen.get(key, 0)
        counter.inc(v - last if v >= last else v)
        self._primed_seen[key] = v

    def _count_primed(self, st: Any) -> None:
        """The sampler's cumulative priming totals into the counter (a new
        sampler after a reload starts again from 0)."""
        for result, attr in (("primed", "primed_total"), ("gone", "prime_missed_total"),
                             ("lost", "prime_lost_total"), ("throttled", "prime_throttled_total")):
            v = int(getattr(st, attr, 0))
            last = self._primed_seen.get(result, 0)
            self.metrics.processes_primed.labels(result=result).inc(v - last if v >= last else v)
            self._primed_seen[result] = v

    def bpf_samples_total(self, *, live: bool = False) -> int | None:
        """Samples the BPF program(s) counted since start (its never-reset counter), if the sampler tells.

        ``live`` asks the sampler (main thread only: it waits for a running
        drain); otherwise the figure as of the last drain.
        """
        st: Any = self._sampler_stats
        if live:
            stats_fn = getattr(self.sampler, "stats", None)
            st = stats_fn() if callable(stats_fn) else None
        try:
            return None if st is None else self._bpf_retired + int(st.bpf_samples_total)
        except (AttributeError, TypeError, ValueError):
            return None

    def _unwind_status(self) -> dict[str, Any] | None:
        """The native unwinder as of the last drain: stacks by how they ended, tables, memory."""
        st: Any = self._sampler_stats
        u = getattr(st, "unwind", None)
        if u is None:
            return None
        t = st.unwind_total
        return {
            "stacks": {"complete": t["UW_COMPLETE"], "no_table": t["UW_NO_TABLE"],
                       "unsupported_rule": t["UW_UNSUPPORTED"], "depth_limit": t["UW_DEPTH"],
                       "read_fault": t["UW_READ_FAULT"], "stacks_full": t["UW_STACKS_FULL"]},
            "processes": u.processes, "binaries": u.binaries,
            "rows": {"used": u.rows_used, "capacity": u.rows_capacity},
            "tables": {"built": u.tables_built, "cached": u.tables_cached,
                       "build_seconds": round(u.build_seconds, 3)},
            "skipped": dict(u.skipped), "resets": u.resets,
        }

    def _symbol_cache_stats(self) -> dict[str, int] | None:
        """Per-process symbol caches of the sampler (fault tests count them before and after churn)."""
        st: Any = self._sampler_stats  # as of the last drain: status must not wait for one
        if st is None:
            return None
        try:
            return {"processes": int(st.symbol_processes), "addresses": int(st.symbol_addresses)}
        except (AttributeError, TypeError, ValueError):
            return None

    # -- processors ------------------------------------------------------
    def _processor_options(self, cfg: DaemonConfig) -> dict[str, tuple[type[WindowProcessor], Any]]:
        """Validate every [processors.NAME] table; raises ConfigError naming the key."""
        return processor_options(cfg.processors, self.processor_classes)

    def _start_processors(self, cfg: DaemonConfig,
                          procs: dict[str, tuple[type[WindowProcessor], Any]]) -> None:
        assert self.sampler is not None
        for name, (cls, opts) in procs.items():
            if not cls.enabled(opts):
                continue
            ctx = ProcessorContext(sampler=self.sampler, registry=self.registry, config=cfg,
                                   log=logging.getLogger(f"flamed.daemon.{name}"))
            self.processors.append(cls(ctx, opts))
            log.info("window processor %s enabled", name)

    # -- reload ----------------------------------------------------------
    def _do_reload(self) -> None:
        self.notifier.reloading()
        try:
            new = load_config(self.config_path, overrides=self.overrides)
            procs = self._processor_options(new)
        except ConfigError as e:
            self.metrics.reloads.labels(result="error").inc()
            log.error("reload: invalid configuration, keeping the running one: %s", e)
            self.notifier.ready(self._status_line())
            return
        except Exception:
            # A bug in reading the file must not take a running daemon down with it.
            self.metrics.reloads.labels(result="error").inc()
            log.exception("reload: reading the configuration failed, keeping the running one")
            self.notifier.ready(self._status_line())
            return
        new_lock: StateDirLock | None = None
        try:
            if new.pyroscope.server_address:
                # Read the password file before anything changes: a reload it
                # refuses must leave all of the running configuration alone.
                Target.from_config(new.pyroscope, self.store.host)
            if os.path.abspath(new.output.state_dir) != self.store.dir:
                # The new directory must be ours before anything else changes.
                new_lock = StateDirLock(new.output.state_dir)
                try:
                    os.makedirs(new_lock.directory, mode=0o755, exist_ok=True)
                except OSError as e:
                    raise FlamedError(f"cannot create state directory {new_lock.directory}: {e.strerror}") from None
                new_lock.acquire()
            self._apply(new, procs)
        except FlamedError as e:
            if new_lock is not None:
                new_lock.release()
            self.metrics.reloads.labels(result="error").inc()
            log.error("reload: %s; keeping the running configuration", e)
        else:
            if new_lock is not None:
                self.state_lock.release()
                self.state_lock = new_lock
            self.metrics.reloads.labels(result="ok").inc()
            log.info("reloaded configuration from %s", new.source or "defaults")
        self.notifier.ready(self._status_line())

    def _apply(self, new: DaemonConfig, procs: dict[str, tuple[type[WindowProcessor], Any]]) -> None:
        old = self.config
        if self.manage_logging and new.log != old.log:
            setup_logging(new.log.level, new.log.target)
        if new.sampling != old.sampling:
            # Start the new sampler before retiring the old one: no gap in sampling,
            # and the old one's last window is drained into the current period.
            fresh = self.sampler_factory(new)
            fresh.start()
            assert self.sampler is not None
            # Detach the old program at once (its maps stay readable), so the two
            # sample together only for the moment between attach and detach.
            stop_old = getattr(self.sampler, "stop", None)
            if callable(stop_old):
                try:
                    stop_old()
                except Exception as e:
                    log.warning("reload: stopping the old sampler: %s", e)
            self._drain_once()
            self._bpf_retired = (self.bpf_samples_total(live=True) or 0)
            self.sampler.close()
            self.sampler = fresh
            self._sampler_stats = None
            self._primed_seen.clear()
            for p in self.processors:
                p.sampler_changed(fresh)
        self.store.configure(new.output, new.retention)
        if new.output.state_dir != old.output.state_dir:
            self.store.ensure_dir()
            self.store.recover()
        self.store.apply_retention()
        self.ring.configure(new.snapshot.ring_seconds, new.snapshot.ring_max_stacks)
        self.metrics_server.configure(new.metrics)
        if new.metrics.address != old.metrics.address:
            try:
                self.metrics_server.start(new.metrics.address)
            except OSError as e:
                log.error("reload: cannot serve metrics on %s: %s; metrics are off until the next reload",
                          new.metrics.address, e.strerror)
        self._apply_push(new)
        self.control.configure(new.control)
        if new.control.socket != old.control.socket and self.control.listen_fd is None:
            self.control.stop()
            self.control = ControlServer(new.control, self.handle_request, self.metrics)
            self.control.start()
        by_name = {p.name: p for p in self.processors}
        kept: list[WindowProcessor] = []
        assert self.sampler is not None
        for name, (cls, opts) in procs.items():
            proc = by_name.pop(name, None)
            if not cls.enabled(opts):
                if proc is not None:
                    proc.close()
                continue
            if proc is None:
                ctx = ProcessorContext(sampler=self.sampler, registry=self.registry, config=new,
                                       log=logging.getLogger(f"flamed.daemon.{name}"))
                proc = cls(ctx, opts)
            else:
                proc.ctx.config = new
                proc.reload(opts, new)
            kept.append(proc)
        for p in by_name.values():
            p.close()
        self.processors = kept
        self.config = new
        _release_heap()  # a new sampler or processor may have compiled a program

    def _apply_push(self, new: DaemonConfig) -> None:
        if not new.pyroscope.server_address:
            if self.pusher is not None:
                self.pusher.stop(min(self.config.pyroscope.timeout, 5.0))
                self.pusher = None
            return
        if self.pusher is None:
            self.pusher = Pusher(new.pyroscope, self.metrics, host=self.store.host, root=new.output.root_frame)
        else:
            self.pusher.configure(new.pyroscope, new.output.root_frame)

    # -- control requests (called from client threads) -------------------
    def handle_request(self, line: bytes, peer: Peer) -> Iterator[bytes]:
        m = self.metrics
        kind = "unknown"
        try:
            req = parse_request(
                line,
                formats=outputs.names(),
                max_next=self.config.snapshot.max_next_seconds,
                default_root=self.config.output.root_frame,
            )
            kind = req.request
            if req.request == "status":
                head = encode_header({"ok": True, "status": self.status()})
                m.requests.labels(request=kind, result="ok").inc()
                yield head
                return
            if req.request == "flush":
                path = self.request_flush()
                m.requests.labels(request=kind, result="ok").inc()
                yield encode_header({"ok": True, "file": path})
                return
            assert req.snapshot is not None
            header, payload = self.snapshot(req.snapshot)
        except ProtocolError as e:
            m.requests.labels(request=kind, result=e.code).inc()
            yield error_header(str(e), e.code)
            return
        except FlamedError as e:
            m.requests.labels(request=kind, result="error").inc()
            yield error_header(str(e), "error")
            return
        except Exception:
            m.requests.labels(request=kind, result="internal_error").inc()
            log.exception("snapshot failed")
            yield error_header("internal error in the daemon (see its log)", "internal_error")
            return
        m.requests.labels(request="snapshot", result="ok").inc()
        yield encode_header(header)
        view = memoryview(payload)
        for i in range(0, len(view), 1 << 18):
            yield bytes(view[i: i + (1 << 18)])

    def _wait_ring(self, end_ns: int) -> None:
        deadline = time.monotonic() + LOOP_WAIT_TIMEOUT
        while not self.ring.wait_for_end(end_ns, 0.5):
            if self.stopping.is_set() or time.monotonic() > deadline:
                return
            self.request_drain()

    def _sleep_until(self, t_ns: int) -> None:
        while not self.stopping.is_set() and not self._stop:
            left = (t_ns - self.clock_ns()) / 1e9
            if left <= 0:
                return
            self.stopping.wait(min(left, 0.5))

    def _next_windows(self, seconds: float) -> tuple[list[RingWindow], int, int]:
        """Wait ``seconds`` and return the windows of those seconds, with the span's (start, end)."""
        spacing = int(MIN_DRAIN_SPACING * 1e9)
        # A drain now puts a window boundary at the start of the requested span.
        t_req = self.clock_ns()
        self.request_drain()
        self._wait_ring(t_req)
        t0 = max(t_req - spacing, self._newest_end(t_req))
        t1 = t0 + int(seconds * 1e9)
        self._sleep_until(t1)
        self.request_drain()
        self._wait_ring(t1)
        windows = [w for w in self.ring.since(t0) if w.start_ns >= t0 - 1_000_000 and w.start_ns < t1]
        return windows, t0, t1

    def pprof_profile(self, seconds: float) -> bytes:
        """``/debug/pprof/profile?seconds=N``: the samples of the next N seconds (an HTTP thread waits)."""
        windows, _t0, _t1 = self._next_windows(seconds)
        if not windows and self.stopping.is_set():
            raise FlamedError("the daemon is stopping; retry when it is back")
        return windows_pprof(windows, root=self.config.output.root_frame, host=self.store.host)

    def snapshot(self, req: SnapshotRequest) -> tuple[dict[str, Any], bytes]:
        spacing = int(MIN_DRAIN_SPACING * 1e9)
        if req.next is not None:
            windows, _t0, _t1 = self._next_windows(req.next)
        else:
            now = self.clock_ns()
            if now - self.last_drain_ns > spacing:
                self.request_drain()
                self._wait_ring(now - spacing)
            assert req.seconds is not None
            windows = self.ring.since(self.clock_ns() - int(req.seconds * 1e9))
        flt = SnapshotFilter(req)
        counts: dict[CountKey, int] = {}
        samples = 0
        lost: dict[str, int] = {}
        for w in windows:
            flt.apply(w.counts, counts)
            samples += w.samples
            for r, n in w.lost.items():
                lost[r] = lost.get(r, 0) + n
        rates = {w.sample_rate for w in windows}
        profile = counts_to_profile(
            counts,
            req.root,
            start_ns=windows[0].start_ns if windows else None,
            end_ns=windows[-1].end_ns if windows else None,
            sample_rate=rates.pop() if len(rates) == 1 else None,
            labels={"host": self.store.host, "unit": "samples"},
        )
        fmt = outputs.get(req.format)
        buf = io.BytesIO()
        fmt.write(profile, buf, OutputOptions(title=req.title))
        payload = buf.getvalue()
        header = {
            "ok": True,
            "format": req.format,
            "start_ns": profile.start_ns,
            "end_ns": profile.end_ns,
            "windows": len(windows),
            "stacks": len(profile),
            "weight": profile.total(),
            "samples_all_tasks": samples,
            "lost": dict(sorted(lost.items())),
            "sample_rate": profile.sample_rate,
            "length": len(payload),
        }
        return header, payload

    def _newest_end(self, default: int) -> int:
        ws = self.ring.since(0)
        return ws[-1].end_ns if ws else default

    # -- status ----------------------------------------------------------
    def _status_line(self) -> str:
        return (f"{self.totals['samples']} samples in {self.totals['windows']} windows; "
                f"{self.store.files_written} files written"
                + (f"; WRITE ERROR: {self.store.last_error}" if self.store.last_error else ""))

    def status(self) -> dict[str, Any]:
        cfg = self.config
        nw, ns = self.ring.stats()
        files = self.store.list_files()
        return {
            "version": __version__,
            "pid": os.getpid(),
            "started_ns": self.started_ns,
            "config": cfg.source,
            "sampler": cfg.sampling.sampler,
            "frequency": cfg.sampling.frequency,
            "drain_interval": cfg.sampling.drain_interval,
            "rotate_interval": cfg.output.rotate_interval,
            "state_dir": self.store.dir,
            "host": self.store.host,
            "last_drain_ns": self.last_drain_ns,
            "last_drain_seconds": round(self.last_drain_seconds, 6),
            "windows": self.totals["windows"],
            "samples": self.totals["samples"],
            "bpf_samples": self.bpf_samples_total(),
            "symbol_caches": self._symbol_cache_stats(),
            "unwind": self._unwind_status(),
            "weight": self.totals["weight"],
            "lost": dict(sorted(self.lost_totals.items())),
            "ring": {"windows": nw, "stacks": ns, "seconds": cfg.snapshot.ring_seconds},
            "files": {"count": len(files), "bytes": sum(f[2] for f in files),
                      "latest": self.store.last_written},
            "backlog": {"files": len(self.store.backlog), "bytes": self.store.backlog_bytes},
            "write_error": self.store.last_error,
            "metrics": self.metrics_server.bound,
            "pprof": bool(cfg.metrics.pprof and self.metrics_server.bound),
            "push": None if self.pusher is None else self.pusher.status(),
            "socket": self.control.path,
            "clients": self.control.active,
            "processors": {p.name: _safe_status(p) for p in self.processors},
            "formats": outputs.names(),
        }


def _release_heap() -> None:
    """Give back what compiling BPF programs (clang/LLVM) left resident: see flamed.sampling.memory."""
    from flamed.sampling.memory import release_compiler_memory

    release_compiler_memory()


def _safe_status(p: WindowProcessor) -> dict[str, Any]:
    try:
        return p.status()
    except Exception as e:  # status must not fail because one processor does
        return {"error": str(e)}


def replace_config(cfg: DaemonConfig, **sections: Any) -> DaemonConfig:
    """``cfg`` with whole sections replaced (tests and the CLI use it)."""
    return dataclasses.replace(cfg, **sections)
