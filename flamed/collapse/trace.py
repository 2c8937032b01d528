"""Timestamped traces: one sample per line, ``TIMESTAMP STACK [COUNT]``.

``TIMESTAMP`` is a number: with a decimal point it is seconds (``1700000000.123456789``,
up to 9 decimals, read exactly, no float rounding), without one it is
nanoseconds (``1700000000123456789``).  ``STACK`` is folded (``a;b;c``, root
first, frames may contain spaces).  ``COUNT`` is optional (default 1): the last
token is taken as the count when it is a number, so a stack whose leaf frame
ends in `` <digits>`` must be written with an explicit count (flamed always
writes one).  A root frame ``comm-PID[/TID]`` names the task
(:func:`flamed.model.parse_task_frame`); ``flamed merge`` remaps those ids.
``#`` comments and blank lines are skipped; flamed's own traces start with
``# flamed trace`` so they are recognised even when empty.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import BinaryIO

from flamed.collapse.base import ChunkParser, ChunkResult, CollapseOptions, Collapser, first_lines, text_lines
from flamed.errors import InputError
from flamed.folded import MAX_COUNT, ReadStats
from flamed.model import EMPTY_STACK_FRAME, INT64_MAX, Sample, Stack, Weight, parse_task_frame

TRACE_MAGIC = b"# flamed trace"
_TRACE_LINE = re.compile(rb"^[0-9]+(?:\.[0-9]{1,9})?[ \t]+\S")
_COUNT = re.compile(r"^[0-9]+(?:\.[0-9]*)?$")
#: What bytes.strip() takes away (str.strip() also takes Unicode spaces and \x1c-\x1f).
_ASCII_SPACE = " \t\n\r\x0b\x0c"
#: What is a number but not a count: negative, or in exponent notation.
_BAD_COUNT = re.compile(r"^(?:-[0-9]+(?:\.[0-9]*)?|[0-9]+(?:\.[0-9]*)?[eE][-+]?[0-9]+)$")
#: Guessing tolerates one bad line in 20 (at least one) among at least 4 good ones.
_GUESS_BAD_SHARE = 20
_GUESS_MIN_GOOD = 4


def parse_timestamp(tok: str) -> int | None:
    """Nanoseconds of a trace timestamp (seconds with decimals, or integer ns); None if invalid."""
    sec, dot, frac = tok.partition(".")
    if not sec.isascii() or not sec.isdigit() or len(sec) > 19:
        return None
    if not dot:
        ns = int(sec)
    elif not frac or len(frac) > 9 or not frac.isascii() or not frac.isdigit():
        return None
    else:
        ns = int(sec) * 1_000_000_000 + int(frac.ljust(9, "0"))
    return ns if ns <= INT64_MAX else None  # past 2262: no time any output (pprof, the viewer) can hold


def format_timestamp(ns: int, style: str = "ns") -> str:
    """``ns`` as written in a trace: integer ns, or ``style="seconds"`` with 9 decimals."""
    if style == "seconds":
        return f"{ns // 1_000_000_000}.{ns % 1_000_000_000:09d}"
    return str(ns)


def parse_trace_line(line: str) -> tuple[int, Stack, Weight] | None:
    """``(time_ns, stack, weight)`` of one decoded trace line (no line end), or None."""
    ts, sep, rest = line.partition(" ")
    if not sep:
        ts, sep, rest = line.partition("\t")
        if not sep:
            return None
    t = parse_timestamp(ts)
    if t is None:
        return None
    # ASCII white space only, as the merge's line-level path (bytes.strip) takes it:
    # a frame ending in a no-break space or U+3000 keeps it on either path.
    rest = rest.strip(_ASCII_SPACE)
    if not rest:
        return None
    weight: Weight = 1
    cut = max(rest.rfind(" "), rest.rfind("\t"))  # the count after a space or a tab, as in folded text
    head, sp, cnt = (rest[:cut], rest[cut], rest[cut + 1:]) if cut >= 0 else ("", "", rest)
    if sp and _BAD_COUNT.match(cnt) and head.strip(_ASCII_SPACE):
        return None  # -3, 1e3: a count, and not one a weight can be (folded text refuses them too)
    if sp and _COUNT.match(cnt) and head.strip(_ASCII_SPACE):
        if len(cnt.partition(".")[0]) > 19:
            return None
        weight = float(cnt) if "." in cnt else int(cnt)
        if weight > MAX_COUNT:
            return None
        rest = head.rstrip(_ASCII_SPACE)
    return t, tuple(rest.split(";")) if rest else (EMPTY_STACK_FRAME,), weight


class TraceCollapser(Collapser):
    name = "trace"
    description = "timestamped trace: 'TIMESTAMP STACK [COUNT]' per line (seconds.decimals or integer ns)"
    timestamped = True

    def detect(self, head: bytes) -> int:
        if head.startswith(TRACE_MAGIC):
            return 100
        lines = [ln for ln in first_lines(head) if ln.strip() and not ln.startswith(b"#")]
        if not lines:
            return 0
        hits = 0
        for ln in lines:
            if not _TRACE_LINE.match(ln):
                continue
            # "123 5" alone is as much folded as trace: need a stack after the timestamp.
            rest = ln.split(None, 1)[1] if len(ln.split(None, 1)) > 1 else b""
            if b";" in rest or len(rest.split()) >= 2 or not rest.strip().isdigit():
                hits += 1
        if hits == len(lines):
            return 80
        # A few bad lines (a truncated write, a stray message) must not turn a trace into
        # "folded", which has no timestamps (merge then refuses it); the parser skips and
        # reports them.  Enough good lines that a folded file with numeric root frames
        # is not taken for a trace by chance.
        bad = len(lines) - hits
        if hits >= _GUESS_MIN_GOOD and bad <= max(1, len(lines) // _GUESS_BAD_SHARE):
            return 75
        return 0

    def parser(self, options: CollapseOptions) -> ChunkParser:
        return TraceParser(options)

    def samples(
        self,
        stream: BinaryIO,
        options: CollapseOptions,
        *,
        source: str,
        where: list[int] | None = None,
        stats: ReadStats | None = None,
    ) -> Iterator[Sample]:
        return iter_trace(stream, source=source, strict=options.strict, where=where, stats=stats)


class TraceParser(ChunkParser):
    def parse(self, data: bytes, *, source: str, first_line: int) -> ChunkResult:
        res = ChunkResult()
        group = res.group("")
        lines = text_lines(data)
        lo: int | None = None
        hi: int | None = None
        records = 0
        for n, line in enumerate(lines):
            if not line or line[0] == "#" or line.isspace():
                continue
            rec = parse_trace_line(line.rstrip("\r"))
            if rec is None:
                self.malformed(res, source, first_line + n, "expected 'TIMESTAMP STACK [COUNT]'")
                continue
            t, stack, w = rec
            key = ";".join(stack)
            group[key] = group.get(key, 0) + w
            records += 1
            if lo is None or t < lo:
                lo = t
            if hi is None or t > hi:
                hi = t
        res.start_ns, res.end_ns = lo, hi
        res.stats.records += records
        return res


def iter_trace(
    stream: BinaryIO,
    *,
    source: str,
    strict: bool = False,
    skipped: list[int] | None = None,
    where: list[int] | None = None,
    stats: ReadStats | None = None,
) -> Iterator[Sample]:
    """Samples of a trace in file order; the task ids come from a ``comm-PID[/TID]`` root frame.

    Malformed lines raise under ``strict``, else are skipped (and counted in
    ``skipped[0]`` when a list is given, and in ``stats`` with their line).
    """
    lineno = 0
    tasks: dict[str, tuple[int | None, int | None]] = {}
    for raw in stream:
        lineno += 1
        line = raw.decode("utf-8", "surrogateescape").rstrip("\r\n")
        if not line or line[0] == "#" or line.isspace():
            continue
        rec = parse_trace_line(line)
        if rec is None:
            if strict:
                raise InputError("expected 'TIMESTAMP STACK [COUNT]'", source=source, line=lineno)
            if skipped is not None:
                skipped[0] += 1
            if stats is not None:
                stats.skip(source, lineno, "expected 'TIMESTAMP STACK [COUNT]'")
            continue
        t, stack, w = rec
        root = stack[0]
        ids = tasks.get(root)
        if ids is None:
            task = parse_task_frame(root)
            ids = (task.pid, task.tid)
            if len(tasks) < 100_000:
                tasks[root] = ids
        if where is not None:
            where[0] = lineno
        yield Sample(time_ns=t, stack=stack, weight=w, pid=ids[0], tid=ids[1])
