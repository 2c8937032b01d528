"""Subcommands of the ``flamed`` CLI, one module each.

Every module here that defines a subclass of :class:`flamed.commands.base.Command`
is registered automatically, in the order of the class's ``order`` attribute
(then by name).  A command's class docstring is its help text.
"""

from __future__ import annotations

from flamed import plugins
from flamed.commands.base import Command


def discover() -> list[type[Command]]:
    found = plugins.discover(__name__, __path__, Command)
    return sorted(found.values(), key=lambda c: (c.order, c.name))
