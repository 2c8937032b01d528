"""Brendan Gregg's folded-stack format: ``frame;frame;frame COUNT`` per line.

Reading follows what flamegraph.pl accepts -- the count is the number after
the last run of whitespace, integer or decimal, and the stack is everything
before it, so frames may contain spaces, commas, ``<>``, ``::`` and
parentheses -- and is more forgiving where flamegraph.pl silently drops data:
CRLF line ends, blank lines and ``#`` comments are accepted, invalid UTF-8 is
kept byte-exact (see :func:`flamed.model.decode_frame`), gzip input is
recognised by magic.  A line with no count is malformed: it is reported with
its file and line number, and either skipped and counted (default) or fatal
(``strict``).

Writing sorts the stacks so output is byte-stable, and refuses a weight the
reader would refuse (more than :data:`MAX_COUNT`), such as two counts summed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

from flamed.errors import FlamedError, InputError
from flamed.model import (
    EMPTY_STACK_FRAME,
    INT64_MAX,
    Profile,
    Stack,
    Weight,
    encode_frame,
    format_weight,
    stack_excerpt,
)

_COUNT = re.compile(r"^[0-9]+(?:\.[0-9]*)?$")
_LINE_WS = re.compile(r"^(.*?)\s+([0-9]+(?:\.[0-9]*)?)$", re.S)


@dataclass
class ReadStats:
    """What a reader saw: lines, records, and the malformed lines it skipped."""

    lines: int = 0
    records: int = 0
    skipped: int = 0
    #: Of ``skipped``, the records of formats without lines (a speedscope file's samples and events).
    skipped_samples: int = 0
    first_errors: list[str] = field(default_factory=list)
    max_errors_kept: int = 5
    #: Remarks for stderr that are not malformed lines (which event a perf
    #: script's sample stream kept, and what it left out).
    notes: list[str] = field(default_factory=list)

    def skip(self, source: str, line: int, why: str) -> None:
        self.skipped += 1
        if len(self.first_errors) < self.max_errors_kept:
            self.first_errors.append(f"{source}:{line}: {why}")

    def skip_sample(self, source: str, where: str, why: str) -> None:
        """A malformed record of a format without lines: ``where`` says which (``profile 2, sample 7``)."""
        self.skipped += 1
        self.skipped_samples += 1
        if len(self.first_errors) < self.max_errors_kept:
            self.first_errors.append(f"{source}: {where}: {why}")

    def merge(self, other: ReadStats) -> None:
        self.lines += other.lines
        self.records += other.records
        self.skipped += other.skipped
        self.skipped_samples += other.skipped_samples
        self.notes.extend(other.notes)
        room = self.max_errors_kept - len(self.first_errors)
        if room > 0:
            self.first_errors.extend(other.first_errors[:room])

    def summary(self) -> str | None:
        if not self.skipped:
            return None
        plural = "s" if self.skipped != 1 else ""
        if not self.skipped_samples:
            what = f"line{plural}"
        elif self.skipped_samples == self.skipped:
            what = f"sample{plural}"
        else:
            what = "lines and samples"
        s = f"skipped {self.skipped} malformed {what}"
        if self.first_errors:
            s += " (first: " + self.first_errors[0] + ")"
        return s


#: Largest count accepted (int64, what pprof and the other formats can carry);
#: beyond it a "count" is garbage, and int() of >4300 digits even raises.
MAX_COUNT = INT64_MAX


def _parse_count(text: str) -> Weight | None:
    """The count, or ``None`` when it is out of range (the line is then malformed)."""
    if len(text.partition(".")[0].lstrip("0")) > 19:
        return None
    w: Weight = float(text) if "." in text else int(text)
    return w if w <= MAX_COUNT else None


#: What a line that is not a record was expected to be.
EXPECTED = "expected 'frame;frame;... COUNT'"
_BAD_COUNT = re.compile(r"\s(-?)([0-9]+(?:\.[0-9]*)?)\s*$")


def malformed_why(text: str) -> str:
    """Why ``text`` (a line :func:`parse_line` refused) is not a record: what is
    wrong with its count when it ends in one, else what a record looks like."""
    m = _BAD_COUNT.search(text)
    if m is not None and text[: m.start()].strip():
        count = m[1] + m[2]
        shown = count if len(count) <= 40 else count[:40] + "..."
        if m[1]:
            return f"count {shown} is negative: a count of samples is 0 or more"
        if _parse_count(m[2]) is None:
            return f"count {shown} is over the int64 maximum ({MAX_COUNT})"
    return EXPECTED


def parse_line(text: str) -> tuple[Stack, Weight] | None:
    """Parse one decoded line (no line end). ``None`` if it is not a record."""
    stack_text, sep, count = text.rpartition(" ")
    if not sep or not _COUNT.match(count):
        m = _LINE_WS.match(text)
        if m is None:
            return None
        stack_text, count = m.group(1), m.group(2)
    weight = _parse_count(count)
    if weight is None:
        return None
    stack_text = stack_text.rstrip()
    if not stack_text:
        return (EMPTY_STACK_FRAME,), weight
    return tuple(stack_text.split(";")), weight


#: difffolded.pl's line: ``stack BEFORE AFTER`` (two counts).
_DIFF_LINE = re.compile(rb"^(.*?)[ \t]+([0-9]+(?:\.[0-9]*)?)[ \t]+([0-9]+(?:\.[0-9]*)?)[ \t\r]*$")


def is_differential(head: bytes) -> bool:
    """True when every record line of ``head`` ends in two counts: difffolded.pl's
    ``stack BEFORE AFTER`` lines, which folded readers would take for a stack whose
    leaf ends in the BEFORE count (``cc1 7007007``).  A few lines that are
    neither (``a;b 3 -1``, a stray message: one in 20, at least one, fewer than
    the good ones) are skipped as malformed by the differential reader instead
    of turning the whole file into folded text with every BEFORE count glued
    to a leaf; more of them (perf script's frame lines under a header that
    happens to end in two numbers, or its lines without call chains, indented)
    and it is not differential."""
    lines = head.split(b"\n")
    if len(lines) > 1 and not head.endswith(b"\n"):
        lines.pop()  # cut by the head's size
    good = bad = 0
    for ln in lines[:1000]:
        if not ln.strip() or ln.startswith(b"#"):
            continue
        if ln[:1].isspace():
            # Not difffolded.pl's (its stacks start flush left, as folded ones do):
            # perf script without call chains pads the command to 16 columns, and
            # "-F comm,tid,period" ends every line in two numbers too.
            bad += 1
        elif _DIFF_LINE.match(ln) is not None:
            good += 1
        elif parse_line(ln.decode("utf-8", "surrogateescape").rstrip("\r")) is not None:
            return False  # a plain folded record
        else:
            bad += 1
    return good > bad and bad <= max(1, (good + bad) // 20)


def iter_differential(
    stream: BinaryIO | Iterable[bytes],
    *,
    source: str = "<input>",
    strict: bool = False,
    stats: ReadStats | None = None,
) -> Iterator[tuple[Stack, Weight, Weight]]:
    """Yield ``(stack, before, after)`` for each ``stack BEFORE AFTER`` line."""
    st = stats if stats is not None else ReadStats()
    lineno = 0
    for raw in stream:
        lineno += 1
        st.lines += 1
        if not raw.strip() or raw.startswith(b"#"):
            continue
        m = _DIFF_LINE.match(raw.rstrip(b"\n"))
        b = a = None
        if m is not None:
            b = _parse_count(m.group(2).decode())
            a = _parse_count(m.group(3).decode())
        if m is None or b is None or a is None:
            why = "expected difffolded.pl's 'frame;frame;... BEFORE AFTER'"
            if strict:
                raise InputError(why + f", got {raw[:80]!r}", source=source, line=lineno)
            st.skip(source, lineno, why)
            continue
        st.records += 1
        text = m.group(1).decode("utf-8", "surrogateescape").rstrip()
        yield (tuple(text.split(";")) if text else (EMPTY_STACK_FRAME,)), b, a


def iter_folded(
    stream: BinaryIO | Iterable[bytes],
    *,
    source: str = "<input>",
    strict: bool = False,
    stats: ReadStats | None = None,
    first_line: int = 1,
) -> Iterator[tuple[Stack, Weight]]:
    """Yield ``(stack, count)`` for each record of a folded stream."""
    st = stats if stats is not None else ReadStats()
    lineno = first_line - 1
    for raw in stream:
        lineno += 1
        st.lines += 1
        text = raw.decode("utf-8", "surrogateescape").rstrip("\r\n")
        if not text or text.isspace() or text.startswith("#"):
            continue
        rec = parse_line(text)
        if rec is None:
            why = malformed_why(text)
            if strict:
                raise InputError(why + f", got {text[:80]!r}", source=source, line=lineno)
            st.skip(source, lineno, why)
            continue
        st.records += 1
        yield rec


def read_folded(
    stream: BinaryIO | Iterable[bytes],
    *,
    source: str = "<input>",
    strict: bool = False,
    stats: ReadStats | None = None,
    profile: Profile | None = None,
) -> Profile:
    """Read a folded stream into a Profile (or add it to ``profile``)."""
    p = profile if profile is not None else Profile()
    stacks = p.stacks
    for stack, w in iter_folded(stream, source=source, strict=strict, stats=stats):
        stacks[stack] = stacks.get(stack, 0) + w
    return p


def folded_line(stack: Stack, weight: Weight) -> bytes:
    """One record; a weight past :data:`MAX_COUNT` (duplicate stacks summed) is an error,
    since no folded reader, flamed's included, would read it back."""
    if weight > MAX_COUNT:
        raise FlamedError(
            f"stack {stack_excerpt(stack)!r} weighs {format_weight(weight)}, more than {MAX_COUNT}, the largest count "
            "folded text carries (int64, as pprof); scale the input down"
        )
    return encode_frame(";".join(stack)) + b" " + format_weight(weight).encode() + b"\n"


def write_folded(profile: Profile | Iterable[tuple[Stack, Weight]], out: BinaryIO) -> int:
    """Write stacks sorted by frames; returns the number of lines written."""
    items = profile.sorted_items() if isinstance(profile, Profile) else sorted(profile, key=lambda kv: kv[0])
    return write_lines((folded_line(stack, w) for stack, w in items), out)


def write_lines(lines: Iterable[bytes], out: BinaryIO) -> int:
    """Write folded lines a few thousand (at most ~256 KiB) at a time; returns how many."""
    n = 0
    size = 0
    buf: list[bytes] = []
    for line in lines:
        buf.append(line)
        n += 1
        size += len(line)
        if len(buf) >= 4096 or size >= 1 << 18:
            out.write(b"".join(buf))
            buf.clear()
            size = 0
    if buf:
        out.write(b"".join(buf))
    return n
