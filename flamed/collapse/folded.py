"""Folded stacks (``frame;frame;frame COUNT``), the output of every stackcollapse tool.

Parsing is :func:`flamed.folded.parse_line` (count after the last whitespace,
integer or decimal; CRLF, blank lines and ``#`` comments accepted), with a fast
path for the common ``stack INTEGER`` line that gives the same result.
"""

from __future__ import annotations

import re

from flamed.collapse.base import ChunkParser, ChunkResult, CollapseOptions, Collapser, first_lines
from flamed.folded import malformed_why, parse_line
from flamed.model import Weight

# (A negative count is folded text too: detected as such, its line is then refused
# with what is wrong with it, not "cannot tell the input format".)
_FOLDED_LINE = re.compile(rb"^\S.*\s-?[0-9]+(?:\.[0-9]*)?\r?$")


class FoldedCollapser(Collapser):
    name = "folded"
    description = "folded stacks: 'a;b;c COUNT' per line (flamegraph.pl input)"

    def detect(self, head: bytes) -> int:
        lines = [ln for ln in first_lines(head) if ln.strip() and not ln.startswith(b"#")]
        if not lines:
            return 1
        ok = sum(1 for ln in lines if _FOLDED_LINE.match(ln))
        if ok == len(lines):
            return 50
        return 20 if ok * 2 > len(lines) else 0

    def parser(self, options: CollapseOptions) -> ChunkParser:
        return FoldedParser(options)


_MAX_INT_DIGITS = 18  # below int64's 19 digits: the fast path never needs the range check


class FoldedParser(ChunkParser):
    def parse(self, data: bytes, *, source: str, first_line: int) -> ChunkResult:
        res = ChunkResult()
        group = res.group("")
        text = data.decode("utf-8", "surrogateescape")
        lines = text.split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        records = 0
        for n, line in enumerate(lines):
            if not line or line[0] == "#":
                continue
            stack_text, sep, count = line.rpartition(" ")
            # Fast path: "stack INTEGER" with one space and a sane count.
            if sep and count.isascii() and count.isdigit() and len(count) <= _MAX_INT_DIGITS and stack_text and not stack_text[-1].isspace():
                key = stack_text
                w: Weight = int(count)
            else:
                if line[-1] == "\r":
                    line = line[:-1]
                if not line or line.isspace() or line[0] == "#":
                    continue
                rec = parse_line(line)
                if rec is None:
                    self.malformed(res, source, first_line + n, malformed_why(line))
                    continue
                key = ";".join(rec[0])
                w = rec[1]
            records += 1
            group[key] = group.get(key, 0) + w
        res.stats.records += records
        return res
