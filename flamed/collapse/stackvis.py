"""node-stackvis's ``collapsed`` format (``stackvis dtrace collapsed``): ``frame,frame,frame COUNT``.

stackvis writes flamegraph.pl's folded layout with frames joined by ``,``
instead of ``;`` (root first, a space, the count).  It is recognised when no
line of the head has a ``;`` and some have a ``,``; a frame that itself held a
``,`` (C++ ``std::map<int, int>``) cannot be told from two frames -- stackvis
itself splits it the same way when it reads the file back.  A ``;`` in a frame
becomes ``:`` (:func:`flamed.model.sanitize_frame`'s rule).
"""

from __future__ import annotations

import re

from flamed.collapse.base import ChunkParser, ChunkResult, CollapseOptions, Collapser, first_lines
from flamed.collapse.folded import FoldedParser
from flamed.model import Weight

_LINE = re.compile(rb"^\S.*\s[0-9]+\r?$")


class StackvisCollapser(Collapser):
    name = "stackvis"
    description = "node-stackvis collapsed output: 'a,b,c COUNT' per line"

    def detect(self, head: bytes) -> int:
        lines = [ln for ln in first_lines(head) if ln.strip() and not ln.startswith(b"#")]
        if not lines or any(b";" in ln for ln in lines):
            return 0
        if not all(_LINE.match(ln) for ln in lines):
            return 0
        # Above folded's 50: folded would read each line as a single frame.
        return 55 if sum(1 for ln in lines if b"," in ln.rpartition(b" ")[0]) * 2 > len(lines) else 0

    def parser(self, options: CollapseOptions) -> ChunkParser:
        return StackvisParser(options)


class StackvisParser(FoldedParser):
    def parse(self, data: bytes, *, source: str, first_line: int) -> ChunkResult:
        res = super().parse(data, source=source, first_line=first_line)
        for ev in res.order:
            g = res.groups[ev]
            out: dict[str, Weight] = {}
            for k, w in g.items():
                nk = k.replace(";", ":").replace(",", ";")
                out[nk] = out.get(nk, 0) + w
            res.groups[ev] = out
        return res
