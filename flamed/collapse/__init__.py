"""Input formats that collapse into Profiles: perf script, bcc, py-spy, traces, folded.

One module per format, each defining a :class:`flamed.collapse.base.Collapser`
subclass with a ``name``; they are discovered automatically.
:func:`guess` asks each one "is this yours?" on the head of an input and takes
the most confident.  :mod:`flamed.collapse.driver` runs a format over inputs,
in parallel, and its ``read_profile`` reads any input into one Profile.
"""

from __future__ import annotations

from flamed import plugins
from flamed.collapse.base import ChunkParser, ChunkResult, CollapseOptions, Collapser
from flamed.errors import InputError, UsageError

__all__ = ["ChunkParser", "ChunkResult", "CollapseOptions", "Collapser", "registry", "get", "guess", "names"]

_REGISTRY: dict[str, Collapser] | None = None
_SKIP = {"base", "driver"}


def registry() -> dict[str, Collapser]:
    global _REGISTRY
    if _REGISTRY is None:
        found = {name: cls() for name, cls in plugins.discover(__name__, __path__, Collapser, _SKIP).items()}
        _REGISTRY = dict(sorted(found.items()))
    return _REGISTRY


def names() -> list[str]:
    return list(registry())


def get(name: str) -> Collapser:
    reg = registry()
    try:
        return reg[name]
    except KeyError:
        raise UsageError(f"unknown input format {name!r}; known formats: {', '.join(reg)}") from None


def guess(head: bytes, *, source: str = "<input>") -> Collapser:
    """The format most confident that ``head`` is its own (ties: registry order)."""
    best: tuple[int, Collapser] | None = None
    for c in registry().values():
        score = c.detect(head)
        if score > 0 and (best is None or score > best[0]):
            best = (score, c)
    if best is None:
        if not head.strip():
            return get("folded")  # empty input: nothing to collapse, folded reads it as empty
        raise InputError(
            f"cannot tell the input format (tried {', '.join(registry())}); name it with --format",
            source=source,
        )
    return best[1]
