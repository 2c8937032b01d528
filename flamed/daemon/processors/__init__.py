"""Window processors: the daemon's hook for code that rewrites drained windows.

Every module in this package that defines a subclass of
:class:`~flamed.daemon.processors.base.WindowProcessor` with a ``name`` is
discovered; the daemon creates one instance per processor at start (and
rebuilds it on reload), in ``order`` then name order, and calls
``process(window)`` on each drained :class:`~flamed.sampling.contract.Window` before
the window is stored.  See docs/daemon.md ("Window processors").
"""

from __future__ import annotations

from typing import Any

from flamed import plugins
from flamed.daemon.processors.base import ProcessorContext, WindowProcessor
from flamed.errors import ConfigError

__all__ = ["ProcessorContext", "WindowProcessor", "discover", "processor_options"]


def discover() -> list[type[WindowProcessor]]:
    found = plugins.discover(__name__, __path__, WindowProcessor)
    return sorted(found.values(), key=lambda c: (c.order, c.name))


def processor_options(processors: Any, classes: list[type[WindowProcessor]] | None = None
                      ) -> dict[str, tuple[type[WindowProcessor], Any]]:
    """Every ``[processors.NAME]`` table validated into its options; raises ConfigError naming the key.

    ``processors`` is :attr:`DaemonConfig.processors`.  The daemon calls this
    before it compiles anything (start, reload) and ``--check-config`` calls
    it too, so a bad processor value never stops a daemon that already began.
    """
    from flamed.daemon.config import build_options  # noqa: PLC0415 - config imports nothing of ours

    by_name = {c.name: c for c in (discover() if classes is None else classes)}
    for name in processors:
        if name not in by_name:
            raise ConfigError(f"processors.{name}: unknown processor (known: {', '.join(by_name) or 'none'})")
    out: dict[str, tuple[type[WindowProcessor], Any]] = {}
    for name, cls in by_name.items():
        raw = processors.get(name, {})
        opts = build_options(cls.options_class, raw, f"processors.{name}") if cls.options_class else None
        out[name] = (cls, opts)
    return out
