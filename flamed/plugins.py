"""Finding the modules of a plugin package (commands, input and output formats, processors).

Every public module of the package is imported, and every class defined in it
that subclasses ``base`` and has a non-empty ``name`` is returned, keyed by
that name.  Adding a format or a command is adding a module: no list to edit.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterable
from typing import TypeVar

T = TypeVar("T")


def discover(package: str, path: Iterable[str], base: type[T], skip: Iterable[str] = ("base",)) -> dict[str, type[T]]:
    """Subclasses of ``base`` with a ``name``, defined in the modules of ``package``, by name."""
    skipped = set(skip)
    found: dict[str, type[T]] = {}
    for info in pkgutil.iter_modules(list(path)):
        if info.name.startswith("_") or info.name in skipped:
            continue
        mod = importlib.import_module(f"{package}.{info.name}")
        for obj in vars(mod).values():
            if (
                isinstance(obj, type)
                and issubclass(obj, base)
                and obj is not base
                and bool(getattr(obj, "name", ""))
                and obj.__module__ == mod.__name__
            ):
                found[getattr(obj, "name")] = obj
    return found
