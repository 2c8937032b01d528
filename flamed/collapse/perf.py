"""``perf script`` text, with or without ``-g`` and ``-F`` fields.

A sample is a header line followed by its frames (leaf first), one per line,
indented, and a blank line::

    worker 0 10719/10721 [001]   719.874582:    2004008 cpu-clock:ppp:
    \t            1384 recurse+0x34 (/tmp/flamed-capture/hot)
    \t            14bb worker+0x2b (/tmp/flamed-capture/hot)

The header is ``COMM PID[/TID] [CPU] TIME: PERIOD EVENT: TRAILING`` where every
field after the task may be missing (``perf script -F``).  ``COMM`` may hold
spaces and end in digits (``worker 0``), so the header is read around the
fields whose form is unambiguous: the timestamp (``719.874582:``), else the
event (first token ending in ``:``), and the task id is the token just before
them (and before ``[CPU]``).  Only when there is neither a time nor an event
field is the task id simply the last token.  Tracepoint headers carry
trailing fields (``comm=python3 pid=9910``); they are ignored.

Frames: ``IP SYMBOL[+OFFSET] (DSO)``, where the DSO is the last balanced
parenthesised group (paths may contain spaces and parentheses) and may be
absent; ``(inlined)`` marks a frame perf inlined into its caller.  The offset
is dropped; a ``;`` in a symbol (Rust's ``<[u8; 32] as T>::f``) becomes ``:``
(:func:`flamed.model.sanitize_frame`); everything else (parentheses, quotes,
``operator""``) is kept as perf printed it.  ``[unknown]`` symbols become
``[DSO-BASENAME]`` when the DSO is known.  Annotations: ``_[k]`` for kernel
DSOs (``[kernel.kallsyms]``, modules, ``vmlinux``), ``_[j]`` for perf JIT maps
(``/tmp/perf-PID.map``), ``_[i]`` for inlined frames.  A sample without frames
is kept as ``comm;[no frames]``.

Several events in one capture: ``--event`` picks one (the samples of the
others are counted, and the driver names them with their weight); by default the first
named event seen is kept (samples without an event field only when no sample
names one), and the driver says on stderr which one and what else there was,
with its weight.  The weight of a sample is its period when the header has one
(as stackcollapse-perf.pl and inferno do), else 1; ``--weight samples``
counts samples.

Speed: samples repeat the same frame block over and over, so the parser
caches ``frame block bytes -> frames`` and ``header without its timestamp ->
(root frame, event, period)``; both caches are bounded.
"""

from __future__ import annotations

import itertools
import operator
import re
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO, cast

from flamed.collapse.base import (
    ChunkParser,
    ChunkResult,
    CollapseOptions,
    Collapser,
    block_boundary,
    first_lines,
)
from flamed.folded import ReadStats
from flamed.model import EMPTY_STACK_FRAME, Sample, Weight, sanitize_frame, task_frame

_TOKEN = re.compile(r"\S+")
# Digit runs are bounded: int() refuses more than 4300 digits (ValueError; found by tests/fuzz).
_TIME = re.compile(r"^\d{1,19}\.\d{1,19}:$")
_TASK = re.compile(r"^(-?\d{1,19})(?:/(-?\d{1,19}))?$")
_CPU = re.compile(r"^\[\d+\]$")
_HEX = frozenset(b"0123456789abcdefABCDEF")
_HEXSTR = frozenset("0123456789abcdef")
# perf's JIT symbol maps (/tmp/perf-PID.map, or wherever TMPDIR was: /var/tmp in containers)
# and the DSOs `perf inject --jit` writes for jitdump (jitted-PID-N.so).
_JIT_MAP = re.compile(r"(?:^|/)(?:perf-\d+\.map|jitted-\d+-\d+\.so)$")
# An unindented frame line (perf before 3.x printed frames flush left): "IP SYMBOL (DSO)".
_FLUSH_FRAME = re.compile(rb"^[0-9a-f]{1,16} \S.*\)\s*$")
_HEADER_LINE = re.compile(rb"^\s*\S.*?\s\d+(?:/\d+)?\s+(?:\[\d+\]\s+)?\d+\.\d+:\s")
# Rust legacy mangling perf left undecoded: "$LT$", "$u7b$", ".." and a "::h<16 hex>" hash.
_RUST_HASH = re.compile(r"::h[0-9a-f]{16}$")
_RUST_ESC = re.compile(r"\$(SP|BP|RF|LT|GT|LP|RP|C|u[0-9a-f]{1,6})\$")
_RUST_NAMED = {"SP": "@", "BP": "*", "RF": "&", "LT": "<", "GT": ">", "LP": "(", "RP": ")", "C": ","}
# A Java class in perf's JVM-internal form ("Ljava/lang/Thread;::run"): flamegraph.pl's java
# palette expects "java/lang/Thread:::run".
_JAVA_CLASS = re.compile(r"^L(?=[A-Za-z_$][\w$]*(?:/[\w$]+)+(?:[;:.(]|$))")
#: Bracketed DSOs that are not the kernel.
_NOT_KERNEL = frozenset(
    {"[unknown]", "[vdso]", "[vsyscall]", "[vectors]", "[heap]", "[stack]", "[anon]", "[uprobes]", "[vvar]", "[jit]"}
)
# A -F+srcline line under a frame: "FILE:LINE", "??:0", maybe "(discriminator N)"; or,
# when perf found no source for the address, "DSO[ADDR]": "libc.so.6[29d90]",
# "[kernel.kallsyms][ffffffff813aeb13]" (the DSO's short name, the address in hex).
_SRCLINE = re.compile(rb"^(?:.+:(?:\d+|\?)(?:\s+\(discriminator \d+\))?|\S.*\[[0-9a-fA-F]+\])$")
#: What _line_frame gives for an indented line that is neither a frame nor a srcline
#: (never a frame text: frames are sanitised and contain no NUL).
_JUNK = "\x00unreadable frame line\x00"
_HEADER_HINT = re.compile(rb"^\S.*?\s\d+(?:/\d+)?\s+(?:\[\d+\]\s+)?\d+\.\d+:\s")
_FRAME_HINT = re.compile(rb"^\s+[0-9a-f]+ \S.*")

#: Cache bounds: enough for the distinct stacks of a long capture, small next to the 300 MB budget.
_BODY_CACHE_BYTES = 48 << 20
_HEADER_CACHE_ENTRIES = 100_000
_LINE_CACHE_ENTRIES = 200_000

_Header = tuple[str, str, int, str]  # root frame, event, period (0 = none), trailing text


class PerfCollapser(Collapser):
    name = "perf"
    description = "perf script text (perf record -g; perf script [-F ...])"
    timestamped = True
    has_events = True
    integer_weights = True

    def detect(self, head: bytes) -> int:
        lines = first_lines(head)
        score = 0
        flat = 0  # lines of perf script without -g and without a time field: "comm tid ... ip sym"
        other = 0
        for i, ln in enumerate(lines):
            if ln.startswith(b"#") or not ln:
                continue
            if _HEADER_HINT.match(ln):
                score = max(score, 70)
                if i + 1 < len(lines) and _FRAME_HINT.match(lines[i + 1]):
                    return 95
            elif ln[:1] in (b"\t", b" ") and _FRAME_HINT.match(ln) and not (ln[:1] == b" " and _is_padded_header(ln)):
                # (A space-padded header of a command named in hex digits reads as a frame too.)
                if ln.rstrip().endswith(b")"):
                    score = max(score, 60)
            elif i + 1 < len(lines) and _flush_left_sample(ln, lines[i + 1]):
                # perf before 3.x: "comm pid event:" then frames printed flush left.
                return 90
            elif i + 1 < len(lines) and _FRAME_HINT.match(lines[i + 1]) and _parses_as_header(ln):
                # "-F comm,tid,period,ip,sym": no time, no event, frames without DSOs.
                # An unindented task line followed by indented "ADDRESS SYMBOL" lines is
                # perf's sample layout, which no other format shares.
                score = max(score, 90)
            else:
                h = _parses_as_header(ln, full=True)
                if h is not None and h[5][:1].isalnum() and _HEXSTR.issuperset(h[5].split(" ", 1)[0]):
                    flat += 1
                elif h is not None and not h[5] and ln[:1] == b" " and (h[2] is not None or h[4]):
                    # "-F comm,tid,period" (or tid,period): a task and numbers, no frame at all,
                    # the command padded to 16 columns as no folded or differential line is.
                    flat += 1
                else:
                    other += 1
        if flat and not other:
            score = max(score, 55)  # above folded's 50: a folded line never ends in a symbol after an address
        return score

    def boundary(self, buf: bytes) -> int:
        return block_boundary(buf)

    def parser(self, options: CollapseOptions) -> PerfParser:
        return PerfParser(options)

    def samples(
        self,
        stream: BinaryIO,
        options: CollapseOptions,
        *,
        source: str,
        where: list[int] | None = None,
        stats: ReadStats | None = None,
    ) -> Iterator[Sample]:
        p = PerfParser(options)
        yield from p.iter_samples(stream, source=source, where=where, stats=stats)


class PerfParser(ChunkParser):
    def __init__(self, options: CollapseOptions) -> None:
        super().__init__(options)
        self._bodies: dict[bytes, str] = {}
        self._body_bytes = 0
        self._rests: dict[bytes, str] = {}
        self._headers: dict[bytes, _Header | None] = {}
        ann = options.annotate
        self._ann_kernel = "kernel" in ann
        self._ann_jit = "jit" in ann
        self._ann_inline = "inline" in ann
        self._by_period = options.weight == "period"
        self._want_event = options.event
        #: Indices of the unreadable lines of the last _frames_of call.
        self._junk: list[int] = []
        #: Index of the line that starts another sample, when the last _frames_of call gave None.
        self._split_at = 0

    # -- chunks ------------------------------------------------------------
    def parse(self, data: bytes, *, source: str, first_line: int) -> ChunkResult:
        res = ChunkResult()
        stats = res.stats
        want = self._want_event
        by_period = self._by_period
        bodies = self._bodies
        headers = self._headers
        cur_event: str | None = None
        cur_group: dict[str, Weight] = {}
        offset = 0
        n_blocks = 0
        header_key = _header_key_fast
        cut_input = not data.endswith(b"\n")  # only the input's last chunk can end so
        for block in data.split(b"\n\n"):
            start = offset
            offset += len(block) + 2
            if not block:
                continue
            if block[0] == 10 or block[0] == 35 or block[0] == 13:  # "\n", "#", "\r": blank lines, comments
                block, start = _skip_leading(block, start)
                if not block:
                    continue
            header, _, body = block.partition(b"\n")
            key = header_key(b"", header, 1)
            h = headers.get(key)
            if h is None:
                if key in headers:
                    # Known-bad header: count it again (it is another sample).
                    self.malformed(res, source, lambda: _line_at(data, start, first_line), "unrecognised perf script header")
                    continue
                h = self._parse_header(header)
                if len(headers) >= _HEADER_CACHE_ENTRIES:
                    headers.clear()
                headers[key] = h
                if h is None:
                    self.malformed(res, source, lambda: _line_at(data, start, first_line), "unrecognised perf script header")
                    continue
            if cut_input and _cut_short(data, start, header, body):
                self.malformed(res, source, lambda: _line_at(data, start, first_line), CUT_SHORT)
                continue
            root, event, period, trailing = h
            if want is not None and event != want and not _event_matches(event, want):
                if event not in res.groups:
                    res.group(event)  # remembered (empty) so an unknown --event can list what exists
                # Counted, so the driver can say what --event left out.
                res.drop(event, 1, period if (by_period and period) else 1)
                continue
            if event != cur_event:
                cur_event = event
                cur_group = res.group(event)
            frames = bodies.get(body)
            if frames is None:
                frames = self._parse_body(body, trailing, res, data, start, first_line, source)
            n_blocks += 1
            stack = root + frames
            w = period if (by_period and period) else 1
            cur_group[stack] = cur_group.get(stack, 0) + w
        stats.records += n_blocks
        return res

    def _parse_body(
        self,
        body: bytes,
        trailing: str,
        res: ChunkResult,
        data: bytes,
        start: int,
        first_line: int,
        source: str,
    ) -> str:
        """``;frame;frame...`` (root first) of a block's frame lines, cached when that is safe.

        Blocks repeat (the same stack sampled again), so they are cached by
        their bytes; a miss costs one dictionary lookup per line.
        """
        body_s = body.rstrip(b"\n\r ")
        if not body_s:
            return self._frames_of(b"", trailing) or ""
        out = self._frames_of(body_s, "")
        if out is None:
            # Another sample's header inside the block: perf script without -g
            # prints one line per sample and no blank lines between them.
            lines = body_s.split(b"\n")
            i = self._split_at
            self._parse_flat(lines[i:], res, data, start, first_line, source, i + 1)
            out = self._frames_of(b"\n".join(lines[:i]), trailing) or ""
            self._report_junk(res, source, lambda: _line_at(data, start, first_line))
            return out
        if self._junk:
            # Counted again each time the block recurs: not cached.
            self._report_junk(res, source, lambda: _line_at(data, start, first_line))
            return out
        if not trailing:
            if self._body_bytes > _BODY_CACHE_BYTES:
                self._bodies.clear()
                self._body_bytes = 0
            self._bodies[body] = out
            self._body_bytes += len(body) + len(out) + 100
        return out

    def _frames_of(self, body: bytes, trailing: str) -> str | None:
        """``;frame;frame...`` (root first) of indented frame lines; srcline lines are skipped.

        ``None`` when a line is not indented (another sample's header).

        Lines are cached as they are (``addr sym+off (dso)``: a hit for the
        same address) and, on a miss, without their address (a hit for the
        same symbol and offset at another address, e.g. ``[unknown]``).
        """
        lines = body.split(b"\n") if body else []
        junk: list[int] = []
        self._junk = junk
        # "IP SYM+OFF (DSO)" -> "SYM+OFF (DSO)" -> frame, in C-level passes over
        # the lines (no Python code per line): only texts never seen before reach
        # _line_frame, which checks the address and the indentation. (A srcline
        # or header line is never a cached text: those come from frame lines.)
        got: list[str | None] = list(map(self._rests.get, map(_THIRD, map(bytes.partition, map(bytes.lstrip, lines), _SPACES))))
        if None in got:
            in_stack = False  # a frame line came before: indented lines are frames (or junk) from here on
            for i, fr in enumerate(got):
                if fr is None:
                    fr = got[i] = self._line_frame(lines[i], in_stack)
                    if fr is None:
                        self._split_at = i
                        return None
                    if fr is _JUNK:
                        junk.append(i)
                        continue
                in_stack = in_stack or bool(fr)
        # ("" marks srcline lines: not frames.)
        if junk:
            frames: list[str] = [f for f in got if f and f is not _JUNK]
        else:
            frames = [f for f in got if f] if "" in got else cast("list[str]", got)
        if not frames and trailing:
            # No callchain: the header itself ends with "IP SYM (DSO)".
            ip, _, rest_t = trailing.partition(" ")
            if ip and _HEXSTR.issuperset(ip.lower()):
                frames.append(self._parse_rest(rest_t.encode("utf-8", "surrogateescape")))
        if not frames:
            frames.append(EMPTY_STACK_FRAME)
        frames.reverse()
        return ";" + ";".join(frames)

    def _line_frame(self, line: bytes, in_stack: bool = False) -> str | None:
        """The frame of one indented line, ``""`` for a line that is not a frame (srcline, blank),
        ``_JUNK`` for one that is nothing perf prints there, ``None`` for another sample's header
        (not cached).  ``in_stack``: a frame line came before it in the sample."""
        if line and _starts_sample(line, in_stack):
            return None
        s = line.strip()
        ip, _, rest = s.partition(b" ")
        if not ip or not _HEX.issuperset(ip):
            return "" if not s or _SRCLINE.match(s) else _JUNK
        fr = self._rests.get(rest)
        if fr is None:
            fr = self._parse_rest(rest)
            if not rest:
                return fr  # not cached: b"" is also what a srcline line's lookup key is
            if len(self._rests) >= _LINE_CACHE_ENTRIES:
                self._rests.clear()
            self._rests[rest] = fr
        return fr

    def _report_junk(self, res: ChunkResult, source: str, header_line: Callable[[], int]) -> None:
        """Count the unreadable lines of the last _frames_of call (or raise under ``--strict``)."""
        for i in self._junk:
            self.malformed(res, source, lambda: header_line() + 1 + i, "unreadable perf script frame line")

    def _parse_flat(
        self, lines: list[bytes], res: ChunkResult, data: bytes, start: int, first_line: int, source: str, skip: int
    ) -> None:
        """Samples that were not separated by blank lines, from their lines.

        perf script without ``-g`` prints one line per sample and no blank
        lines; concatenated captures can also run into each other.  Every
        unindented line starts a sample, indented lines are its frames,
        ``#`` comment lines are dropped.
        """
        records: list[bytes] = []
        cur: list[bytes] = []
        # The index in ``lines`` of each line of the rebuilt text (None: a blank
        # between records), so that an error in it names the input's own line.
        where: list[int | None] = []
        in_stack = False
        for j, ln in enumerate(lines):
            if not ln or ln == b"\r" or ln.startswith(b"#"):  # "\r": a blank line of CRLF text
                continue
            if not _starts_sample(ln, in_stack):
                if cur:
                    cur.append(ln)
                    where.append(j)
                    in_stack = in_stack or _is_frame_line(ln)
                continue
            if cur:
                records.append(b"\n".join(cur))
                where.append(None)
            cur = [ln]
            where.append(j)
            in_stack = False
        if cur:
            records.append(b"\n".join(cur))
        base = _line_at(data, start, first_line) + skip  # the input's line of lines[0]
        outer = self.line_remap

        def remap(n: int) -> int:
            k = n - base
            j = where[k] if 0 <= k < len(where) else None
            if j is None:  # not a line of a record: the nearest one before it
                j = next((w for w in reversed(where[: max(0, min(k, len(where)))]) if w is not None), 0)
            return outer(base + j) if outer is not None else base + j

        self.line_remap = remap
        try:
            # Ended by a newline, as every line of the input is: a text that is not is an input cut short.
            part = self.parse(b"\n\n".join(records) + b"\n", source=source, first_line=base)
        finally:
            self.line_remap = outer
        for ev in part.order:
            g = res.group(ev)
            for k, w in part.groups[ev].items():
                g[k] = g.get(k, 0) + w
        res.merge_dropped(part)
        res.stats.records += part.stats.records
        res.stats.skipped += part.stats.skipped
        res.stats.first_errors.extend(part.stats.first_errors[: max(0, 5 - len(res.stats.first_errors))])

    # -- frames ------------------------------------------------------------
    def _parse_rest(self, rest_b: bytes) -> str:
        """One frame from ``SYM[+OFF] [(DSO)] [(inlined)]`` (the part after the address)."""
        rest = rest_b.decode("utf-8", "surrogateescape").strip()
        if not rest:
            return "[unknown]"
        inlined = False
        if rest.endswith(" (inlined)"):
            inlined = True
            rest = rest[: -len(" (inlined)")].rstrip()
        sym, dso = _split_dso(rest)
        if dso is None and rest.startswith("(") and rest.endswith(")") and ") (" not in rest:
            sym, dso = "", rest[1:-1]  # no symbol at all: "IP  (DSO)"
        if "->" in sym and "operator->" not in sym and dso is not None and _JIT_MAP.search(dso):
            # perf-map-agent's unfoldall: a JIT frame with its inlined callees, "A->B->C" (caller first).
            parts = [self._parse_rest(f"{p} ({dso})".encode("utf-8", "surrogateescape")) for p in sym.split("->") if p]
            if len(parts) > 1:
                tag = "_[i]" if self._ann_inline else ""
                return ";".join([parts[0]] + [(p[:-4] if p.endswith("_[j]") else p) + tag for p in parts[1:]])
        # Strip the "+0x1f" offset perf prints since Linux 4.8.
        p = sym.rfind("+0x")
        if p > 0 and len(sym) > p + 3 and _HEXSTR.issuperset(sym[p + 3 :]):
            sym = sym[:p]
        if sym == "[unknown]" or not sym:
            if dso and dso != "[unknown]":
                base = dso.rsplit("/", 1)[-1]
                sym = base if base.startswith("[") and base.endswith("]") else f"[{base}]"
            else:
                sym = "[unknown]"
        if sym.startswith("L"):
            sym = _JAVA_CLASS.sub("", sym)
        elif "$" in sym or "::h" in sym:
            sym = demangle_rust_legacy(sym)
        sym = sanitize_frame(sym)
        if inlined and self._ann_inline:
            sym += "_[i]"
        elif dso is not None and not inlined:
            if self._ann_kernel and _is_kernel_dso(dso):
                sym += "_[k]"
            elif self._ann_jit and _JIT_MAP.search(dso):
                sym += "_[j]"
        return sym

    # -- headers -----------------------------------------------------------
    def _parse_header(self, header: bytes) -> _Header | None:
        h = parse_header(header.decode("utf-8", "surrogateescape").rstrip("\r"))
        if h is None:
            return None
        comm, pid, tid, event, period, trailing, _ = h
        o = self.options
        if o.include_tid:
            root = _task(comm, pid, tid, True)
        elif o.include_pid:
            root = _task(comm, pid, tid, False)
        else:
            root = sanitize_frame(comm)
        return (root, event, period, trailing)

    # -- samples (timestamps kept) -----------------------------------------
    def iter_samples(
        self, stream: BinaryIO, *, source: str, where: list[int] | None = None, stats: ReadStats | None = None
    ) -> Iterator[Sample]:
        """Samples in input order, with the perf timestamp (seconds) in ns; malformed samples
        are counted in ``stats``.

        The samples of one event, as collapse keeps them: ``options.event``, else
        the first named event of the input (under every spelling of its
        modifiers), and samples without an event field only when no sample names
        one.  What is left out is counted and named in ``stats.notes``: a capture
        of two events (``perf record -e cpu-clock -e task-clock``) once gave a
        timeline and a merged trace of both, each thread's time counted twice.
        """
        timed = self._timed_samples(stream, source=source, lines=where is not None, stats=stats)
        if self._want_event is not None:
            for _, line, s in timed:
                if where is not None:
                    where[0] = line
                yield s
            return
        kept: str | None = None  # the chosen event's base name; "" for samples without an event
        kept_name = ""  # as the input first spelled it
        held: list[tuple[int, Sample]] = []  # event-less samples before the first named one
        left: dict[str, tuple[int, Weight]] = {}
        for event, line, s in timed:
            base = event_base(event)
            if kept is None:
                if not event and len(held) < _HOLD_EVENTLESS:
                    held.append((line, s))
                    continue
                kept, kept_name = base, event
                if kept:
                    for _, h in held:
                        n, w = left.get("", (0, 0))
                        left[""] = (n + 1, w + h.weight)
                else:
                    # So many samples and still no event named: the capture has none.
                    for h_line, h in held:
                        if where is not None:
                            where[0] = h_line
                        yield h
                held = []
            if base != kept:
                n, w = left.get(event, (0, 0))
                left[event] = (n + 1, w + s.weight)
                continue
            if where is not None:
                where[0] = line
            yield s
        for h_line, h in held:  # no sample named an event
            if where is not None:
                where[0] = h_line
            yield h
        if left and stats is not None:
            n_out = sum(n for n, _ in left.values())
            others = ", ".join(
                f"{e or 'samples without an event field'} ({n:,} sample{'s' if n != 1 else ''}, weight {_fmt_weight(w)})"
                for e, (n, w) in left.items()
            )
            stats.notes.append(
                f"{source}: kept event {kept_name!r} (the first named in the input); left out {n_out:,} "
                f"sample{'s' if n_out != 1 else ''} of other events (weight {_fmt_weight(sum(w for _, w in left.values()))}): {others}"
            )

    def _timed_samples(
        self, stream: BinaryIO, *, source: str, lines: bool, stats: ReadStats | None
    ) -> Iterator[tuple[str, int, Sample]]:
        """(event, line, sample) of every sample with a time field, of ``options.event``
        when it is set; ``line`` is the sample's input line when ``lines``, else 0."""
        bad = ChunkResult(stats=stats) if stats is not None else ChunkResult()
        want = self._want_event
        by_period = self._by_period
        buf = b""
        line = 1
        while True:
            data = stream.read(1 << 20)
            buf += data
            if data:
                cut = block_boundary(buf)
                if cut < 0:
                    continue
                chunk, buf = buf[:cut], buf[cut:]
            else:
                chunk, buf = buf, b""
            if chunk:
                cut_input = not chunk.endswith(b"\n")  # only the input's last chunk can end so
                at_off, at_line = 0, line  # incremental line numbers: counting from 0 each time is quadratic
                for header, body, start in _records(chunk):
                    full = parse_header(header.decode("utf-8", "surrogateescape").rstrip("\r"))
                    if full is None:
                        self.malformed(bad, source, _line_at(chunk, start, line), "unrecognised perf script header")
                        continue
                    comm, pid, tid, event, period, trailing, t_ns = full
                    if want is not None and event != want and not _event_matches(event, want):
                        continue
                    if cut_input and _cut_short(chunk, start, header, body):
                        self.malformed(bad, source, _line_at(chunk, start, line), CUT_SHORT)
                        continue
                    if t_ns is None:
                        self.malformed(bad, source, _line_at(chunk, start, line), "sample without a time field")
                        continue
                    h = self._parse_header(header)
                    assert h is not None
                    frames = self._bodies.get(body)
                    if frames is None:
                        frames = self._frames_of(body.rstrip(b"\n\r "), trailing) or ""
                        self._report_junk(bad, source, lambda: _line_at(chunk, start, line))
                    if lines:
                        at_line += chunk.count(b"\n", at_off, start)
                        at_off = start
                    yield event, at_line if lines else 0, Sample(
                        time_ns=t_ns,
                        stack=tuple((h[0] + frames).split(";")),
                        weight=period if (by_period and period) else 1,
                        pid=pid,
                        tid=tid,
                    )
                line += chunk.count(b"\n")
            if not data:
                return


#: Event-less samples held back while no sample has named an event (a stray
#: line read as a header comes before the real event); past this many the
#: capture is taken to have no event field, and they are passed on.
_HOLD_EVENTLESS = 10_000


def _fmt_weight(w: Weight) -> str:
    return f"{w:,}" if isinstance(w, int) else f"{w:,.3f}"


_UNINDENTED = re.compile(rb"(?m)^[^\s]")
# A line indented with spaces: a srcline line, or (after a header padded so, as perf script
# pads the command without -g) another such header, maybe without a time field.
_SPACED = re.compile(rb"(?m)^ ")
_THIRD = operator.itemgetter(2)
_SPACES = itertools.repeat(b" ")


def _parses_as_header(line: bytes, full: bool = False) -> Any:
    """The parsed header of ``line`` (with ``full``), or whether it is one; for guessing only."""
    if len(line) > 4096:
        return None if full else False
    h = parse_header(line.decode("utf-8", "surrogateescape").rstrip("\r"))
    return h if full else h is not None


def _flush_left_sample(line: bytes, nxt: bytes) -> bool:
    """Whether ``line`` is an old perf header (with an event or a time) and ``nxt`` its first frame,
    printed flush left (``ffffffff8103d0ca native_write_msr_safe ([kernel.kallsyms])``)."""
    if _FLUSH_FRAME.match(nxt) is None or _FLUSH_FRAME.match(line) is not None:
        return False
    h = _parses_as_header(line, full=True)
    return h is not None and bool(h[3] or h[6] is not None)


def _starts_sample(line: bytes, in_stack: bool = False) -> bool:
    """Whether a line inside a block is another sample's header rather than a frame.

    Frames are indented, except in old perf versions (flush-left ``IP SYM (DSO)``);
    headers are flush left, except in ``perf script`` without ``-g``, which pads
    the command with spaces to 16 columns (``           false 39654 19115.489713: ...``).
    perf prints a frame line with a leading tab and never a header, so a line
    that starts with a tab is never a header; neither is an indented line after
    a frame line of the same sample (``in_stack``): a sample with frames ends at
    a blank line.  Such a line that is not a frame is a malformed frame line,
    whatever it ends with.

    A line indented with spaces before any frame is a header when it reads as
    one: perf indents no frame line with spaces (only ``-F +srcline`` lines,
    which come after a frame), and a padded command made of hex digits
    (``            beef 20067      7f03ec6113e0 update_active``) also reads as
    ``IP SYMBOL``.  Only a line that reads as no header is taken for a frame
    whose tab became spaces.
    """
    c = line[:1]
    if c == b"\t":
        return False
    if c == b" ":
        if in_stack:
            return False
        return _HEADER_LINE.match(line) is not None or _is_padded_header(line)
    return _FLUSH_FRAME.match(line) is None or _HEADER_LINE.match(line) is not None


def _is_frame_line(line: bytes) -> bool:
    """Whether ``line`` is laid out as a frame line (indented ``IP SYMBOL``)."""
    return line[:1] == b"\t" or _FRAME_HINT.match(line) is not None


def _is_padded_header(line: bytes) -> bool:
    """A time-less header of perf script without ``-g`` (``      worker 0 16989    1001001      55ba0c43317f recurse``):
    a task, maybe a period, then nothing or ``IP SYMBOL``; a srcline line is none of these."""
    h = _parses_as_header(line, full=True)
    if h is None:
        return False
    ip, sp, sym = h[5].partition(" ")
    return not ip or (bool(sp) and sym.strip() != "" and _HEXSTR.issuperset(ip.lower()))


def demangle_rust_legacy(sym: str) -> str:
    """A Rust legacy-mangled path perf printed undecoded, decoded (``GcBox$LT$T$GT$::new::h…`` ->
    ``GcBox<T>::new``); other names unchanged."""
    if _RUST_HASH.search(sym) is None:
        return sym
    sym = sym[: -len("::h0123456789abcdef")]

    def esc(m: re.Match[str]) -> str:
        k = m.group(1)
        if k in _RUST_NAMED:
            return _RUST_NAMED[k]
        try:
            return chr(int(k[1:], 16))
        except (ValueError, OverflowError):
            return m.group(0)

    if sym.startswith("_$"):
        sym = sym[1:]  # rustc prefixes a path that starts with an escape with "_"
    return _RUST_ESC.sub(esc, sym).replace("..", "::")


#: Why the last sample of an input that ends inside a frame line is left out.
CUT_SHORT = "sample cut short: the input ends inside its frame lines (a capture cut off?)"


def _cut_short(data: bytes, start: int, header: bytes, body: bytes) -> bool:
    """Whether the sample at ``start`` (``header``, then frame lines ``body``) is cut off
    by the end of ``data``, which ends without a newline: perf script ends every line,
    so its last frame line, and the frames after it (the root's), are missing, and
    the rest would make a wrong stack (a frame ``sym+0x6e7 (/usr/bin/py``, no root).
    A last frame line that is whole (it ends with its ``(dso)``) is not cut: the
    file only lacks its final newline (an edited capture), and loses nothing."""
    if body[:1] != b"\t" or start + len(header) + 1 + len(body) != len(data):
        return False
    return not body.rstrip(b"\r").endswith(b")")


def _records(chunk: bytes) -> Iterator[tuple[bytes, bytes, int]]:
    """``(header, frame lines, offset)`` of each sample, with or without blank lines between them."""
    offset = 0
    for block in chunk.split(b"\n\n"):
        start = offset
        offset += len(block) + 2
        block, start = _skip_leading(block, start)
        if not block:
            continue
        header, _, body = block.partition(b"\n")
        if not body or (
            _UNINDENTED.search(body) is None
            and _HEADER_LINE.search(body) is None
            and (header[:1] != b" " or _SPACED.search(body) is None)
        ):
            yield header, body, start
            continue
        pos = start
        cur_h, cur_body, cur_start = header, [], start
        pos += len(header) + 1
        in_stack = False
        for ln in body.split(b"\n"):
            # A blank line of CRLF text is "\r" (blocks split on "\n\n" only): a
            # blank, never another sample's header.
            if not ln or ln == b"\r" or not _starts_sample(ln, in_stack):
                cur_body.append(ln)
                in_stack = in_stack or _is_frame_line(ln)
            else:
                yield cur_h, b"\n".join(cur_body), cur_start
                cur_h, cur_body, cur_start = ln, [], pos
                in_stack = False
            pos += len(ln) + 1
        yield cur_h, b"\n".join(cur_body), cur_start


def _skip_leading(block: bytes, start: int) -> tuple[bytes, int]:
    """Drop leading blank and ``#`` comment lines of a block."""
    while block and (block[0] in (10, 13) or block[0] == 35):
        nl = block.find(b"\n")
        if nl < 0:
            return b"", start + len(block)
        block = block[nl + 1 :]
        start += nl + 1
    return block, start


_LINE_MEMO: list[object] = [None, 0, 0]  # chunk, offset, newlines before offset


def _line_at(data: bytes, offset: int, first_line: int) -> int:
    """Line number of ``offset``; incremental for increasing offsets in one chunk (else quadratic)."""
    memo = _LINE_MEMO
    if memo[0] is data and offset >= memo[1]:  # type: ignore[operator]
        n = memo[2] + data.count(b"\n", memo[1], offset)  # type: ignore[operator, arg-type]
    else:
        n = data.count(b"\n", 0, offset)
    memo[0], memo[1], memo[2] = data, offset, n
    return first_line + n


#: The timestamp of a header (" 719.874582:" before a space or the end) removed, in
#: one C call: samples of one task and event then share a cache entry.
_header_key_fast = re.compile(rb" \d{1,19}\.\d{1,19}:(?= |$)").sub


#: perf's event modifiers (``cycles:u``, ``cpu-clock:ppp``, ``cycles:uppp``): user/kernel/hypervisor,
#: precision, guest/host, sampling-read, pinned, exclusive...
_MODIFIERS = frozenset("ukhpGHSDIWe")


def _event_matches(event: str, want: str) -> bool:
    """``--event cpu-clock`` also matches ``cpu-clock:ppp`` (perf's precision modifiers)."""
    if not event.startswith(want + ":"):
        return False
    return _MODIFIERS.issuperset(event[len(want) + 1 :])


def event_base(event: str) -> str:
    """The event without its modifiers: ``cycles:u`` and ``cycles:uppp`` are ``cycles``.

    One capture can name the same event both ways (perf script printed
    ``cycles:u:`` and ``cycles:`` headers for one ``perf record -e cycles:u``
    run, inferno's single-line-stacks corpus file); a tracepoint's
    ``sched:sched_switch`` is not a modifier and stays whole.
    """
    name, sep, mods = event.rpartition(":")
    return name if sep and name and mods and _MODIFIERS.issuperset(mods) else event


def _task(comm: str, pid: int | None, tid: int | None, with_tid: bool) -> str:
    if pid is None:
        # Default perf script output prints only the thread id; say so rather than guess.
        c = sanitize_frame(comm)
        if tid is None:
            return c
        return f"{c}-?/{tid}" if with_tid else f"{c}-?"
    return task_frame(comm, pid, tid if with_tid else None)


def _split_dso(rest: str) -> tuple[str, str | None]:
    """``sym (dso)`` -> (sym, dso); the DSO is the last balanced parenthesised group."""
    if not rest.endswith(")"):
        return rest, None
    i = rest.rfind(" (")
    if i < 0:
        return rest, None
    inner = rest[i + 2 : -1]
    if "(" not in inner and ")" not in inner:
        return rest[:i], inner
    # Parentheses inside the DSO path: find the "(" that balances the final ")".
    depth = 0
    for j in range(len(rest) - 1, -1, -1):
        c = rest[j]
        if c == ")":
            depth += 1
        elif c == "(":
            depth -= 1
            if depth == 0:
                if j > 0 and rest[j - 1] == " ":
                    return rest[: j - 1], rest[j + 1 : -1]
                return rest, None
    return rest, None


def _is_kernel_dso(dso: str) -> bool:
    if dso.startswith("["):
        return dso.endswith("]") and dso not in _NOT_KERNEL
    base = dso.rsplit("/", 1)[-1]
    return base.startswith("vmlinux") or base.endswith(".ko") or ".ko." in base


def _is_period(w: str) -> bool:
    # str.isdigit() is also true for "²" (int() refuses it) and for 5,000-digit runs.
    return w.isascii() and w.isdigit() and len(w) <= 19


#: Linux's PID_MAX_LIMIT: a larger number cannot be a task id.
_PID_MAX = 1 << 22


def _period_column(h: str, toks: list[tuple[int, int]], words: list[str], i: int) -> bool:
    """Whether the number ``words[i]``, after a task id or ``[CPU]``, is perf's period field.

    Without a time or event field to anchor on, ``worker 0  8006    1001001``
    (``-F comm,tid,period``) and ``worker 0  8006`` (``-F comm,tid``, a comm
    ending in a digit) both end in two numbers.  perf prints the period
    right-aligned in 10 columns after the task's field, where a tid is at most
    7 wide (``%5d``, ``%7d``), so the column tells them apart; so does a number
    no task id can be, or a ``PID/TID`` or ``[CPU]`` field before it (a second
    tid cannot follow those).
    """
    prev = words[i - 1]
    if _CPU.match(prev) or (_TASK.match(prev) and "/" in prev):
        return True
    if not _TASK.match(prev):
        return False
    if int(words[i]) > _PID_MAX:
        return True
    return toks[i][1] - toks[i - 1][1] - 1 == 10


def _time_ns(tok: str) -> int:
    sec, _, frac = tok.partition(".")
    return int(sec) * 1_000_000_000 + int((frac + "000000000")[:9])


def parse_header(h: str) -> tuple[str, int | None, int | None, str, int, str, int | None] | None:
    """``(comm, pid, tid, event, period, trailing, time_ns)`` of a perf script header, or None.

    ``pid`` is None when perf printed only the thread id (its default).
    ``event`` is ``""`` and ``period`` 0 when the header has no such field.
    """
    toks = [(m.start(), m.end()) for m in _TOKEN.finditer(h)]
    if not toks:
        return None
    words = [h[a:b] for a, b in toks]
    k = next((i for i, w in enumerate(words) if i >= 1 and _TIME.match(w)), -1)
    time_ns: int | None = None
    period = 0
    event = ""
    trailing = ""
    if k >= 0:
        time_ns = _time_ns(words[k][:-1])
        pre = k
        j = k + 1
        if j < len(words) and _is_period(words[j]):
            period = int(words[j])
            j += 1
        if j < len(words) and words[j].endswith(":"):
            event = words[j][:-1]
            j += 1
        if j < len(words):
            trailing = h[toks[j][0] :].strip()
    else:
        e = next((i for i, w in enumerate(words) if i >= 1 and w.endswith(":") and not _TASK.match(w[:-1])), -1)
        if e >= 0:
            event = words[e][:-1]
            pre = e
            if e + 1 < len(words):
                trailing = h[toks[e + 1][0] :].strip()
            # "comm tid [cpu] period event:": a number right before the event is the period
            # when a task id (or cpu) precedes it.
            if pre >= 3 and _is_period(words[pre - 1]) and (_TASK.match(words[pre - 2]) or _CPU.match(words[pre - 2])):
                period = int(words[pre - 1])
                pre -= 1
        else:
            pre = len(words)
            # No time, no event: "comm tid [cpu] [period]", maybe followed by "ip sym (dso)" (no -g).
            last = len(words) - 1
            if _CPU.match(words[last]) or _TASK.match(words[last]):
                pre = len(words)
            else:
                for i in range(len(words) - 3, 0, -1):
                    if _TASK.match(words[i]) and _HEXSTR.issuperset(words[i + 1]):
                        pre = i + 1
                        trailing = h[toks[i + 1][0] :].strip()
                        break
            if pre >= 2 and _is_period(words[pre - 1]) and _period_column(h, toks, words, pre - 1):
                period = int(words[pre - 1])
                pre -= 1
    if pre >= 1 and _CPU.match(words[pre - 1]):
        pre -= 1
    if pre < 1:
        return None
    m = _TASK.match(words[pre - 1])
    if m is None:
        return None
    comm = h[: toks[pre - 1][0]].strip() if pre >= 2 else ""
    if m.group(2) is not None:
        pid: int | None = int(m.group(1))
        tid: int | None = int(m.group(2))
    else:
        pid, tid = None, int(m.group(1))
    return comm, pid, tid, event, period, trailing, time_ns
