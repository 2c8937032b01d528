"""Reading CPython's frames: layout tables, process discovery, symbolization.

The BPF walker (bpf/) reads one ``struct flamed_pyproc`` per process
(:meth:`Layout.pack`); :func:`probe` finds the interpreter of a pid,
:class:`CodeSymbolizer` turns the (code address, instruction) pairs the
walker emits into ``name (file:line)`` frames and :func:`walk_memory` is the
user-space reference walker (``process.walk`` for a pid).  Modules depend
downwards only: errors, layout, memory, elf, btf; objects and walk; process;
symbolize.  See docs/cpython.md.
"""

from __future__ import annotations

from flamed.sampling.cpython.errors import CPythonError, LayoutError, UnsupportedVersion
from flamed.sampling.cpython.layout import Layout, layout_for

__all__ = ["CPythonError", "Layout", "LayoutError", "UnsupportedVersion", "layout_for"]
