"""Window processors: the daemon's hook for code that rewrites drained windows.

Every module in this package that defines a subclass of
:class:`~flamed.daemon.processors.base.WindowProcessor` with a ``name`` is
discovered; the daemon creates one instance per processor at start (and
rebuilds it on reload), in ``order`` then name order, and calls
``process(window)`` on each drained :class:`~flamed.sampler.Window` before
the window is stored.  See docs/daemon.md ("Window processors").
"""

from __future__ import annotations

from flamed import plugins
from flamed.daemon.processors.base import ProcessorContext, WindowProcessor

__all__ = ["ProcessorContext", "WindowProcessor", "discover"]


def discover() -> list[type[WindowProcessor]]:
    found = plugins.discover(__name__, __path__, WindowProcessor)
    return sorted(found.values(), key=lambda c: (c.order, c.name))
