"""Subcommands of the ``flamed`` CLI, one module each.

Every module here that defines a subclass of :class:`flamed.commands.base.Command`
is registered automatically, in the order of the class's ``order`` attribute
(then by name).  A command's class docstring is its help text.
"""

from __future__ import annotations

import importlib
import pkgutil

from flamed.commands.base import Command


def discover() -> list[type[Command]]:
    found: dict[str, type[Command]] = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_") or info.name == "base":
            continue
        mod = importlib.import_module(f"{__name__}.{info.name}")
        for obj in vars(mod).values():
            if isinstance(obj, type) and issubclass(obj, Command) and obj is not Command and obj.name:
                if obj.__module__ == mod.__name__:
                    found[obj.name] = obj
    return sorted(found.values(), key=lambda c: (c.order, c.name))
