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

import os
from collections.abc import Iterable
from typing import BinaryIO

from flamed import progress
from flamed.errors import InputError
from flamed.fileio import bom_length, skip_bom
from flamed.folded import MAX_COUNT, ReadStats, malformed_why, parse_line
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
    first_line: int = 1,
) -> dict[bytes, Weight]:
    """Add the weights of a folded stream to ``counts`` keyed by stack text (``a;b;c``)."""
    d: dict[bytes, Weight] = counts if counts is not None else {}
    st = stats if stats is not None else ReadStats()
    lineno = first_line - 1
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
    st.lines += lineno - (first_line - 1)
    st.records += records
    return d


# -- parallel counting of one large file ---------------------------------------
#: Files smaller than this are counted in-process: forking costs more than it saves.
PARALLEL_MIN_BYTES = 64 << 20


class _Range:
    """``read`` limited to ``size`` bytes of an open file (a worker's share)."""

    def __init__(self, f: BinaryIO, size: int) -> None:
        self.f = f
        self.left = size

    def read(self, n: int = -1) -> bytes:
        if self.left <= 0:
            return b""
        data = self.f.read(self.left if n < 0 else min(n, self.left))
        self.left -= len(data)
        return data


def _line_starts(path: str, parts: int) -> list[int]:
    """Byte offsets splitting ``path`` into ``parts`` ranges at line starts."""
    size = os.path.getsize(path)
    cuts = [bom_length(path)]  # the first line starts after a byte order mark
    with open(path, "rb") as f:
        for i in range(1, parts):
            pos = max(size * i // parts, cuts[-1])
            f.seek(pos)
            f.readline()  # to the start of the next line
            cuts.append(min(f.tell(), size))
    cuts.append(size)
    return cuts


def _count_range(task: tuple[str, int, int, str, bool]) -> tuple[dict[bytes, Weight], ReadStats]:
    path, start, end, source, strict = task
    st = ReadStats()
    with open(path, "rb") as f:
        # Line numbers in messages stay those of the whole file.
        first = 1
        left = start
        while left > 0:
            buf = f.read(min(CHUNK, left))
            if not buf:
                break
            first += buf.count(b"\n")
            left -= len(buf)
        f.seek(start)
        d = count_folded(_Range(f, end - start), source=source, strict=strict, stats=st, first_line=first)  # type: ignore[arg-type]
    return d, st


def count_folded_file(
    path: str,
    *,
    counts: dict[bytes, Weight] | None = None,
    source: str | None = None,
    strict: bool = False,
    stats: ReadStats | None = None,
    jobs: int = 1,
) -> dict[bytes, Weight]:
    """:func:`count_folded` of a plain (not gzip) file, by ``jobs`` processes when it is large.

    Each process counts a range of lines; the sums are added up, so the result
    (and everything drawn from it, which is sorted) is the same for any ``jobs``.
    """
    d: dict[bytes, Weight] = counts if counts is not None else {}
    st = stats if stats is not None else ReadStats()
    src = source or path
    if jobs <= 1 or os.path.getsize(path) < PARALLEL_MIN_BYTES:
        with open(path, "rb") as f:
            skip_bom(f)
            return count_folded(f, counts=d, source=src, strict=strict, stats=st)
    cuts = _line_starts(path, jobs)
    tasks = [(path, a, b, src, strict) for a, b in zip(cuts, cuts[1:]) if b > a]
    import multiprocessing  # only when the input pays for processes: its import is a start-up cost

    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(len(tasks)) as pool:
        from flamed.workers import pool_workers, wait_result

        results = wait_result(pool.map_async(_count_range, tasks), pool_workers(pool))
    prog = progress.active()
    if prog is not None:
        prog.reached(path, cuts[-1])  # read by range in the workers, past open_input's count
    for part, pst in results:
        if not d:
            d.update(part)
        else:
            for k, w in part.items():
                d[k] = d.get(k, 0) + w
        st.merge(pst)
    return d


def _slow(line: bytes, lineno: int, source: str, strict: bool, st: ReadStats) -> tuple[bytes, Weight] | None:
    text = decode_frame(line).rstrip("\r\n")
    if not text or text.isspace() or text.startswith("#"):
        return None
    rec = parse_line(text)
    if rec is None:
        why = malformed_why(text)
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
