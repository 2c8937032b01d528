"""Counting folded text fast, for renderers that do not need a Profile's tuples.

:func:`flamed.folded.read_folded` builds a tuple of frames for every line;
for a million-line file most lines repeat a stack, and splitting and hashing
the tuples costs most of the run.  :func:`count_folded` sums weights by the
raw stack *text* first (one ``rpartition`` and one ``int`` per line, in
chunks) and leaves the splitting to whoever needs frames, once per distinct
stack.  Lines the fast path cannot take (comments, blanks, decimals, tabs,
malformed lines) go through :func:`flamed.folded.parse_line`, so the two
readers accept and reject exactly the same lines.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import BinaryIO

from flamed.errors import InputError
from flamed.folded import MAX_COUNT, ReadStats, parse_line
from flamed.model import EMPTY_STACK_FRAME, Profile, Weight, decode_frame, encode_frame

CHUNK = 1 << 22
_EMPTY = encode_frame(EMPTY_STACK_FRAME)


def count_folded(
    stream: BinaryIO,
    *,
    counts: dict[bytes, Weight] | None = None,
    source: str = "<input>",
    strict: bool = False,
    stats: ReadStats | None = None,
) -> dict[bytes, Weight]:
    """Add the weights of a folded stream to ``counts`` keyed by stack text (``a;b;c``)."""
    d: dict[bytes, Weight] = counts if counts is not None else {}
    st = stats if stats is not None else ReadStats()
    lineno = 0
    rest = b""
    records = 0
    while True:
        chunk = stream.read(CHUNK)
        if not chunk:
            break
        lines = (rest + chunk).split(b"\n") if rest else chunk.split(b"\n")
        rest = lines.pop()
        for line in lines:
            lineno += 1
            stack, sep, cnt = line.rpartition(b" ")
            # Only plain digits take the fast path (int() would also accept '+5',
            # '1_0' and blanks, which the folded grammar does not); a CR of a CRLF
            # line end, '#' comments, huge counts go the exact way.
            digits = cnt.isdigit() or (cnt[-1:] == b"\r" and (cnt := cnt[:-1]).isdigit())
            if digits and stack and len(cnt) < 19 and line[0] != 35:
                w: Weight = int(cnt)
                last = stack[-1]
                if last <= 0x20 or last >= 0x80:
                    # Possibly trailing whitespace (str.rstrip's idea of it, Unicode
                    # included): strip it the way read_folded does.
                    text = decode_frame(stack).rstrip()
                    stack = encode_frame(text) if text else _EMPTY
            else:
                rec = _slow(line, lineno, source, strict, st)
                if rec is None:
                    continue
                stack, w = rec
            records += 1
            try:
                d[stack] += w
            except KeyError:
                d[stack] = w
    if rest:
        lineno += 1
        rec = _slow(rest, lineno, source, strict, st)
        if rec is not None:
            records += 1
            d[rec[0]] = d.get(rec[0], 0) + rec[1]
    st.lines += lineno
    st.records += records
    return d


def _slow(line: bytes, lineno: int, source: str, strict: bool, st: ReadStats) -> tuple[bytes, Weight] | None:
    text = decode_frame(line).rstrip("\r\n")
    if not text or text.isspace() or text.startswith("#"):
        return None
    rec = parse_line(text)
    if rec is None:
        why = "expected 'frame;frame;... COUNT'"
        if strict:
            raise InputError(why + f", got {text[:80]!r}", source=source, line=lineno)
        st.skip(source, lineno, why)
        return None
    return encode_frame(";".join(rec[0])), rec[1]


def profile_from_counts(counts: Iterable[tuple[bytes, Weight]] | dict[bytes, Weight], profile: Profile | None = None) -> Profile:
    """Turn stack text counts into a Profile (frames split once per distinct stack)."""
    p = profile if profile is not None else Profile()
    stacks = p.stacks
    items = counts.items() if isinstance(counts, dict) else counts
    for raw, w in items:
        key = tuple(decode_frame(raw).split(";"))
        stacks[key] = stacks.get(key, 0) + w
    return p
