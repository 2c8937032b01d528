"""Reading any input the renderers and exporters accept into a Profile.

Formats told apart by content, not name:

* pprof (gzipped or raw ``profile.proto``) and speedscope JSON -- read here,
  by the readers beside their writers (:mod:`flamed.outputs.pprof`,
  :mod:`flamed.outputs.speedscope`);
* everything else goes to :mod:`flamed.collapse` (perf script, bcc, py-spy,
  folded, ...) when it can tell the format, and is read as folded otherwise.

``sniff`` names the format of one input from its first bytes;
``stdin_head`` gives those bytes of standard input (gunzipped) and leaves
them to be read again.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import zlib
from collections.abc import Iterator, Sequence
from typing import Any, BinaryIO

from flamed.errors import FlamedError, InputError
from flamed.fastfolded import count_folded, profile_from_counts
from flamed.fileio import GZIP_MAGIC, UTF8_BOM, input_name, open_input, peek_stdin
from flamed.folded import ReadStats, is_differential
from flamed.model import Profile, Sample, Weight, merge_streams

HEAD = 4096
#: flamed.collapse formats whose text is folded stacks (py-spy's raw output is):
#: the fast folded reader takes them.
FOLDED_FORMATS = frozenset({"folded", "pyspy"})


def _head(f: BinaryIO) -> bytes:
    peek = getattr(f, "peek", None)
    if peek is not None:
        return bytes(peek(HEAD)[:HEAD])
    return b""


#: How far :func:`stdin_head` peeks for a head (compressed bytes): the end of a
#: first line longer than this is not waited for.
MAX_STDIN_PEEK = 64 << 20


def stdin_head(n: int = 64 << 10) -> bytes:
    """The head of standard input that ``read_head`` of the opened input gives (the
    first ``n`` bytes, on to the end of the first line), gunzipped when stdin is gzip;
    stdin is left whole for its reader (:func:`flamed.fileio.peek_stdin`)."""
    from flamed.collapse.driver import read_head

    want = max(n, 64 << 10)
    while True:
        raw = peek_stdin(want)
        ended = len(raw) < want
        data = raw
        if raw[:2] == GZIP_MAGIC:
            # Only the first member matters for a head; corrupt data is for the reader to report.
            z = zlib.decompressobj(16 + zlib.MAX_WBITS)
            try:
                data = z.decompress(raw)
            except zlib.error:
                return b""
            ended = ended or z.eof
        if data.startswith(UTF8_BOM):
            data = data[len(UTF8_BOM) :]  # open_input skips it too
        head = read_head(io.BytesIO(data), n)
        if len(head) < len(data) or ended or want >= MAX_STDIN_PEEK:
            return head
        want *= 2


def _looks_pprof(head: bytes) -> bool:
    # A serialized profile.proto starts with field 1 (sample_type, length-delimited:
    # 0x0a), a short length, then the ValueType's field 1 (varint: 0x08). No text
    # format starts with those three bytes.
    return len(head) >= 3 and head[0] == 0x0A and head[1] < 0x80 and head[2] == 0x08


def sniff(head: bytes) -> str:
    """``pprof``, ``speedscope`` or ``other`` for the first bytes of a (decompressed) input."""
    stripped = head.lstrip()
    if stripped.startswith(b"{") and (b"speedscope" in head or b'"profiles"' in head):
        return "speedscope"
    if _looks_pprof(head):
        return "pprof"
    return "other"


def foreign_kind(path: str) -> str:
    """``pprof`` or ``speedscope`` when the file at ``path`` is one (flamed's own
    exports, or another tool's), else ``other`` (standard input, a file that
    cannot be opened: left to the reader that reports it)."""
    if path == "-":
        return "other"
    try:
        with open_input(path) as f:
            return sniff(_head(f))
    except (OSError, FlamedError):
        return "other"


def _collapse_guess(head: bytes, source: str) -> Any | None:
    try:
        mod = importlib.import_module("flamed.collapse")
    except ImportError:
        return None
    guess = getattr(mod, "guess", None)
    if guess is None:
        return None
    try:
        c = guess(head, source=source)
    except InputError:
        return None
    return c


def _collapse_file(path: str, strict: bool, stats: ReadStats) -> Profile | None:
    """Read one input with flamed.collapse's driver (perf, bcc, py-spy, traces); ``None``
    when that package offers no driver."""
    try:
        driver = importlib.import_module("flamed.collapse.driver")
        base = importlib.import_module("flamed.collapse.base")
    except ImportError:
        return None
    collapse = getattr(driver, "collapse", None)
    if collapse is None:
        return None
    opts = base.CollapseOptions(strict=strict) if strict else base.CollapseOptions()
    result = collapse([None if path == "-" else path], options=opts)
    stats.merge(result.stats)
    return result.profile  # type: ignore[no-any-return]


def load_profile(
    paths: Sequence[str], *, strict: bool = False, stats: ReadStats | None = None
) -> Profile:
    """All ``paths`` (``-`` or none: stdin) read and summed into one Profile."""
    st = stats if stats is not None else ReadStats()
    folded_counts: dict[bytes, Weight] = {}
    profiles: list[Profile] = []
    for path in paths or ["-"]:
        source = input_name(path)
        with open_input(path) as f:
            head = _head(f)
            kind = sniff(head)
            if kind == "pprof":
                from flamed.outputs.pprof import read_pprof

                profiles.append(read_pprof(f.read(), source=source, strict=strict, stats=st))
                continue
            if kind == "speedscope":
                from flamed.outputs.speedscope import read_speedscope

                profiles.append(read_speedscope(f.read(), source=source, strict=strict, stats=st))
                continue
            collapser = _collapse_guess(head, source)
            if collapser is not None and getattr(collapser, "name", "folded") not in FOLDED_FORMATS and path != "-":
                got = _collapse_file(path, strict, st)
                if got is not None:
                    profiles.append(got)
                    continue
            _refuse_differential(head, source)
            count_folded(f, counts=folded_counts, source=source, strict=strict, stats=st)
    p = profile_from_counts(folded_counts) if folded_counts or not profiles else Profile()
    if profiles:
        first = profiles[0] if not folded_counts else p
        rest = profiles[1:] if not folded_counts else profiles
        p = first.merged(*rest) if rest else first
    return p


def open_sample_streams(
    paths: Sequence[str], stack: contextlib.ExitStack, *, strict: bool = False, stats: ReadStats | None = None,
    mixed: list[str] | None = None,
) -> Iterator[Sample] | None:
    """One time-ordered stream of all inputs' samples, when every input keeps time
    (perf script, timestamped traces); ``None`` otherwise.  When some inputs keep
    time and others do not, ``mixed`` (when given) gets the names of those that
    do not.  Files stay open in ``stack``.  Malformed lines are counted in
    ``stats`` as the stream is read (or raise under ``strict``)."""
    try:
        base = importlib.import_module("flamed.collapse.base")
    except ImportError:
        return None
    streams = []
    untimed: list[str] = []
    for path in paths:
        if path == "-":
            return None  # stdin can be read once: not looked at for this
        f = stack.enter_context(open_input(path))
        head = _head(f)
        c = _collapse_guess(head, input_name(path)) if sniff(head) == "other" else None
        if c is None or not getattr(c, "timestamped", False) or not callable(getattr(c, "samples", None)):
            untimed.append(input_name(path))
            continue
        opts = base.CollapseOptions(strict=strict) if strict else base.CollapseOptions()
        streams.append(c.samples(f, opts, source=input_name(path), stats=stats))
    if untimed:
        if streams and mixed is not None:
            mixed.extend(untimed)
        return None
    return merge_streams(streams) if streams else None


def untimed_note(untimed: Sequence[str], what: str) -> str:
    """What to say when a timeline was asked of inputs some of which (``untimed``) keep no time."""
    more = f" (and {len(untimed) - 1} more)" if len(untimed) > 1 else ""
    return (f"{untimed[0]}{more} keeps no sample times, so {what} is the summed profile of all the inputs, "
            "not a timeline: a timeline needs every input to keep time (perf script, traces)")


def differential_inputs(paths: Sequence[str]) -> bool:
    """True when the inputs are difffolded.pl's ``stack BEFORE AFTER`` lines (all of
    them; a mix is an error: one graph cannot be both)."""
    kinds = []
    for path in paths or ["-"]:
        if path == "-":
            kinds.append(is_differential(peek_stdin()))
            continue
        with open_input(path) as f:
            kinds.append(is_differential(_head(f)))
    if any(kinds) and not all(kinds):
        names = [input_name(p) for p, k in zip(paths, kinds) if k]
        raise InputError(
            "differential (BEFORE AFTER) and plain inputs mixed; draw them apart", source=", ".join(names)
        )
    return bool(kinds) and all(kinds)


def _refuse_differential(head: bytes, source: str) -> None:
    if is_differential(head):
        raise InputError(
            "this is differential folded input ('stack BEFORE AFTER', as difffolded.pl writes), not a profile: "
            "draw it with 'flamed svg', or give 'flamed diff' the two profiles",
            source=source,
        )


def all_folded(paths: Sequence[str]) -> bool:
    """True when every input is plain folded text (the renderers' fast path applies)."""
    for path in paths or ["-"]:
        if path == "-":
            continue  # stdin cannot be peeked twice; read it as folded
        with open_input(path) as f:
            head = _head(f)
            if sniff(head) != "other":
                return False
            c = _collapse_guess(head, input_name(path))
            if c is not None and getattr(c, "name", "folded") not in FOLDED_FORMATS:
                return False
    return True
