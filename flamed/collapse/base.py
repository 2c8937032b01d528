"""The protocol every input format implements, and what a parsed chunk gives back.

An input format (a *collapser*) answers three questions:

* :meth:`Collapser.detect` -- "is this yours?", asked on the first lines of an
  input, with a confidence so :func:`flamed.collapse.guess` can pick the best;
* :meth:`Collapser.boundary` -- where a buffer can be cut so that no sample is
  split across two chunks (the parallel driver cuts the input there);
* :meth:`Collapser.parser` -- a :class:`ChunkParser` that turns one chunk of
  bytes into a :class:`ChunkResult` (stacks to weights, per event).

Formats that keep time (timestamped traces, perf script) also implement
:meth:`Collapser.samples`, a stream of :class:`flamed.model.Sample` in input
order, which ``flamed merge`` merges by timestamp.

A chunk parser may keep caches between chunks (the perf parser caches parsed
frame blocks); the driver creates one per worker process, so results never
depend on which worker saw which chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import BinaryIO, ClassVar

from flamed.errors import InputError
from flamed.folded import ReadStats
from flamed.model import Sample, Weight

#: Annotations a collapser may add to frames (see :class:`CollapseOptions`).
ANNOTATIONS = ("kernel", "jit", "inline")


@dataclass(frozen=True)
class CollapseOptions:
    """How an input is collapsed. Every field says its default.

    include_pid: root frame ``comm-PID`` instead of ``comm`` (default False).
    include_tid: root frame ``comm-PID/TID`` (default False; implies include_pid).
    annotate: suffixes to add -- ``kernel`` (``_[k]``), ``jit`` (``_[j]``),
        ``inline`` (``_[i]``) (default: all three).
    event: keep only samples of this event (perf); ``None`` keeps the first
        named event seen and says so on stderr when there were others, samples
        without an event field among them (default None).
    weight: ``"period"`` weighs a perf sample by its period when the input has
        one (what stackcollapse-perf.pl and inferno do), ``"samples"`` counts
        each sample once (default "period").
    strict: a malformed line is an error instead of being skipped and counted
        (default False).
    """

    include_pid: bool = False
    include_tid: bool = False
    annotate: frozenset[str] = frozenset(ANNOTATIONS)
    event: str | None = None
    weight: str = "period"
    strict: bool = False


@dataclass
class ChunkResult:
    """What one chunk held: stacks per event, in the order events first appeared.

    Stacks are keyed by their folded text (``a;b;c``, root first; frames never
    contain ``;``): one string per stack is much cheaper to send between
    processes and to hash than a tuple of frames, and the driver splits each
    distinct stack once at the end.  Formats without events use the event
    name ``""``.  ``start_ns``/``end_ns``
    are the sample times seen, when the format has epoch timestamps.
    """

    groups: dict[str, dict[str, Weight]] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    stats: ReadStats = field(default_factory=ReadStats)
    start_ns: int | None = None
    end_ns: int | None = None
    #: One-line remarks for the user (e.g. "pid not in input"), deduplicated.
    notes: set[str] = field(default_factory=set)
    #: Samples of other events that ``event`` left out, by event: (samples, weight).
    dropped: dict[str, tuple[int, Weight]] = field(default_factory=dict)

    def group(self, event: str) -> dict[str, Weight]:
        g = self.groups.get(event)
        if g is None:
            g = self.groups[event] = {}
            self.order.append(event)
        return g

    def drop(self, event: str, samples: int, weight: Weight) -> None:
        """Count ``samples`` of ``event`` (of ``weight`` in all) as left out by ``event``."""
        n, w = self.dropped.get(event, (0, 0))
        self.dropped[event] = (n + samples, w + weight)

    def merge_dropped(self, other: ChunkResult) -> None:
        for ev, (n, w) in other.dropped.items():
            self.drop(ev, n, w)

    def add_time(self, t: int) -> None:
        if self.start_ns is None or t < self.start_ns:
            self.start_ns = t
        if self.end_ns is None or t > self.end_ns:
            self.end_ns = t


class ChunkParser:
    """Parses chunks of one input format; may cache between chunks."""

    def __init__(self, options: CollapseOptions) -> None:
        self.options = options
        #: While a parser parses text it rebuilt from the input's lines: the
        #: input's line number of a line number in that text.
        self.line_remap: Callable[[int], int] | None = None

    def parse(self, data: bytes, *, source: str, first_line: int) -> ChunkResult:
        raise NotImplementedError

    def malformed(self, result: ChunkResult, source: str, line: int | Callable[[], int], why: str) -> None:
        """Count a malformed line, or raise under ``strict``.

        ``line`` may be a function: finding a line number can mean counting
        newlines, which is only worth it for the few errors that are reported.
        """
        st = result.stats
        if self.options.strict or len(st.first_errors) < st.max_errors_kept:
            n = line() if callable(line) else line
            if self.line_remap is not None:
                n = self.line_remap(n)
            if self.options.strict:
                raise InputError(why, source=source, line=n)
            st.skip(source, n, why)
        else:
            st.skipped += 1


class Collapser:
    """An input format. Subclasses set ``name`` and implement the methods."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    #: True when :meth:`samples` gives timestamps (usable by ``flamed merge``).
    timestamped: ClassVar[bool] = False
    #: True when every weight is an int: the driver may then sum large files by
    #: byte range in parallel (float sums would depend on the grouping).
    integer_weights: ClassVar[bool] = False
    #: True when samples name an event (perf script): the driver then keeps one
    #: event of all the inputs of this kind.  Stacks of formats without events
    #: are always kept, whatever events other inputs of the same run hold.
    has_events: ClassVar[bool] = False

    def detect(self, head: bytes) -> int:
        """Confidence 0..100 that ``head`` (the first KBs of an input) is this format."""
        return 0

    def boundary(self, buf: bytes) -> int:
        """Index just past the last complete record in ``buf``; -1 if there is none.

        Default: records are lines.
        """
        i = buf.rfind(b"\n")
        return -1 if i < 0 else i + 1

    def parser(self, options: CollapseOptions) -> ChunkParser:
        raise NotImplementedError

    def samples(
        self,
        stream: BinaryIO,
        options: CollapseOptions,
        *,
        source: str,
        where: list[int] | None = None,
        stats: ReadStats | None = None,
    ) -> Iterator[Sample]:
        """Timestamped samples in input order (only for ``timestamped`` formats).

        ``where[0]`` is set to the input line of each sample before it is
        yielded, so a consumer can name the line at fault.  Malformed lines
        raise under ``options.strict``, else are skipped and counted in
        ``stats`` (with the first few ``file:line: why``), as collapse does.
        """
        raise InputError(f"{self.name} input carries no timestamps", source=source)


def block_boundary(buf: bytes) -> int:
    """Cut after the last blank line, else before the last unindented line.

    Multi-line records (perf script samples, bcc's default output) end at a
    blank line; a record's first line is never indented and its other lines
    always are, so when a buffer holds no blank line (perf script without
    ``-g``: one line per sample) an unindented line still starts a record.
    """
    i = buf.rfind(b"\n\n")
    if i >= 0:
        return i + 2
    j = buf.rfind(b"\n", 0, len(buf) - 1)
    while j >= 0:
        nxt = buf[j + 1 : j + 2]
        if nxt not in (b" ", b"\t", b"\n", b"\r"):
            return j + 1
        j = buf.rfind(b"\n", 0, j)
    return -1


def text_lines(data: bytes) -> list[str]:
    """The lines of a chunk as text (undecodable bytes kept as surrogates), without the
    empty string after a final newline."""
    lines = data.decode("utf-8", "surrogateescape").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines


def first_lines(head: bytes, n: int = 64) -> list[bytes]:
    """Up to ``n`` complete lines of ``head`` (the last, maybe cut, line dropped if more follow)."""
    lines = head.split(b"\n")
    if len(lines) > 1:
        lines = lines[:-1] if head and not head.endswith(b"\n") else lines
    return [ln.rstrip(b"\r") for ln in lines[:n]]
