"""The contract of a window processor (mixed mode plugs in here)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, ClassVar

from prometheus_client import CollectorRegistry

from flamed.sampling.contract import Sampler, Window


@dataclass
class ProcessorContext:
    """What the daemon hands a processor.

    ``sampler``: the running sampler (``watch``/``unwatch`` pids to get their
    timestamped events).  It is replaced on a reload that changes
    ``[sampling]``; the daemon then calls :meth:`WindowProcessor.sampler_changed`.
    ``registry``: the daemon's Prometheus registry -- create metrics with
    ``registry=ctx.registry`` and they appear on /metrics.
    ``config``: the whole :class:`~flamed.daemon.config.DaemonConfig`.
    """

    sampler: Sampler
    registry: CollectorRegistry
    config: Any
    log: logging.Logger


class WindowProcessor:
    """Subclass with a ``name``; the daemon discovers it in flamed/daemon/processors/.

    Options: set ``options_class`` to a frozen dataclass; the daemon fills it
    from the ``[processors.NAME]`` table of the config file (every key checked,
    errors name ``processors.NAME.key``) and passes it to ``__init__`` and
    :meth:`reload`.  A processor whose options say it is off should return
    ``False`` from :meth:`enabled`; it is then not created.

    Threading: :meth:`process` runs in the daemon's main loop, between the
    drain and storing the window; keep it bounded (it delays the next drain).
    :meth:`status` may be called from a control-socket thread.
    """

    name: ClassVar[str] = ""
    order: ClassVar[int] = 50
    options_class: ClassVar[type[Any] | None] = None

    def __init__(self, ctx: ProcessorContext, options: Any) -> None:
        self.ctx = ctx
        self.options = options

    @classmethod
    def enabled(cls, options: Any) -> bool:
        return bool(getattr(options, "enabled", True))

    def process(self, window: Window) -> None:
        """Rewrite ``window`` in place.

        Typically: take the events this processor owns out of
        ``window.events`` and add their stacks to ``window.counts`` under
        ``(tgid, tid, comm, stack)``.  Events left in ``window.events`` are
        counted by the daemon with their native + kernel stacks, so nothing
        is lost when a processor cannot handle them.  Samples the processor
        could not attribute should still be added (with a placeholder frame)
        so that ``sum(counts) + len(events) == samples`` stays true.
        """

    def finish(self, window: Window) -> None:
        """The last window, at shutdown: like :meth:`process`, but also add
        whatever is still held back from earlier windows (as native stacks if
        it cannot be joined any more), because :meth:`close` comes after the
        last file is written.  Default: :meth:`process`."""
        self.process(window)

    def reload(self, options: Any, config: Any) -> None:
        """New options after SIGHUP (already validated)."""
        self.options = options

    def sampler_changed(self, sampler: Sampler) -> None:
        """The sampler was replaced (reload of ``[sampling]``): re-``watch`` what you watched."""
        self.ctx.sampler = sampler

    def status(self) -> dict[str, Any]:
        """A JSON-able dict shown by ``flamed status``."""
        return {}

    def close(self) -> None:
        """Stop children and threads; called once at shutdown, after the last window."""
