"""Merging timestamped sample streams from many processes or hosts.

Each source is read as a stream (:meth:`flamed.collapse.base.Collapser.samples`)
and the streams are merged by a k-way merge on timestamps
(:func:`flamed.model.merge_streams`), holding one pending sample per stream.
On the way:

* task ids are remapped so two sources never share one (:class:`IdRemapper`):
  a pid/tid keeps its number unless another source used it first (in merge
  order, which is deterministic), else it gets a fresh one above Linux's
  ``PID_MAX_LIMIT``; root frames ``comm-PID[/TID]`` and ``comm-?/TID`` are
  rewritten to match;
* a sample whose ids are not in its root frame (perf script, whose root
  frame is the command) gets the root frame ``comm-PID/TID`` (``comm-?/TID``
  without a pid), so the output says which task each sample came from;
* a source label (host, file) can become the root frame (one frame: made
  safe with :func:`flamed.model.sanitize_frame`);
* ``start_ns <= t < end_ns`` filters by time; timestamps are never changed;
* a source whose timestamps go backwards is an error naming the file and line,
  unless ``sort`` is asked: then each source is sorted first by an external
  merge sort (runs of ``sort_run`` samples sorted in memory, spilled to
  temporary files, merged), so memory stays bounded whatever the input size.

Equal timestamps keep input order (earlier source first, then file order),
so the merge is deterministic.
"""

from __future__ import annotations

import contextlib
import heapq
import os
import pickle
import sys
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import BinaryIO

from flamed.collapse.base import CollapseOptions, Collapser
from flamed.errors import FlamedError, InputError
from flamed.folded import ReadStats
from flamed.model import (
    Profile,
    Sample,
    Weight,
    decode_frame,
    merge_streams,
    parse_task_frame,
    sanitize_frame,
    task_frame,
    task_root,
)

#: First id handed out on a collision: above Linux's PID_MAX_LIMIT (2**22), so never a real id.
FRESH_ID_BASE = 10_000_000
LABEL_ROOTS = ("label", "host", "file", "pid")


@dataclass(frozen=True)
class MergeOptions:
    """How sources are merged. Every field says its default.

    start_ns / end_ns: keep samples with ``start_ns <= t < end_ns`` (default: all).
    remap_ids: give colliding pids/tids of different sources fresh ids (default True).
    label_root: put a root frame per sample: ``label``/``host`` (the source's
        label), ``file`` (the input's file name), ``pid`` (``pid-N``, the
        remapped pid) (default None: no extra root frame).
    sort: sort unsorted sources (external sort) instead of failing (default False).
    sort_run: samples sorted in memory per run of the external sort (default 100,000).
    tmpdir: where the external sort spills its runs (default: the system's temp dir).
    """

    start_ns: int | None = None
    end_ns: int | None = None
    remap_ids: bool = True
    label_root: str | None = None
    sort: bool = False
    sort_run: int = 100_000
    tmpdir: str | None = None


@dataclass
class Source:
    """One input of a merge: where it is, its label, its format."""

    path: str | None
    name: str
    label: str
    collapser: Collapser
    #: The root frame of ``--label-root file``: the file name, with as many of
    #: its directories as tell it from the other inputs' (None: the base name).
    file_label: str | None = None


class IdRemapper:
    """Maps (source, id) to an output id so that no two sources share one."""

    def __init__(self) -> None:
        self._map: dict[tuple[int, int], int] = {}
        self._owner: dict[int, int] = {}
        self._next = FRESH_ID_BASE
        self.remapped = 0

    def __call__(self, source: int, ident: int) -> int:
        key = (source, ident)
        out = self._map.get(key)
        if out is not None:
            return out
        owner = self._owner.get(ident)
        if owner is None:
            out = ident
        else:
            while self._next in self._owner:
                self._next += 1
            out = self._next
            self._next += 1
            self.remapped += 1
        self._owner[out] = source
        self._map[key] = out
        return out

    def task(self, source: int, pid: int | None, tid: int | None) -> tuple[int | None, int | None]:
        """A task's output ids (pid first, then tid; an absent one stays absent)."""
        return (self(source, pid) if pid is not None else None, self(source, tid) if tid is not None else None)


@dataclass
class MergeStats:
    samples_in: int = 0
    samples_out: int = 0
    ids_remapped: int = 0
    sorted_sources: list[str] = field(default_factory=list)
    #: Malformed lines skipped in the inputs (``file:line: why`` of the first few), as collapse reports them.
    read: ReadStats = field(default_factory=ReadStats)


def _checked(samples: Iterator[Sample], name: str, where: list[int]) -> Iterator[Sample]:
    """Pass samples through, failing on the first timestamp that goes backwards."""
    prev: int | None = None
    for s in samples:
        t = s.time_ns
        if prev is not None and t < prev:
            raise InputError(
                f"timestamps go backwards ({t} ns after {prev} ns): the input is not sorted by time; "
                "sort it, or pass --sort to sort it on the fly",
                source=name,
                line=where[0] or None,
            )
        prev = t
        yield s


def _external_sort(samples: Iterator[Sample], *, run: int, tmpdir: str | None, stack: contextlib.ExitStack) -> Iterator[Sample]:
    """Sort a stream by time with bounded memory: sorted runs on disk, then a k-way merge."""
    first: list[Sample] = []
    files: list[BinaryIO] = []
    sorted_so_far = True
    prev: int | None = None
    batch: list[Sample] = []
    for s in samples:
        if prev is not None and s.time_ns < prev:
            sorted_so_far = False
        prev = s.time_ns
        batch.append(s)
        if len(batch) >= run:
            files.append(_spill(batch, tmpdir, stack))
            batch = []
    if not files:
        # Everything fit in one run: sort it in memory (stable: ties keep file order).
        first = batch if sorted_so_far else sorted(batch, key=lambda x: x.time_ns)
        yield from first
        return
    if batch:
        files.append(_spill(batch, tmpdir, stack))
    yield from heapq.merge(*(_read_run(f) for f in files), key=lambda x: x.time_ns)


_RUN_BATCH = 1000  # samples per pickle record of a run: what one run costs in memory while merging


def _spill(batch: list[Sample], tmpdir: str | None, stack: contextlib.ExitStack) -> BinaryIO:
    batch.sort(key=lambda x: x.time_ns)
    try:
        f = stack.enter_context(tempfile.TemporaryFile(dir=tmpdir, prefix="flamed-sort-"))
        for i in range(0, len(batch), _RUN_BATCH):
            pickle.dump([(s.time_ns, s.stack, s.weight, s.pid, s.tid) for s in batch[i : i + _RUN_BATCH]], f, protocol=5)
        f.flush()
        f.seek(0)
    except OSError as e:
        # A missing or full directory: say which, and what to do, instead of a traceback.
        where = tmpdir if tmpdir is not None else tempfile.gettempdir()
        raise FlamedError(
            f"--sort cannot write its sorted runs to {where}: {e.strerror or e}; "
            "give --tmpdir a writable directory with room (or a larger --sort-run)"
        ) from None
    return f


def _read_run(f: BinaryIO) -> Iterator[Sample]:
    while True:
        try:
            rows = pickle.load(f)
        except EOFError:
            return
        for t, stack, w, pid, tid in rows:
            yield Sample(time_ns=t, stack=stack, weight=w, pid=pid, tid=tid)


def distinct_names(paths: list[str]) -> list[str]:
    """Each path's base name, with as many of its last directories as it takes to
    tell it from every other path's (``d1/x.trace``, ``d2/x.trace``); a path
    given twice gets ``#2``, ``#3``... on its later copies."""
    parts = [os.path.normpath(p).split(os.sep) if p else [p] for p in paths]
    depth = [1] * len(paths)
    for _ in range(max((len(p) for p in parts), default=1)):
        names = ["/".join(p[-d:]) for p, d in zip(parts, depth)]
        # A name shared by different paths (the same path twice is told apart below).
        owners: dict[str, set[tuple[str, ...]]] = {}
        for n, p in zip(names, parts):
            owners.setdefault(n, set()).add(tuple(p))
        clash = {n for n, o in owners.items() if len(o) > 1}
        grew = False
        for i, n in enumerate(names):
            if n in clash and depth[i] < len(parts[i]):
                depth[i] += 1
                grew = True
        if not grew:
            break
    names = ["/".join(p[-d:]) for p, d in zip(parts, depth)]
    seen: dict[str, int] = {}
    out = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append(n if seen[n] == 1 else f"{n}#{seen[n]}")
    return out


def root_label(src: Source, label_root: str | None) -> str | None:
    """The root frame ``label_root`` puts on every stack of ``src`` (``pid`` aside), as one frame."""
    if label_root in ("label", "host"):
        return sanitize_frame(src.label)
    if label_root == "file":
        return sanitize_frame(src.file_label or os.path.basename(src.name))
    return None


def _relabel(
    samples: Iterator[Sample], index: int, src: Source, opts: MergeOptions, remap: IdRemapper | None
) -> Iterator[Sample]:
    label_root = opts.label_root
    label = root_label(src, label_root)
    lo, hi = opts.start_ns, opts.end_ns
    # (root frame, pid, tid) read -> (root frame, pid, tid) written.
    roots: dict[tuple[str, int | None, int | None], tuple[str, int | None, int | None]] = {}
    for s in samples:
        t = s.time_ns
        if lo is not None and t < lo:
            continue
        if hi is not None and t >= hi:
            continue
        stack = s.stack
        pid, tid = s.pid, s.tid
        if (pid is not None or tid is not None) and stack:
            key = (stack[0], pid, tid)
            hit = roots.get(key)
            if hit is None:
                npid, ntid = remap.task(index, pid, tid) if remap is not None else (pid, tid)
                hit = (task_root(stack[0], pid, tid, npid, ntid), npid, ntid)
                if len(roots) < 100_000:
                    roots[key] = hit
            root, pid, tid = hit
            if root != stack[0]:
                stack = (root,) + stack[1:]
        if label is not None:
            stack = (label,) + stack
        elif label_root == "pid":
            stack = (f"pid-{pid if pid is not None else '?'}",) + stack
        if stack is s.stack and pid == s.pid and tid == s.tid and index == s.source:
            yield s  # unchanged: no new object (a frozen dataclass costs a microsecond to build)
        else:
            yield Sample(time_ns=t, stack=stack, weight=s.weight, pid=pid, tid=tid, source=index)


def merge_sources(
    sources: Sequence[Source],
    opts: MergeOptions,
    stack: contextlib.ExitStack,
    *,
    collapse_options: CollapseOptions | None = None,
    stats: MergeStats | None = None,
) -> Iterator[Sample]:
    """The merged, relabelled stream of ``sources``; files are closed by ``stack``."""
    from flamed.collapse.driver import open_with_format

    copts = collapse_options if collapse_options is not None else CollapseOptions()
    remap = IdRemapper() if opts.remap_ids else None
    streams: list[Iterable[Sample]] = []
    for i, src in enumerate(sources):
        f, head, collapser = open_with_format(src.path, src.collapser.name)
        stack.callback(f.close)
        f2 = _Prepend(head, f)
        where = [0]
        raw = collapser.samples(f2, copts, source=src.name, where=where, stats=stats.read if stats is not None else None)  # type: ignore[arg-type]
        if opts.sort:
            ordered = _external_sort(raw, run=opts.sort_run, tmpdir=opts.tmpdir, stack=stack)
        else:
            ordered = _checked(raw, src.name, where)
        streams.append(_relabel(ordered, i, src, opts, remap))
    merged = merge_streams(streams)
    if stats is None:
        return merged
    return _counted(merged, stats, remap)


def _counted(samples: Iterator[Sample], stats: MergeStats, remap: IdRemapper | None) -> Iterator[Sample]:
    for s in samples:
        stats.samples_out += 1
        yield s
    if remap is not None:
        stats.ids_remapped = remap.remapped


class _Prepend:
    """A binary stream that first returns ``head`` (already read to guess the format)."""

    def __init__(self, head: bytes, rest: BinaryIO) -> None:
        self._head = head
        self._rest = rest

    def read(self, n: int = -1) -> bytes:
        if self._head:
            if n is None or n < 0:
                out = self._head + self._rest.read()
                self._head = b""
                return out
            out, self._head = self._head[:n], self._head[n:]
            return out
        return self._rest.read(n)

    def __iter__(self) -> Iterator[bytes]:
        # Lines: the head may end mid-line, so join it with the rest of its line.
        if self._head:
            head, self._head = self._head, b""
            lines = head.split(b"\n")
            tail = lines.pop()
            for ln in lines:
                yield ln + b"\n"
            if tail:
                yield tail + self._rest.readline()
        yield from self._rest


# ---------------------------------------------------------------------------
# Fast path: trace files in, trace out, line by line.


def _trace_lines(
    f: BinaryIO,
    index: int,
    src: Source,
    opts: MergeOptions,
    remap: IdRemapper | None,
    *,
    strict: bool,
    seconds: bool,
    read: ReadStats | None = None,
) -> Iterator[tuple[int, bytes]]:
    """``(time_ns, output line)`` of one trace, bytes for bytes what the Sample path writes.

    The stack is never split: only the root frame is looked at (task ids,
    labels), and the common line ``INTEGER_NS STACK INTEGER`` is passed on
    nearly as is.  Anything unusual goes through :func:`parse_trace_line`.
    """
    from flamed.collapse.trace import format_timestamp, parse_trace_line
    from flamed.model import encode_frame, format_weight

    label_root = opts.label_root
    label = root_label(src, label_root)
    label_b = encode_frame(label) + b";" if label is not None else b""
    lo, hi = opts.start_ns, opts.end_ns
    roots: dict[bytes, tuple[bytes, int | None]] = {}
    prev: int | None = None
    lineno = 0
    for raw in f:
        lineno += 1
        if raw[:1] == b"#":
            continue
        ts, sep, rest = raw.partition(b" ")
        body = rest.strip()
        head, sp, cnt = body.rpartition(b" ")
        if (
            sep
            and sp
            and ts.isdigit()
            and len(ts) <= 18  # 19 digits may pass int64: parse_trace_line says
            and cnt.isdigit()
            and len(cnt) <= 18
            and (cnt[0] != 48 or len(cnt) == 1)
            and head
            and head[-1] not in b" \t"
        ):
            t = int(ts)
            stack_b, count_b = head, cnt
        else:
            line = raw.decode("utf-8", "surrogateescape").rstrip("\r\n")
            if not line or line.isspace():
                continue
            rec = parse_trace_line(line)
            if rec is None:
                if strict:
                    raise InputError("expected 'TIMESTAMP STACK [COUNT]'", source=src.name, line=lineno)
                if read is not None:
                    read.skip(src.name, lineno, "expected 'TIMESTAMP STACK [COUNT]'")
                continue
            t, stack, w = rec
            stack_b = encode_frame(";".join(stack))
            count_b = format_weight(w).encode()
        if prev is not None and t < prev:
            raise InputError(
                f"timestamps go backwards ({t} ns after {prev} ns): the input is not sorted by time; "
                "sort it, or pass --sort to sort it on the fly",
                source=src.name,
                line=lineno,
            )
        prev = t
        if lo is not None and t < lo:
            continue
        if hi is not None and t >= hi:
            continue
        if remap is not None or label_root == "pid":
            root_b, semi, tail = stack_b.partition(b";")
            hit = roots.get(root_b)
            if hit is None:
                # Once per distinct root: the id table answers the same for a (source, id)
                # from its first call on, which happens at the same sample as in the Sample path.
                task = parse_task_frame(root_b.decode("utf-8", "surrogateescape"))
                pid = task.pid
                new_root = root_b
                if remap is not None and (pid is not None or task.tid is not None):
                    npid, ntid = remap.task(index, pid, task.tid)
                    if npid != pid or ntid != task.tid:
                        new_root = encode_frame(task_frame(task.comm, npid, ntid))
                    pid = npid
                hit = (new_root, pid)
                if len(roots) >= 100_000:
                    roots.clear()
                roots[root_b] = hit
            if hit[0] != root_b:
                stack_b = hit[0] + semi + tail
            if label_root == "pid":
                stack_b = f"pid-{hit[1] if hit[1] is not None else '?'};".encode() + stack_b
        if label_b:
            stack_b = label_b + stack_b
        t_b = format_timestamp(t, "seconds").encode() if seconds else str(t).encode()
        yield t, b"%s %s %s\n" % (t_b, stack_b, count_b)


def merge_trace_files(
    sources: Sequence[Source],
    opts: MergeOptions,
    stack: contextlib.ExitStack,
    out: BinaryIO,
    *,
    strict: bool = False,
    time_format: str = "ns",
    stats: MergeStats | None = None,
) -> int:
    """Merge trace files into a trace on ``out``; the same bytes as the Sample path, faster."""
    from operator import itemgetter

    from flamed.collapse.trace import TRACE_MAGIC
    from flamed.fileio import open_input

    remap = IdRemapper() if opts.remap_ids else None
    seconds = time_format == "seconds"
    gens = []
    for i, src in enumerate(sources):
        f = open_input(src.path)
        stack.callback(f.close)
        gens.append(_trace_lines(f, i, src, opts, remap, strict=strict, seconds=seconds, read=stats.read if stats is not None else None))
    unit = "seconds" if seconds else "ns"
    out.write(TRACE_MAGIC + f": TIMESTAMP({unit}) STACK COUNT\n".encode())
    n = 0
    buf: list[bytes] = []
    for _, line in heapq.merge(*gens, key=itemgetter(0)):
        buf.append(line)
        if len(buf) >= 8192:
            out.write(b"".join(buf))
            n += len(buf)
            buf.clear()
    out.write(b"".join(buf))
    n += len(buf)
    if stats is not None:
        stats.samples_out = n
        if remap is not None:
            stats.ids_remapped = remap.remapped
    return n


def aggregate_trace_files(
    sources: Sequence[Source],
    opts: MergeOptions,
    stack: contextlib.ExitStack,
    *,
    strict: bool = False,
    stats: MergeStats | None = None,
) -> Profile:
    """Merge trace files and sum them into a Profile (what ``profile_from_samples`` of the
    merged stream gives, weights added in the same order), line by line."""
    from operator import itemgetter

    from flamed.fileio import open_input

    remap = IdRemapper() if opts.remap_ids else None
    gens = []
    for i, src in enumerate(sources):
        f = open_input(src.path)
        stack.callback(f.close)
        gens.append(_trace_lines(f, i, src, opts, remap, strict=strict, seconds=False, read=stats.read if stats is not None else None))
    counts: dict[bytes, Weight] = {}
    lo: int | None = None
    hi: int | None = None
    n = 0
    for t, line in heapq.merge(*gens, key=itemgetter(0)):
        if lo is None:
            lo = t
        hi = t
        n += 1
        stack_b, _, cnt = line[line.index(b" ") + 1 : -1].rpartition(b" ")
        w: Weight = int(cnt) if cnt.isdigit() else float(cnt)
        counts[stack_b] = counts.get(stack_b, 0) + w
    p = Profile(start_ns=lo, end_ns=hi)
    stacks = p.stacks
    intern = sys.intern
    while counts:
        k, w = counts.popitem()
        st = tuple(map(intern, decode_frame(k).split(";")))
        stacks[st] = stacks.get(st, 0) + w
    if stats is not None:
        stats.samples_out = n
        if remap is not None:
            stats.ids_remapped = remap.remapped
    return p
