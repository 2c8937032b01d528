"""py-spy's raw output (``py-spy record -f raw``): folded stacks of Python frames.

Frames look like ``func (path/file.py:LINE)``; with ``--threads`` (``-t``) the
root frame names the thread (``thread (0x7F..)`` or ``thread (TID): name``),
with ``--subprocesses`` a ``process PID:"cmdline"`` frame comes first.  The
text is folded, so it is read exactly like folded input; this module only
exists so the format is recognised (and named) when guessing.
"""

from __future__ import annotations

import re

from flamed.collapse.base import ChunkParser, CollapseOptions, Collapser, first_lines
from flamed.collapse.folded import FoldedParser

# Anchored at a frame start (line start or ';'): unanchored, search() retried
# [^;]+ from every byte of a long line, quadratic (1 s for a 12 KB line).
_PY_FRAME = re.compile(rb"(?:^|;)[^;]+ \([^;()]*\.pyx?(?::\d+)?\)(?:;|\s+[0-9]+\r?$)")
_PY_ROOT = re.compile(rb"^(?:process \d+:|thread \(0x[0-9A-Fa-f]+\)|thread \(\d+\))")


class PySpyCollapser(Collapser):
    name = "pyspy"
    description = "py-spy raw output (py-spy record -f raw)"

    def detect(self, head: bytes) -> int:
        lines = [ln for ln in first_lines(head) if ln.strip() and not ln.startswith(b"#")]
        if not lines:
            return 0
        hits = sum(1 for ln in lines if _PY_ROOT.match(ln) or _PY_FRAME.search(ln))
        return 75 if hits == len(lines) else (55 if hits * 2 > len(lines) else 0)

    def parser(self, options: CollapseOptions) -> ChunkParser:
        return FoldedParser(options)
