"""SIGHUP: read the configuration again and apply it, section by section.

Runs in the main loop's thread, between drains.  Everything that can refuse
(the file, the [processors.*] values, the push password file, a new state
directory's lock, a new control socket or metrics address that must be bound) is checked before anything changes: a refused reload
leaves the whole running configuration alone.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, Protocol

from prometheus_client import CollectorRegistry

from flamed.daemon.config import DaemonConfig, load_config
from flamed.daemon.control import ControlServer
from flamed.daemon.logs import setup_logging
from flamed.daemon.loop import DrainLoop
from flamed.daemon.metrics import DaemonMetrics, MetricsServer, PendingListener
from flamed.daemon.notify import Notifier
from flamed.daemon.paths import ensure_directory
from flamed.daemon.processors import ProcessorContext, WindowProcessor, processor_options
from flamed.daemon.pyroscope import Pusher, Target
from flamed.daemon.ring import WindowRing
from flamed.daemon.statelock import StateDirLock
from flamed.daemon.store import ProfileStore
from flamed.errors import ConfigError, FlamedError
from flamed.sampling.contract import Sampler
from flamed.sampling.memory import release_compiler_memory

log = logging.getLogger("flamed.daemon")

SamplerFactory = Callable[[DaemonConfig], Sampler]
#: Each enabled-or-not processor class with its validated options, by name.
ProcessorOptions = dict[str, tuple[type[WindowProcessor], Any]]


class Reloadable(Protocol):
    """The parts of the daemon a reload reads or replaces (:class:`flamed.daemon.core.Daemon` is one)."""

    config_path: str | None
    overrides: dict[str, Any]
    manage_logging: bool
    sampler_factory: SamplerFactory
    processor_classes: list[type[WindowProcessor]] | None
    loop: DrainLoop
    store: ProfileStore
    ring: WindowRing
    metrics: DaemonMetrics
    registry: CollectorRegistry
    metrics_server: MetricsServer
    control: ControlServer
    state_lock: StateDirLock
    notifier: Notifier
    clock_ns: Callable[[], int]
    #: The last reload's outcome (status "last_reload"); None until the first.
    last_reload: dict[str, Any] | None


def reload(d: Reloadable) -> None:
    d.notifier.reloading()
    try:
        new = load_config(d.config_path, overrides=d.overrides)
        procs = processor_options(new.processors, d.processor_classes)
    except ConfigError as e:
        _outcome(d, f"invalid configuration: {e}")
        log.error("reload: invalid configuration, keeping the running one: %s", e)
        d.notifier.ready(d.loop.status_line())
        return
    except Exception as e:
        # A bug in reading the file must not take a running daemon down with it.
        _outcome(d, f"reading the configuration failed: {type(e).__name__}: {e}")
        log.exception("reload: reading the configuration failed, keeping the running one")
        d.notifier.ready(d.loop.status_line())
        return
    new_lock: StateDirLock | None = None
    new_control: ControlServer | None = None
    new_metrics: PendingListener | None = None
    try:
        if new.pyroscope.server_address:
            # Read the password file before anything changes: a reload it
            # refuses must leave all of the running configuration alone.
            Target.from_config(new.pyroscope, d.store.host)
        if os.path.abspath(new.output.state_dir) != d.store.dir:
            # The new directory must be ours before anything else changes.
            new_lock = StateDirLock(new.output.state_dir)
            ensure_directory(new_lock.directory, "output.state_dir")
            new_lock.acquire()
        if _socket_moves(d, new):
            # Bound before anything changes: a path that cannot be bound refuses the
            # reload, and the running socket keeps answering.
            new_control = ControlServer(new.control, d.control.handler, d.metrics)
            new_control.start()
        if _metrics_moves(d, new):
            # The same rule for the metrics address: bound first, or the reload is refused
            # and the running listener keeps serving.
            try:
                new_metrics = d.metrics_server.listen(new.metrics.address)
            except OSError as e:
                raise FlamedError(f"cannot serve metrics on {new.metrics.address}: {e.strerror or e}") from None
        _apply(d, new, procs, new_control, new_metrics)
    except FlamedError as e:
        if new_lock is not None:
            new_lock.release()
        if new_control is not None and new_control is not d.control:
            new_control.stop()
        if new_metrics is not None and not d.metrics_server.serves(new_metrics):
            d.metrics_server.discard(new_metrics)
        _outcome(d, str(e))
        log.error("reload: %s; keeping the running configuration", e)
    else:
        if new_lock is not None:
            d.state_lock.release()
            d.state_lock = new_lock
        _outcome(d, None)
        log.info("reloaded configuration from %s", new.source or "defaults")
    d.notifier.ready(d.loop.status_line())


def _outcome(d: Reloadable, error: str | None) -> None:
    """Count the reload and keep its outcome for the status answer (``error``: why it was refused)."""
    d.metrics.reloads.labels(result="error" if error else "ok").inc()
    d.last_reload = {"time_ns": d.clock_ns(), "result": "error" if error else "ok", "error": error}


def _socket_moves(d: Reloadable, new: DaemonConfig) -> bool:
    """Bind a socket anew: its path changed, or its file was removed (or replaced) since it was bound."""
    if d.control.listen_fd is not None:
        return False
    if new.control.socket != d.loop.config.control.socket:
        return True
    if not d.control.owns_path():
        log.warning("reload: the control socket %s was removed or replaced; binding it again", d.control.path)
        return True
    return False


def _metrics_moves(d: Reloadable, new: DaemonConfig) -> bool:
    """Bind the metrics address anew: it changed (to another address, not to ""), or nothing serves it."""
    address = new.metrics.address
    return bool(address) and (address != d.metrics_server.address or d.metrics_server.bound is None)


def _apply(d: Reloadable, new: DaemonConfig, procs: ProcessorOptions, new_control: ControlServer | None,
           new_metrics: PendingListener | None) -> None:
    old = d.loop.config
    if d.manage_logging and new.log != old.log:
        setup_logging(new.log.level, new.log.target)
    if new.sampling != old.sampling:
        # Start the new sampler before retiring the old one: no gap in sampling,
        # and the old one's last window is drained into the current period.
        # The old one keeps being drained on its grid while the new one compiles
        # (seconds; tens of seconds on a loaded host); attached only once ready, the
        # two sample together for the moment between its attach and the old one's detach.
        fresh = d.sampler_factory(new)
        d.loop.prepare_sampler(fresh)  # a failure tears the new one down and refuses the reload
        fresh.start()
        d.loop.replace_sampler(fresh)
    d.store.configure(new.output, new.retention)
    if new.output.state_dir != old.output.state_dir:
        d.store.ensure_dir()
        d.store.recover()
    d.store.apply_retention()
    d.ring.configure(new.snapshot.ring_seconds, new.snapshot.ring_max_stacks)
    _apply_metrics(d, new, new_metrics)
    _apply_push(d, new, old)
    _apply_control(d, new, new_control)
    _apply_processors(d, new, procs)
    d.loop.config = new
    release_compiler_memory()  # a new sampler or processor may have compiled a program


def _apply_metrics(d: Reloadable, new: DaemonConfig, new_metrics: PendingListener | None) -> None:
    d.metrics_server.configure(new.metrics)
    if new_metrics is not None:
        d.metrics_server.switch(new_metrics)  # bound already (reload)
    elif not new.metrics.address:
        d.metrics_server.stop()  # turned off


def _apply_push(d: Reloadable, new: DaemonConfig, old: DaemonConfig) -> None:
    loop = d.loop
    if not new.pyroscope.server_address:
        if loop.pusher is not None:
            loop.pusher.stop(min(old.pyroscope.timeout, 5.0))
            loop.pusher = None
        return
    if loop.pusher is None:
        loop.pusher = Pusher(new.pyroscope, d.metrics, host=d.store.host, root=new.output.root_frame)
    else:
        loop.pusher.configure(new.pyroscope, new.output.root_frame)


def _apply_control(d: Reloadable, new: DaemonConfig, new_control: ControlServer | None) -> None:
    if new_control is None:
        d.control.configure(new.control)
        return
    old, d.control = d.control, new_control  # bound already (reload)
    old.stop()


def _apply_processors(d: Reloadable, new: DaemonConfig, procs: ProcessorOptions) -> None:
    """Keep (and reload) the processors still enabled, start the newly enabled, close the rest."""
    by_name = {p.name: p for p in d.loop.processors}
    kept: list[WindowProcessor] = []
    sampler = d.loop.sampler
    assert sampler is not None
    for name, (cls, opts) in procs.items():
        proc = by_name.pop(name, None)
        if not cls.enabled(opts):
            if proc is not None:
                proc.close()
            continue
        if proc is None:
            proc = cls(processor_context(d.registry, sampler, new, name), opts)
        else:
            proc.ctx.config = new
            proc.reload(opts, new)
        kept.append(proc)
    for p in by_name.values():
        p.close()
    d.loop.processors = kept


def processor_context(registry: CollectorRegistry, sampler: Sampler, cfg: DaemonConfig,
                      name: str) -> ProcessorContext:
    """What a window processor named ``name`` gets to work with (each has a logger of its own)."""
    return ProcessorContext(sampler=sampler, registry=registry, config=cfg,
                            log=logging.getLogger(f"flamed.daemon.{name}"))
