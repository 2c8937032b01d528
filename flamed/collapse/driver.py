"""Run an input format over files, in parallel, with memory bounded by unique stacks.

The input is read in chunks of about ``chunk_bytes``; each chunk is cut where
the format says a record ends (:meth:`Collapser.boundary`), so no sample is
split.  Chunks go to worker processes (``jobs > 1``) that each keep one parser
per format, and come back as partial :class:`ChunkResult`\\ s, which are summed
in chunk order.  The chunking does not depend on ``jobs`` and the partial sums
are added in the same order, so ``--jobs N`` gives exactly the bytes of
``--jobs 1`` (float weights included).

Only ``2 * jobs`` chunks are in flight at once, and nothing else of the input
is held: memory is the unique stacks plus a few chunks, whatever the input size.

Regular uncompressed files of a format with integer weights (perf script) are
not piped through the parent: the file is cut at record boundaries into about
four byte ranges per process, and every process -- the parent too -- takes
ranges from a shared counter, reads them itself and sends back one summed
result per range.  Results are added in range order, with error line numbers
shifted by the lines before the range, so the output is still that of
``--jobs 1`` (integer sums do not depend on the grouping).  Stdin, pipes,
gzip and ``--strict`` keep the chunk-pipe path.
"""

from __future__ import annotations

import gc
import io
import os
import sys
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, BinaryIO, TextIO

if TYPE_CHECKING:
    # multiprocessing is imported where processes are started: most runs never do,
    # and its import is a good part of a small command's start-up.
    import multiprocessing.pool
    import multiprocessing.sharedctypes

from flamed.collapse import get, guess
from flamed.collapse.base import ChunkParser, ChunkResult, CollapseOptions, Collapser
from flamed.collapse.perf import _event_matches, event_base
from flamed.errors import InputError
from flamed.fileio import bom_length, input_name, input_size, open_input
from flamed.folded import ReadStats, is_differential
from flamed.model import EMPTY_STACK_FRAME, Profile, Stack, Weight
# Progress and its threshold live in flamed.progress (every long command draws it); kept importable here.
from flamed.progress import PROGRESS_MIN_BYTES as PROGRESS_MIN_BYTES
from flamed.progress import Progress as Progress
from flamed.progress import reading
from flamed.workers import pool_workers, wait_result

DEFAULT_CHUNK_BYTES = 4 << 20
HEAD_BYTES = 64 << 10


@dataclass
class CollapseResult:
    profile: Profile
    stats: ReadStats
    #: Events in the order they first appeared, with their sample weights.
    events: dict[str, Weight] = field(default_factory=dict)
    kept_event: str | None = None
    #: Format used for each input, by input name.
    formats: dict[str, str] = field(default_factory=dict)
    #: Remarks for stderr (which event was kept, pid missing, ...).
    messages: list[str] = field(default_factory=list)


# -- worker side -------------------------------------------------------------
_PARSERS: dict[str, ChunkParser] = {}
_OPTIONS: CollapseOptions | None = None


def _ignore_sigint() -> None:
    """In a worker: leave Ctrl-C to the parent, which shuts the pool down.

    A terminal's Ctrl-C reaches every process of the group; a worker that died
    of it could hold a queue's lock and hang the parent's shutdown.  Workers
    start with SIGINT blocked (:func:`_start_pool`), so none is lost between
    the fork and here.
    """
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _init_worker(options: CollapseOptions) -> None:
    global _OPTIONS
    _ignore_sigint()
    _OPTIONS = options
    _PARSERS.clear()


#: How long the parent waits for a pool to shut down before it kills the workers.
SHUTDOWN_WAIT = 3.0


def _start_pool(
    processes: int, initializer: Callable[..., None], initargs: tuple[object, ...] = ()
) -> multiprocessing.pool.Pool:
    """A pool of forked workers that ignore SIGINT.

    SIGINT is blocked in this thread while the workers are forked (and in the
    pool's threads, which fork any replacement worker), so a worker never runs
    Python's KeyboardInterrupt handler; a Ctrl-C meanwhile is delivered to this
    process once the pool has started.
    """
    import multiprocessing
    import signal

    ctx = multiprocessing.get_context("fork")
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        return ctx.Pool(processes, initializer=initializer, initargs=initargs)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _stop_pool(pool: multiprocessing.pool.Pool, wait: float = SHUTDOWN_WAIT) -> None:
    """Terminate ``pool`` and its workers, blocking for about ``wait`` seconds at most.

    ``Pool.terminate`` can block for ever when a worker died holding a queue's
    lock (killed from outside); it runs in a helper thread, and when it has not
    finished in time the workers are killed and the helper is abandoned (a
    daemon thread: it does not keep the process alive).
    """
    import threading

    workers = list(getattr(pool, "_pool", ()))

    def stop() -> None:
        pool.terminate()
        pool.join()

    t = threading.Thread(target=stop, name="flamed-pool-stop", daemon=True)
    t.start()
    t.join(wait)
    if t.is_alive():
        for w in workers:
            if w.exitcode is None:
                w.kill()
        t.join(min(1.0, wait))


def _parse_task(task: tuple[str, bytes, str, int]) -> ChunkResult:
    fmt, data, source, first_line = task
    p = _PARSERS.get(fmt)
    if p is None:
        assert _OPTIONS is not None
        p = _PARSERS[fmt] = get(fmt).parser(_OPTIONS)
    return p.parse(data, source=source, first_line=first_line)


class _RangeReader:
    """Reads ``[start, end)`` of a regular file, then reports end of file."""

    def __init__(self, f: BinaryIO, start: int, end: int) -> None:
        f.seek(start)
        self._f = f
        self._left = end - start

    def read(self, n: int = -1) -> bytes:
        if self._left <= 0:
            return b""
        d = self._f.read(self._left if n < 0 else min(n, self._left))
        self._left -= len(d)
        return d


def _merge_part(acc: ChunkResult, part: ChunkResult) -> None:
    """Add ``part`` to ``acc`` (both in input order; weights are integers here)."""
    acc.stats.merge(part.stats)
    acc.notes.update(part.notes)
    acc.merge_dropped(part)
    for ev in part.order:
        src = part.groups[ev]
        dst = acc.groups.get(ev)
        if dst is None:
            acc.groups[ev] = dst = {}
            acc.order.append(ev)
        if not dst:
            dst.update(src)
        else:
            get_ = dst.get
            for k, w in src.items():
                dst[k] = get_(k, 0) + w
    if part.start_ns is not None and (acc.start_ns is None or part.start_ns < acc.start_ns):
        acc.start_ns = part.start_ns
    if part.end_ns is not None and (acc.end_ns is None or part.end_ns > acc.end_ns):
        acc.end_ns = part.end_ns


def _parse_range(
    parser: ChunkParser, collapser: Collapser, path: str, start: int, end: int, source: str, chunk_bytes: int
) -> tuple[ChunkResult, int]:
    """One byte range of a regular file, read here and summed into one result.

    Line numbers in the result's errors count from the start of the range; the
    caller shifts them.  Returns ``(result, lines)``.
    """
    acc = ChunkResult()
    lines = [0]
    with open(path, "rb") as f:
        for chunk, first in iter_chunks(_RangeReader(f, start, end), collapser, chunk_bytes=chunk_bytes, lines=lines):  # type: ignore[arg-type]
            _merge_part(acc, parser.parse(chunk, source=source, first_line=first))
    return acc, lines[0]


#: Index of the next range to take, shared by the processes of one run (set before forking).
_NEXT_RANGE: multiprocessing.sharedctypes.Synchronized[int] | None = None


def _take_ranges(
    fmt: str, path: str, cuts: list[int], source: str, chunk_bytes: int, options: CollapseOptions
) -> list[tuple[int, ChunkResult, int]]:
    """Take ranges until none is left: ``(index, result, lines)`` of each one taken.

    Ranges are taken one at a time from a shared counter, so a process that
    gets less CPU (a busy machine) takes fewer of them instead of holding the
    others up.
    """
    counter = _NEXT_RANGE
    assert counter is not None
    collapser = get(fmt)
    parser = collapser.parser(options)  # one per process: its caches warm up over the ranges it takes
    out: list[tuple[int, ChunkResult, int]] = []
    while True:
        with counter.get_lock():
            i = counter.value
            counter.value = i + 1
        if i >= len(cuts) - 1:
            return out
        res, n = _parse_range(parser, collapser, path, cuts[i], cuts[i + 1], source, chunk_bytes)
        out.append((i, res, n))


def _range_cuts(path: str, size: int, collapser: Collapser, parts: int) -> list[int]:
    """Offsets cutting ``path`` into ``parts`` ranges of about equal size at record boundaries
    (the first after a byte order mark, which open_input skips too)."""
    cuts = [bom_length(path)]
    with open(path, "rb") as f:
        for i in range(1, parts):
            target = size * i // parts
            back = 1 << 16
            while True:
                lo = max(cuts[-1], target - back)
                f.seek(lo)
                buf = f.read(target - lo)
                cut = collapser.boundary(buf)
                if cut > 0:
                    cuts.append(lo + cut)
                    break
                if lo == cuts[-1]:
                    break  # no boundary since the previous cut: merge the ranges
                back *= 4
    cuts.append(size)
    return sorted(set(cuts))


def _shift_errors(errors: list[str], source: str, by: int) -> list[str]:
    """``source:LINE: why`` with LINE increased by ``by``."""
    out = []
    pre = source + ":"
    for e in errors:
        if by and e.startswith(pre):
            n, sep, why = e[len(pre) :].partition(":")
            if sep and n.isdigit():
                e = f"{pre}{int(n) + by}:{why}"
        out.append(e)
    return out


# -- chunking ----------------------------------------------------------------
def iter_chunks(
    stream: BinaryIO,
    collapser: Collapser,
    *,
    head: bytes = b"",
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    lines: list[int] | None = None,
) -> Iterator[tuple[bytes, int]]:
    """``(chunk, first line number)`` pairs, each chunk ending at a record boundary.

    ``lines[0]`` is increased by the number of lines of each chunk.
    """
    buf = head
    line = 1
    eof = False
    want = chunk_bytes
    while True:
        if len(buf) < want and not eof:
            parts = [buf]
            have = len(buf)
            while have < want:
                d = stream.read(want - have)
                if not d:
                    eof = True
                    break
                parts.append(d)
                have += len(d)
            buf = b"".join(parts)
        if not buf:
            return
        if eof:
            chunk, buf = buf, b""
        else:
            cut = collapser.boundary(buf)
            if cut <= 0:
                # One record larger than a chunk: read on until it ends.
                want = len(buf) * 2
                continue
            chunk, buf = buf[:cut], buf[cut:]
            want = chunk_bytes
        n = chunk.count(b"\n")
        if lines is not None:
            lines[0] += n + (0 if chunk.endswith(b"\n") else 1)
        yield chunk, line
        line += n


#: How far :func:`read_head` reads on for the end of a first line longer than the head
#: (a deep stack in folded text is easily 1 MB on one line).
MAX_HEAD_LINE = 64 << 20


def read_head(stream: BinaryIO, n: int = HEAD_BYTES) -> bytes:
    """The first ``n`` bytes of ``stream`` to guess its format from, read on to the end of
    the first line when that is longer (up to :data:`MAX_HEAD_LINE`): a guess from a cut
    line would refuse a valid long one."""
    parts: list[bytes] = []
    have = 0
    want = n
    newline = False
    while have < want:
        d = stream.read(want - have)
        if not d:
            break
        parts.append(d)
        have += len(d)
        newline = newline or b"\n" in d
        if have >= want and not newline and want < MAX_HEAD_LINE:
            want = min(want * 2, MAX_HEAD_LINE)
    return b"".join(parts)


def open_with_format(path: str | None, fmt: str | None) -> tuple[BinaryIO, bytes, Collapser]:
    """Open an input, read its head, and pick its format (``fmt`` or a guess)."""
    stream = open_input(path)
    try:
        head = read_head(stream)
    except OSError as e:
        stream.close()
        raise InputError(f"cannot read: {e}", source=input_name(path)) from None
    collapser = get(fmt) if fmt else guess(head, source=input_name(path))
    if collapser.name == "folded" and is_differential(head):
        stream.close()
        raise InputError(
            "this is differential folded input ('stack BEFORE AFTER', as difffolded.pl writes): read as folded, "
            "its BEFORE count would end every leaf's name; draw it with 'flamed svg', "
            "or give 'flamed diff' the two profiles",
            source=input_name(path),
        )
    return stream, head, collapser


# -- driver ------------------------------------------------------------------
def collapse(
    inputs: Sequence[str | None],
    *,
    fmt: str | None = None,
    options: CollapseOptions | None = None,
    jobs: int = 1,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    progress_stream: TextIO | None = None,
) -> CollapseResult:
    """Collapse ``inputs`` (paths; ``None``/``-`` is stdin) into one Profile.

    ``progress_stream``: where to draw a progress bar (only drawn when it is a
    terminal and the input is larger than :data:`PROGRESS_MIN_BYTES`).
    """
    # Parsing allocates many small lists and tuples and makes no reference
    # cycles; the cyclic GC would scan the growing caches and results over and
    # over (a sixth of the run time on a 200 MB perf script). Forked workers
    # inherit the setting.
    was = gc.isenabled()
    gc.disable()
    try:
        with reading(progress_stream, list(inputs) or [None], "collapse") as prog:
            return _collapse(inputs, fmt=fmt, options=options, jobs=jobs, chunk_bytes=chunk_bytes, prog=prog)
    finally:
        if was:
            gc.enable()


def _collapse(
    inputs: Sequence[str | None],
    *,
    fmt: str | None = None,
    options: CollapseOptions | None = None,
    jobs: int = 1,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    prog: Progress | None = None,
) -> CollapseResult:
    opts = options if options is not None else CollapseOptions()
    if not inputs:
        inputs = [None]
    stats = ReadStats()
    groups: dict[str, dict[str, Weight]] = {}
    order: list[str] = []
    event_weight: dict[str, Weight] = {}
    left_out = ChunkResult()  # its dropped: what --event left out
    notes: set[str] = set()
    result = CollapseResult(profile=Profile(), stats=stats)
    lo: int | None = None
    hi: int | None = None

    # Stacks of inputs whose format has no events (folded, py-spy, traces...):
    # kept whatever event is chosen among the perf scripts of the same run
    # (they were once filed as "samples without an event field" and left out).
    plain: dict[str, Weight] = {}

    def merge(part: ChunkResult, has_events: bool = True) -> None:
        nonlocal lo, hi
        stats.merge(part.stats)
        notes.update(part.notes)
        left_out.merge_dropped(part)
        if part.start_ns is not None and (lo is None or part.start_ns < lo):
            lo = part.start_ns
        if part.end_ns is not None and (hi is None or part.end_ns > hi):
            hi = part.end_ns
        if not has_events:
            for ev in part.order:
                src = part.groups[ev]
                if not plain:
                    plain.update(src)
                else:
                    for k, w in src.items():
                        plain[k] = plain.get(k, 0) + w
            return
        for ev in part.order:
            src = part.groups[ev]
            dst = groups.get(ev)
            if dst is None:
                groups[ev] = dst = {}
                order.append(ev)
                event_weight[ev] = 0
            if not dst:
                dst.update(src)
            else:
                for k, w in src.items():
                    dst[k] = dst.get(k, 0) + w
            event_weight[ev] += sum(src.values())

    lines_seen = [0]

    def tasks() -> Iterator[tuple[str, bytes, str, int]]:
        for path in inputs:
            stream, head, collapser = open_with_format(path, fmt)
            name = input_name(path)
            result.formats[name] = collapser.name
            try:
                for chunk, first in iter_chunks(stream, collapser, head=head, chunk_bytes=chunk_bytes, lines=lines_seen):
                    yield collapser.name, chunk, name, first
            except OSError as e:
                raise InputError(f"cannot read: {e}", source=name) from None
            finally:
                stream.close()

    ranged = _ranged_inputs(inputs, fmt, jobs, chunk_bytes) if jobs > 1 and not opts.strict else None
    if ranged is not None:
        # Regular files: each process (this one included) reads and collapses
        # byte ranges of the file itself and sends back one summed result per
        # range, so no input passes through this process and only unique
        # stacks travel.
        global _NEXT_RANGE
        import multiprocessing

        _NEXT_RANGE = multiprocessing.get_context("fork").Value("l", 0)
        rpool = _start_pool(jobs - 1, _ignore_sigint)
        rworkers = pool_workers(rpool)
        try:
            for path, name, collapser, size in ranged:
                result.formats[name] = collapser.name
                # A few ranges per process: small enough to balance the load,
                # large enough that each one's result (its unique stacks) is
                # worth sending.
                cuts = _range_cuts(path, size, collapser, max(jobs, min(4 * jobs, 2 * size // chunk_bytes)))
                _NEXT_RANGE.value = 0
                args = (collapser.name, path, cuts, name, chunk_bytes, opts)
                remote = [rpool.apply_async(_take_ranges, args) for _ in range(jobs - 1)]
                parts = _take_ranges(*args)
                for r in remote:
                    parts.extend(wait_result(r, rworkers))
                if prog is not None:
                    prog.reached(name, size)  # read by range, past open_input's count
                # Ranges are summed in input order, so events keep their order of
                # first appearance and the first errors stay the first.
                parts.sort(key=lambda t: t[0])
                base = 0
                for _, part, nlines in parts:
                    part.stats.first_errors = _shift_errors(part.stats.first_errors, name, base)
                    merge(part, collapser.has_events)
                    base += nlines
                lines_seen[0] += base
        finally:
            _stop_pool(rpool)
            _NEXT_RANGE = None
        inputs = []
    elif jobs > 1 and _plain_files_below(inputs, 2 * jobs * chunk_bytes):
        # Regular files too small to be read by range: piping their chunks to
        # workers costs more than parsing them here (a 12 MB perf script is
        # parsed faster than a pool of processes is fed).
        jobs = 1

    local: dict[str, ChunkParser] = {}
    pool = None
    workers: list[Any] = []
    try:
        window: deque[tuple[multiprocessing.pool.AsyncResult[ChunkResult], bool]] = deque()
        it = tasks() if inputs else iter(())
        first = next(it, None)
        second = next(it, None) if first is not None else None
        if second is None:
            jobs = 1  # one chunk: starting worker processes would cost more than it saves
        pending = [t for t in (first, second) if t is not None]

        def all_tasks() -> Iterator[tuple[str, bytes, str, int]]:
            yield from pending
            yield from it

        for task in all_tasks():
            if jobs <= 1:
                p = local.get(task[0])
                if p is None:
                    p = local[task[0]] = get(task[0]).parser(opts)
                merge(p.parse(task[1], source=task[2], first_line=task[3]), get(task[0]).has_events)
                continue
            if pool is None:
                # Fork: the workers start in milliseconds and share the imported code.
                pool = _start_pool(jobs, _init_worker, (opts,))
                workers = pool_workers(pool)
            window.append((pool.apply_async(_parse_task, (task,)), get(task[0]).has_events))
            while len(window) >= 2 * jobs:
                pending_part, has_events = window.popleft()
                merge(wait_result(pending_part, workers), has_events)
        while window:
            pending_part, has_events = window.popleft()
            merge(wait_result(pending_part, workers), has_events)
    finally:
        if pool is not None:
            _stop_pool(pool)

    stats.lines = lines_seen[0]
    result.events = dict(event_weight)
    chosen: list[str]
    if opts.event is not None:
        chosen = [e for e in order if e == opts.event or _event_matches(e, opts.event)]
        if not chosen and order and any(e for e in order):
            raise InputError(
                f"no samples of event {opts.event!r}; the input has: {', '.join(repr(e) for e in order)}",
                source=", ".join(result.formats) or None,
            )
        dropped = left_out.dropped
        if dropped:
            # As without --event: what is left out is named, with its weight.
            n_out = sum(n for n, _ in dropped.values())
            kept = sum(event_weight[e] for e in chosen)
            others = ", ".join(
                f"{e or 'samples without an event field'} ({_n_samples(n)}, weight {_fmt_w(w)})"
                for e, (n, w) in ((e, dropped[e]) for e in order if e in dropped)
            )
            head = (
                f"kept event {', '.join(repr(e) for e in chosen)} (--event {opts.event!r}, weight {_fmt_w(kept)})"
                if chosen
                else f"no samples of event {opts.event!r} (--event)"
            )
            result.messages.append(
                f"{head}; left out {_n_samples(n_out)} of other events "
                f"(weight {_fmt_w(sum(w for _, w in dropped.values()))}): {others}"
            )
    else:
        # The first named event, under every spelling of its modifiers (cycles:u, cycles), as one.
        # Samples without an event field ("" -- perf script -F without event, or lines
        # read as such headers) are kept only when no sample names an event: one of
        # them first in the input must not hide the real event.
        named = [e for e in order if e]
        if named:
            keep = named[0]
            chosen = [e for e in named if event_base(e) == event_base(keep)]
        else:
            keep = order[0] if order else ""
            chosen = list(order)
        rest = [e for e in order if e not in chosen]
        if rest:
            # Whatever is left out is named with its weight: nothing is dropped silently.
            kept = sum(event_weight[e] for e in chosen)
            alias = "".join(f", with {e!r}" for e in chosen[1:])
            where = "the first in the input" if order[0] == keep else "the first named in the input"
            others = ", ".join(
                f"{e or 'samples without an event field'} ({_fmt_w(event_weight[e])})" for e in rest
            )
            result.messages.append(
                f"kept event {keep!r}{alias} ({where}, weight {_fmt_w(kept)}); "
                f"also present: {others}; choose one with --event"
            )
    texts: dict[str, Weight] = plain
    for e in chosen:
        g = groups[e]
        if not texts:
            texts = g
        else:
            for k, w in g.items():
                texts[k] = texts.get(k, 0) + w
    # One split per distinct stack; the frame strings are interned so equal
    # frames of different stacks share memory.
    # Popping as we go frees each text as its tuple is made: the peak holds one
    # form of each stack, not both.
    intern = sys.intern
    stacks: dict[Stack, Weight] = {}
    groups.clear()
    while texts:
        k, w = texts.popitem()
        st: Stack = tuple(map(intern, k.split(";"))) if k else (EMPTY_STACK_FRAME,)
        stacks[st] = stacks.get(st, 0) + w
    result.kept_event = chosen[0] if chosen and chosen[0] else None
    result.profile = Profile(stacks=stacks, start_ns=lo, end_ns=hi)
    result.messages.extend(sorted(notes))
    return result


def _ranged_inputs(
    inputs: Sequence[str | None], fmt: str | None, jobs: int, chunk_bytes: int
) -> list[tuple[str, str, Collapser, int]] | None:
    """``(path, name, format, size)`` of each input when all can be read by range, else None.

    That takes regular uncompressed files (workers seek in them), large enough
    for two chunks per process, of formats whose weights are integers (so
    summing per range, then ranges, gives exactly the sums of ``--jobs 1``).
    """
    out: list[tuple[str, str, Collapser, int]] = []
    for path in inputs:
        size = input_size(path)
        if path is None or size is None or size < 2 * jobs * chunk_bytes:
            return None
        stream, _, collapser = open_with_format(path, fmt)
        try:
            plain = type(stream) is io.BufferedReader
        finally:
            stream.close()
        if not plain or not collapser.integer_weights:
            return None
        out.append((str(path), input_name(path), collapser, size))
    return out


def _plain_files_below(inputs: Sequence[str | None], limit: int) -> bool:
    """True when every input is a regular uncompressed file and together they are under ``limit`` bytes."""
    total = 0
    for path in inputs:
        size = input_size(path)
        if path is None or path == "-" or size is None:
            return False
        with open_input(path) as f:
            if type(f) is not io.BufferedReader:
                return False  # gzip: its size says little about the text inside
        total += size
    return total < limit


def _fmt_w(w: Weight) -> str:
    return f"{w:,}" if isinstance(w, int) else f"{w:,.3f}"


def _n_samples(n: int) -> str:
    return f"{n:,} sample{'s' if n != 1 else ''}"


def default_jobs() -> int:
    """Worker processes by default: the CPUs this process may run on, at most 8."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(8, n))


def read_profile(
    paths: list[str] | tuple[str, ...],
    *,
    fmt: str | None = None,
    strict: bool = False,
    stats: object | None = None,
    jobs: int = 1,
    options: CollapseOptions | None = None,
) -> object:
    """Any supported input(s) -> one :class:`flamed.model.Profile` (format guessed per input).

    For commands that accept perf script, bcc, py-spy, traces or folded alike.
    ``stats`` (a :class:`flamed.folded.ReadStats`) receives the line counts.
    """
    opts = options if options is not None else CollapseOptions()
    if strict and not opts.strict:
        opts = replace(opts, strict=True)
    inputs: list[str | None] = list(paths) or [None]
    res = collapse(inputs, fmt=fmt, options=opts, jobs=jobs)
    if isinstance(stats, ReadStats):
        stats.merge(res.stats)
    return res.profile
