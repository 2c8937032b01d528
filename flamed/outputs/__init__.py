"""Output formats (renderers and exporters), one module each, behind one registry.

Every module in this package that defines a subclass of
:class:`flamed.outputs.base.OutputFormat` with a ``name`` is registered.
Commands pick a format by ``--format NAME`` or by the output file's extension
(:func:`choose`).
"""

from __future__ import annotations

import os

from flamed import plugins
from flamed.errors import UsageError
from flamed.outputs.base import OutputFormat, OutputOptions

__all__ = ["OutputFormat", "OutputOptions", "registry", "get", "choose", "names"]

_REGISTRY: dict[str, OutputFormat] | None = None


def registry() -> dict[str, OutputFormat]:
    global _REGISTRY
    if _REGISTRY is None:
        # profile_pb2 is pprof's generated message code, not a format: importing it
        # (protobuf) would cost every command that lists the formats.
        skip = ("base", "profile_pb2")
        found = {name: cls() for name, cls in plugins.discover(__name__, __path__, OutputFormat, skip).items()}
        _REGISTRY = dict(sorted(found.items()))
    return _REGISTRY


def names() -> list[str]:
    return list(registry())


def get(name: str) -> OutputFormat:
    reg = registry()
    try:
        return reg[name]
    except KeyError:
        raise UsageError(f"unknown output format {name!r}; known formats: {', '.join(reg)}") from None


def choose(fmt: str | None, output: str | None, default: str = "folded") -> OutputFormat:
    """The format named by ``fmt``, else the one owning ``output``'s extension, else ``default``."""
    if fmt:
        return get(fmt)
    if output and output != "-":
        lower = os.path.basename(output).lower()
        best: tuple[int, OutputFormat] | None = None
        for f in registry().values():
            for ext in f.extensions:
                if lower.endswith(ext) and (best is None or len(ext) > best[0]):
                    best = (len(ext), f)
        if best is not None:
            return best[1]
    return get(default)
