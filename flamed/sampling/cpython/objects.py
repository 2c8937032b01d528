"""Reading str and bytes objects out of a CPython process.

Both the layout check of a new process (:mod:`~flamed.sampling.cpython.process`
reads the name of the main thread's outermost code object) and the code
symbolizer (names, file names, line tables) read these objects, batched
through process_vm_readv with every size bounded.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from flamed.sampling.cpython.layout import Layout
from flamed.sampling.cpython.memory import ProcessMemory

MAX_NAME = 1024
#: Put after a str cut at its read limit (a name or file name longer than
#: that is shown by its beginning, not given up).
CUT_MARK = "..."
#: Characters a str read for a frame may claim and still be taken for one
#: (and cut): a longer length is a misread, not a name, and is refused as
#: before names were cut, so a wrong layout still fails validation.
MAX_LENGTH = 1 << 20
#: Bytes read of a str or bytes object in the first read: header plus a
#: typical name, so most strings need one read.
_SPECULATIVE = 160


def _decode_unicode(layout: Layout, head: bytes, limit: int) -> tuple[int, int, str, bool] | str:
    """(data offset, byte size to read, encoding, cut) of a compact str, or the
    failure reason.  A str of more than ``limit`` bytes is read to its last
    whole character within ``limit`` (``cut``)."""
    state = struct.unpack_from("<I", head, layout.unicode_state)[0]
    length = struct.unpack_from("<q", head, layout.unicode_length)[0]
    kind = (state >> 2) & 7
    compact = (state >> 5) & 1
    ascii_ = (state >> 6) & 1
    if not compact or kind not in (1, 2, 4) or not 0 <= length <= MAX_LENGTH or (ascii_ and kind != 1):
        return "bad_string"
    size = length * kind
    cut = size > limit
    if cut:
        size = limit // kind * kind
    if ascii_:
        return layout.unicode_ascii_size, size, "ascii", cut
    return layout.unicode_compact_size, size, {1: "latin-1", 2: "utf-16-le", 4: "utf-32-le"}[kind], cut


def _header_size(layout: Layout) -> int:
    return layout.unicode_compact_size


def read_unicode(mem: ProcessMemory, layout: Layout, addr: int, limit: int = MAX_NAME) -> str | None:
    """One compact str object of the process (None when unreadable or not a compact str)."""
    got = read_objects(mem, layout, [(addr, limit)], unicode=True)[0]
    return got if isinstance(got, str) else None


def read_objects(
    mem: ProcessMemory, layout: Layout, objs: Sequence[tuple[int, int]], *, unicode: bool
) -> list[str | bytes | None | tuple[str]]:
    """Read str (``unicode``) or bytes objects; a failure is ``(reason,)``."""
    first = [(addr, _header_size(layout) + _SPECULATIVE) for addr, _ in objs]
    heads = mem.read_many(first)
    out: list[str | bytes | None | tuple[str]] = [None] * len(objs)
    more: list[tuple[int, int, int, str, bool]] = []  # index, addr, size, encoding, cut
    for i, ((addr, limit), head) in enumerate(zip(objs, heads)):
        if head is None:
            # The speculative tail may cross into an unmapped page: retry the header alone.
            head = mem.read(addr, _header_size(layout))
            if head is None:
                out[i] = ("read_failed",)
                continue
        if unicode:
            dec = _decode_unicode(layout, head, limit)
            if isinstance(dec, str):
                out[i] = (dec,)
                continue
            off, size, enc, cut = dec
        else:
            # Bytes (line tables) are never cut: a partial table would give wrong lines.
            size = struct.unpack_from("<q", head, layout.bytes_size)[0]
            if size < 0 or size > limit:
                out[i] = ("bad_linetable",)
                continue
            off, enc, cut = layout.bytes_sval, "", False
        if off + size <= len(head):
            out[i] = _finish(head[off : off + size], enc, cut)
        else:
            more.append((i, addr + off, size, enc, cut))
    if more:
        datas = mem.read_many([(a, s) for _, a, s, _, _ in more]) if any(m[2] for m in more) else []
        for (i, _a, size, enc, cut), data in zip(more, datas):
            out[i] = ("read_failed",) if data is None else _finish(data, enc, cut)
    return out


def _finish(data: bytes, enc: str, cut: bool = False) -> str | bytes | tuple[str]:
    if not enc:
        return data
    try:
        text = data.decode(enc)
    except UnicodeDecodeError:
        return ("bad_string",)
    return text + CUT_MARK if cut else text
