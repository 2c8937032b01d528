"""Window processors: the daemon's hook for code that rewrites drained windows.

Every module in this package that defines a subclass of
:class:`~flamed.daemon.processors.base.WindowProcessor` with a ``name`` is
discovered; the daemon creates one instance per processor at start (and
rebuilds it on reload), in ``order`` then name order, and calls
``process(window)`` on each drained :class:`~flamed.sampler.Window` before
the window is stored.  See docs/daemon.md ("Window processors").
"""

from __future__ import annotations

import importlib
import pkgutil

from flamed.daemon.processors.base import ProcessorContext, WindowProcessor

__all__ = ["ProcessorContext", "WindowProcessor", "discover"]


def discover() -> list[type[WindowProcessor]]:
    found: dict[str, type[WindowProcessor]] = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_") or info.name == "base":
            continue
        mod = importlib.import_module(f"{__name__}.{info.name}")
        for obj in vars(mod).values():
            if (
                isinstance(obj, type)
                and issubclass(obj, WindowProcessor)
                and obj is not WindowProcessor
                and obj.name
                and obj.__module__ == mod.__name__
            ):
                found[obj.name] = obj
    return sorted(found.values(), key=lambda c: (c.order, c.name))
