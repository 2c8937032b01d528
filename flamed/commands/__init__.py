"""Subcommands of the ``flamed`` CLI, one module each.

Every module here that defines a subclass of :class:`flamed.commands.base.Command`
is registered automatically, in the order of the class's ``order`` attribute
(then by name).  A command's class docstring is its help text.
"""

from __future__ import annotations

import importlib
import pkgutil

from flamed import plugins
from flamed.commands.base import Command


def discover(only: str | None = None) -> list[type[Command]]:
    """The commands, or only the one named ``only`` when a module of that name defines it.

    Importing one module instead of all of them is what keeps ``flamed svg``
    from paying for the daemon's, record's and merge's imports; a command whose
    name is not its module's (``flush``) falls back to the full discovery.
    """
    if only is not None and not only.startswith("_") and only != "base":
        if any(info.name == only for info in pkgutil.iter_modules(__path__)):
            mod = importlib.import_module(f"{__name__}.{only}")
            for obj in vars(mod).values():
                if isinstance(obj, type) and issubclass(obj, Command) and obj.__module__ == mod.__name__ and obj.name == only:
                    return [obj]
    found = plugins.discover(__name__, __path__, Command)
    return sorted(found.values(), key=lambda c: (c.order, c.name))
