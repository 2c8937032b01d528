"""The daemon: a drain loop in the main thread, control and metrics in threads.

:class:`Daemon` puts the parts together and runs their lifecycle (start,
stop, the status); each part's work is in a module of its own:

* :mod:`~flamed.daemon.loop` -- the main loop: drains, windows into the ring,
  the files and the push queue, rotation, flush hand-off;
* :mod:`~flamed.daemon.reload` -- SIGHUP: the configuration read again and
  applied section by section;
* :mod:`~flamed.daemon.handlers` -- the control socket's requests (status,
  snapshot, flush) and the pull endpoint (``/debug/pprof/profile``), in
  client threads that only ask the loop and wait.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from types import FrameType
from typing import Any

from flamed import __version__
from flamed import outputs
from flamed.daemon.config import DaemonConfig
from flamed.daemon.control import ControlServer
from flamed.daemon.handlers import RequestHandlers
from flamed.daemon.loop import LOOP_WAIT_TIMEOUT, MIN_DRAIN_SPACING, DrainLoop, detach
from flamed.daemon.metrics import DaemonMetrics, MetricsServer
from flamed.daemon.notify import Notifier
from flamed.daemon.paths import ensure_directory
from flamed.daemon.pyroscope import Pusher
from flamed.daemon.processors import WindowProcessor, processor_options
from flamed.daemon.reload import ProcessorOptions, SamplerFactory, processor_context, reload
from flamed.daemon.ring import WindowRing
from flamed.daemon.samplers import make_sampler
from flamed.daemon.statelock import StateDirLock
from flamed.daemon.store import ProfileStore
from flamed.errors import FlamedError
from flamed.sampling.contract import Sampler
from flamed.sampling.memory import memory_by_part_cached, release_compiler_memory

__all__ = ["LOOP_WAIT_TIMEOUT", "MIN_DRAIN_SPACING", "Daemon", "SamplerFactory", "replace_config"]

log = logging.getLogger("flamed.daemon")


def _default_factory(cfg: DaemonConfig) -> Sampler:
    return make_sampler(cfg.sampling, cfg.output.state_dir)



def set_nice(nice: int, task_dir: str = "/proc/self/task") -> None:
    """Every thread of this process to ``nice`` (Linux keeps it per thread;
    threads started later inherit their creator's).  Called once the daemon is
    ready: start-up keeps the nice it was started with."""
    failed: list[str] = []
    try:
        tids = [int(t) for t in os.listdir(task_dir)]
    except OSError as e:
        log.warning("cannot list the daemon's threads (%s): sampling.nice %d not applied", e.strerror, nice)
        return
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except ProcessLookupError:
            continue  # the thread ended meanwhile
        except OSError as e:
            failed.append(f"{tid}: {e.strerror}")
    if failed:
        log.warning("sampling.nice %d not applied to %d thread(s) (%s); lowering the nice value below the "
                    "one the daemon started with needs CAP_SYS_NICE", nice, len(failed), "; ".join(failed[:3]))

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
        self.store.on_dir_made = self._guard_state_lock
        self._lock_lost: str | None = None  # what was logged when another daemon took the directory
        self.loop = DrainLoop(config, store=self.store, ring=self.ring, metrics=self.metrics,
                              notifier=self.notifier, clock_ns=clock_ns)
        self.stopping = threading.Event()
        self.ready = threading.Event()
        self.started_ns = 0
        #: Where the sampler's BPF program came from (status "program_from"):
        #: cache, child (compiled in a short-lived process), compiled; "" if none.
        self.program_from = ""
        #: Seconds of each start-up phase (status "startup", flamed_startup_seconds).
        self.startup: dict[str, float] = {}
        #: The last reload's outcome: time_ns, result ("ok" or "error"), error (why it was refused).
        self.last_reload: dict[str, Any] | None = None
        self.handlers = RequestHandlers(self.loop, ring=self.ring, store=self.store, metrics=self.metrics,
                                        clock_ns=clock_ns, stopping=self.stopping, status=self.status,
                                        min_drain_spacing=MIN_DRAIN_SPACING, wait_timeout=LOOP_WAIT_TIMEOUT)
        self.metrics_server = MetricsServer(self.registry, self.metrics, self.handlers.pprof_profile)
        self.metrics_server.configure(config.metrics)
        self.control = ControlServer(config.control, self.handlers.handle_request, self.metrics,
                                     listen_fd=listen_fd)

    # The loop owns what only its thread may change; these are for reading.
    @property
    def config(self) -> DaemonConfig:
        return self.loop.config

    @property
    def sampler(self) -> Sampler | None:
        return self.loop.sampler

    @property
    def processors(self) -> list[WindowProcessor]:
        return self.loop.processors

    @property
    def pusher(self) -> Pusher | None:
        return self.loop.pusher

    @property
    def totals(self) -> dict[str, int]:
        return self.loop.totals

    # -- requests from other threads and signal handlers -----------------
    def request_stop(self, reason: str = "") -> None:
        self.loop.request_stop(reason)

    def request_reload(self) -> None:
        self.loop.request_reload()

    def request_drain(self) -> None:
        self.loop.request_drain()

    def request_flush(self, timeout: float = LOOP_WAIT_TIMEOUT) -> str | None:
        """Close the current period into a file now; returns its path (None if nothing to write)."""
        return self.loop.request_flush(timeout)

    def _guard_state_lock(self) -> None:
        """The state directory was removed (and made again): lock it again, before
        another daemon starts on it and the two delete each other's files."""
        lock = self.state_lock
        if not lock.held or lock.still_held():
            return
        try:
            lock.renew()
        except FlamedError as e:
            if self._lock_lost != str(e):
                self._lock_lost = str(e)
                log.error("the lock file of the state directory was removed, and now: %s; two daemons write "
                          "there, each one's retention deleting the other's files", e)
            return
        self._lock_lost = None
        log.warning("state directory %s: its lock file was removed; locked it again", lock.directory)

    def install_signals(self) -> None:
        # A handler runs in the main thread between any two bytecodes, possibly in
        # the middle of a write to the log's stream or inside a lock: it only sets
        # flags and wakes the loop (an eventfd), which logs and acts.
        def on_stop(signum: int, frame: FrameType | None) -> None:
            self.request_stop(signal.Signals(signum).name)

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
        t0 = time.perf_counter()
        startup = self.startup = {}
        ensure_directory(self.store.dir, "output.state_dir")  # PathError (exit 2) names what is in the way
        # Every value is checked before anything compiles (the BPF program takes
        # seconds): a bad [processors.*] value is a config error (exit 2) at once.
        procs = processor_options(cfg.processors, self.processor_classes)
        # Before recovery: it deletes temp files and sidecars another daemon may be writing.
        self.state_lock.acquire()
        # pyroute2's proc connector module (~0.1 s of CPU to import) is loaded
        # during start-up, beside the sampler's, not in the first span after ready.
        threading.Thread(target=_preimport, args=("pyroute2.netlink.connector.cn_proc",),
                         name="flamed-preimport", daemon=True).start()
        try:
            self.store.recover()
            self.store.apply_retention()
            startup["state_dir_s"] = time.perf_counter() - t0
            t = time.perf_counter()
            self.loop.sampler = self.sampler_factory(cfg)
            self.loop.sampler.start()
            startup["sampler_s"] = time.perf_counter() - t
        except BaseException:
            self.state_lock.release()
            raise
        try:
            t = time.perf_counter()
            self._start_processors(cfg, procs)
            startup["processors_s"] = time.perf_counter() - t
            release_compiler_memory()  # after every compile (sampler, Python clock)
            t = time.perf_counter()
            try:
                self.metrics_server.start(cfg.metrics.address)
            except OSError as e:
                raise FlamedError(f"cannot serve metrics on {cfg.metrics.address}: {e.strerror}; "
                                  "set metrics.address (or --metrics-address) to a free HOST:PORT, "
                                  "or to \"\" to disable") from None
            self.control.start()
            if cfg.pyroscope.server_address:
                self.loop.pusher = Pusher(cfg.pyroscope, self.metrics, host=self.store.host,
                                          root=cfg.output.root_frame)
            startup["servers_s"] = time.perf_counter() - t
        except BaseException:
            self._close_all()
            raise
        startup["ready_s"] = time.perf_counter() - t0
        parts = getattr(self.loop.sampler, "stats", None)
        if parts is not None:
            # The sampler's own phases: compile (BTF offsets, clang, maps) and attach (verifier, perf events).
            for k, v in getattr(parts(), "startup", {}).items():
                if k != "sampler_s":
                    startup[f"sampler_{k}"] = v
            self.program_from = str(getattr(parts(), "program", ""))
        for k, v in startup.items():
            startup[k] = round(v, 3)
            self.metrics.startup_seconds.labels(part=k.removesuffix("_s")).set(v)
        self.loop.last_drain_ns = self.started_ns
        set_nice(cfg.sampling.nice)
        self.ready.set()
        self.notifier.ready(self.loop.status_line())
        log.info("flamed %s sampling at %d Hz, drain every %g s, files every %g s in %s",
                 __version__, cfg.sampling.frequency, cfg.sampling.drain_interval,
                 cfg.output.rotate_interval, self.store.dir)
        if self.on_ready is not None:
            self.on_ready(self)

    def _start_processors(self, cfg: DaemonConfig, procs: ProcessorOptions) -> None:
        sampler = self.loop.sampler
        assert sampler is not None
        for name, (cls, opts) in procs.items():
            if not cls.enabled(opts):
                continue
            self.loop.processors.append(cls(processor_context(self.registry, sampler, cfg, name), opts))
            log.info("window processor %s enabled", name)

    def run(self) -> int:
        """Start, loop until stopped, write everything, return the exit code."""
        self.start()
        try:
            self.loop.run(lambda: reload(self))
        finally:
            self._shutdown()
        return 0

    def _shutdown(self) -> None:
        self.stopping.set()
        self.notifier.stopping()
        try:
            if self.loop.sampler is not None:
                # Detach first, keep the maps: the last drain then holds every sample up to now.
                detach(self.loop.sampler, "stopping the sampler")
                self.loop.drain_once(rotate_now=True, final=True)
                self._log_stop_accounting()
            self.store.log_exit_accounting()
        finally:
            self.loop.answer_late_flushes()
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
        bpf = self.loop.bpf_samples_total(live=True)
        if bpf is None:
            return
        written = self.loop.totals["weight"]
        unkeyed = self.loop.lost_totals.get("map_full", 0)
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
        loop = self.loop
        self.control.stop()
        for p in loop.processors:
            try:
                p.close()
            except Exception:
                log.exception("processor %s failed to close", p.name)
        loop.processors = []
        if loop.sampler is not None:
            loop.sampler.close()
        if loop.pusher is not None:
            # The last window was just queued: give it a moment to reach the server.
            loop.pusher.stop(min(self.config.pyroscope.timeout, 5.0))
            loop.pusher = None
        self.metrics_server.stop()
        # Last: everything that writes into the state directory is done.
        self.state_lock.release()

    # -- status ----------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """What ``flamed status`` shows (the control socket's handlers call it from client threads)."""
        cfg = self.config
        loop = self.loop
        _, ns = self.ring.stats()
        by_kind = self.ring.windows_by_kind()
        files = self.store.list_files()
        return {
            "version": __version__,
            "pid": os.getpid(),
            "started_ns": self.started_ns,
            "config": cfg.source,
            # After a refused reload the file may hold what does not run: "error" says why.
            "last_reload": None if self.last_reload is None else dict(self.last_reload),
            "sampler": cfg.sampling.sampler,
            "frequency": cfg.sampling.frequency,
            "drain_interval": cfg.sampling.drain_interval,
            # What the sampler leaves out (`flamed record` through the daemon names it when its target is).
            "filter": {"pids": list(cfg.sampling.pids), "comms": list(cfg.sampling.comms),
                       "cgroups": list(cfg.sampling.cgroups), "units": list(cfg.sampling.units)},
            "rotate_interval": cfg.output.rotate_interval,
            "state_dir": self.store.dir,
            "host": self.store.host,
            "last_drain_ns": loop.last_drain_ns,
            "last_drain_seconds": round(loop.last_drain_seconds, 6),
            "windows": loop.totals["windows"],
            "samples": loop.totals["samples"],
            "bpf_samples": loop.bpf_samples_total(),
            "symbol_caches": loop.sampler_stats.symbol_cache_stats(),
            "unwind": loop.sampler_stats.unwind_status(),
            # What the config asks for: before the first drain "unwind" is None either way.
            "unwind_configured": (cfg.sampling.sampler == "bpf" and cfg.sampling.unwind
                                  and cfg.sampling.prime_new_processes),
            "weight": loop.totals["weight"],
            "lost": dict(sorted(loop.lost_totals.items())),
            "offcpu": {"enabled": loop.offcpu_enabled(), "seconds": round(loop.totals.get("offcpu_ns", 0) / 1e9, 6),
                       "min_us": cfg.sampling.off_cpu_min_us, "every": cfg.sampling.off_cpu_every,
                       "latest": _still_there(self.store.last_written_offcpu)},
            # Windows by kind: with off-CPU time on, each drain adds a CPU and an off-CPU window;
            # "stacks" are the entries of both (what snapshot.ring_max_stacks bounds).
            "ring": {"windows": by_kind["cpu"], "offcpu_windows": by_kind.get("offcpu", 0), "stacks": ns,
                     "seconds": cfg.snapshot.ring_seconds},
            "files": {"count": len(files), "bytes": sum(f[2] for f in files),
                      "latest": _still_there(self.store.last_written)},
            "backlog": {"files": len(self.store.backlog), "bytes": self.store.backlog_bytes},
            "write_error": self.store.last_error,
            "metrics": self.metrics_server.bound,
            "pprof": bool(cfg.metrics.pprof and self.metrics_server.bound),
            "push": None if loop.pusher is None else loop.pusher.status(),
            "socket": self.control.path,
            "clients": self.control.active,
            "processors": {p.name: _safe_status(p) for p in loop.processors},
            "formats": outputs.names(),
            "startup": dict(self.startup),
            "program_from": self.program_from,
            "memory": self.memory(),
        }

    def memory(self) -> dict[str, int]:
        """Bytes by part now (flamed/sampling/memory.py; flamed_memory_bytes at each scrape)."""
        return memory_by_part_cached()


def _preimport(module: str) -> None:
    try:
        importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 -- whoever needs it later says why
        log.debug("pre-import of %s: %s", module, e)


def _safe_status(p: WindowProcessor) -> dict[str, Any]:
    try:
        return p.status()
    except Exception as e:  # status must not fail because one processor does
        return {"error": str(e)}


def replace_config(cfg: DaemonConfig, **sections: Any) -> DaemonConfig:
    """``cfg`` with whole sections replaced (tests and the CLI use it)."""
    return dataclasses.replace(cfg, **sections)


def _still_there(path: str | None) -> str | None:
    """The last file written, while it exists (not after its directory was removed or replaced)."""
    return path if path is not None and os.path.isfile(path) else None
