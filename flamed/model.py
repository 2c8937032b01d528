"""The data model every source, format and tool of flamed goes through.

Two types sit at the centre:

* :class:`Profile` -- a mapping from a stack (tuple of frames, root first) to a
  weight, with the time range it covers, the sample rate and free-form labels.
  Merge, filter, diff, top, render and export take and give Profiles.
* :class:`Sample` and sample streams -- time-ordered records (timestamp ns,
  pid, tid, stack, weight) for the paths that keep time.  Streams are plain
  iterators; :func:`merge_streams` merges many by timestamp without loading
  them.

Frames are ``str``.  Input bytes that are not valid UTF-8 are decoded with
``surrogateescape`` (see :func:`decode_frame`) so that writing them back gives
the original bytes.  Conventions carried in frame text:

* kernel frames end in ``_[k]`` (perf/bcc),
* Python frames look like ``func (path/file.py:line)`` (py-spy),
* a root frame ``comm-PID`` or ``comm-PID/TID`` names the task (stackcollapse-perf's
  ``--pid``/``--tid`` convention), ``comm-?/TID`` a thread whose pid the capture
  did not record (perf script's default output); :func:`parse_task_frame` reads
  it back, :func:`task_frame` writes it.  ``comm-?`` (what ``collapse --pid``
  writes when the capture has no pid) names no id and is not a task: it reads
  back whole, as a command, so nothing labels, remaps or splits by it.
"""

from __future__ import annotations

import dataclasses
import heapq
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Union

Frame = str
Stack = tuple[str, ...]
Weight = Union[int, float]

KERNEL_SUFFIX = "_[k]"
#: Replaces a ``;`` inside a frame name, which folded text cannot represent.
SEMICOLON_REPLACEMENT = ":"
#: Placeholder for a sample that arrived without any frame.
EMPTY_STACK_FRAME = "[no frames]"

#: ``Profile.labels["kind"]`` of a profile whose weights are times (with
#: ``labels["unit"]`` saying which), and what it measures; a profile without
#: it counts CPU samples (docs/offcpu.md).
TIME_KINDS = {"off_cpu": "off-CPU time", "wall": "wall-clock time"}
#: Short names of time units, for tooltips and tables.
UNIT_ABBREV = {"nanoseconds": "ns", "microseconds": "\u00b5s", "milliseconds": "ms", "seconds": "s"}
#: Nanoseconds per weight of a profile of times, by ``labels["unit"]``.
UNIT_NS = {"nanoseconds": 1, "microseconds": 1000, "milliseconds": 1_000_000, "seconds": 1_000_000_000}

_PY_FRAME = re.compile(r".* \([^()]*\.pyx?:\d+\)$|.* \([^()]*\.pyx?\)$")
_TASK_FRAME = re.compile(r"^(?P<comm>.*)-(?:(?P<pid>\d+)(?:/(?P<tid>\d+))?|\?/(?P<qtid>\d+))$")


def decode_frame(raw: bytes) -> str:
    """Bytes from an input file to a frame string, keeping invalid UTF-8 byte-exact."""
    return raw.decode("utf-8", "surrogateescape")


def encode_frame(frame: str) -> bytes:
    """Inverse of :func:`decode_frame`."""
    return frame.encode("utf-8", "surrogateescape")


def sanitize_frame(name: str) -> str:
    """Make ``name`` representable as one folded frame.

    ``;`` separates frames, and newlines end records, so both are replaced:
    ``;`` by ``:`` (``[u8; 32]`` becomes ``[u8: 32]``), CR/LF by a space.
    An empty name becomes ``[unknown]``.
    """
    if ";" in name:
        name = name.replace(";", SEMICOLON_REPLACEMENT)
    if "\n" in name or "\r" in name:
        name = name.replace("\r", " ").replace("\n", " ")
    return name if name else "[unknown]"


def fold_safe(name: str) -> str:
    """``name`` as one frame of folded text, changed no more than that needs:
    ``;`` becomes ``:`` and LF a space.  Unlike :func:`sanitize_frame` it keeps
    a CR (it cannot end a record inside a line) and an empty name (``a;;b``),
    as folded text itself does: for names read from formats whose frames are
    not folded text (pprof, speedscope), so that a round trip through them is
    exact for every stack folded text can hold."""
    if ";" in name:
        name = name.replace(";", SEMICOLON_REPLACEMENT)
    if "\n" in name:
        name = name.replace("\n", " ")
    return name


def is_kernel_frame(frame: str) -> bool:
    return frame.endswith(KERNEL_SUFFIX)


def is_python_frame(frame: str) -> bool:
    return _PY_FRAME.match(frame) is not None


def frame_kind(frame: str) -> str:
    """``kernel``, ``python`` or ``native``: what palettes and filters tell apart."""
    if is_kernel_frame(frame):
        return "kernel"
    if is_python_frame(frame):
        return "python"
    return "native"


@dataclass(frozen=True, slots=True)
class Task:
    comm: str
    pid: int | None = None
    tid: int | None = None


def parse_task_frame(frame: str) -> Task:
    """Read the task out of a root frame ``comm``, ``comm-PID``, ``comm-PID/TID`` or
    ``comm-?/TID`` (a thread of an unknown process: ``pid`` is None, ``tid`` is not).

    ``comm-?`` carries no id: it is read as the command ``comm-?`` (no task), so a
    command whose name ends in ``-?`` is not cut.
    """
    m = _TASK_FRAME.match(frame)
    if m is None:
        return Task(comm=frame)
    pid = m.group("pid")
    if pid is None:
        return Task(comm=m.group("comm"), tid=int(m.group("qtid")))
    tid = m.group("tid")
    return Task(comm=m.group("comm"), pid=int(pid), tid=int(tid) if tid else None)


def is_task(task: Task) -> bool:
    """True when a root frame named a task (a pid, a tid or both), not only a command."""
    return task.pid is not None or task.tid is not None


def task_frame(comm: str, pid: int | None = None, tid: int | None = None) -> str:
    """The root frame for a task, the inverse of :func:`parse_task_frame`
    (``comm-?/TID`` for a tid without a pid)."""
    comm = sanitize_frame(comm)
    if pid is None:
        return comm if tid is None else f"{comm}-?/{tid}"
    if tid is None:
        return f"{comm}-{pid}"
    return f"{comm}-{pid}/{tid}"


def task_root(root: str, pid: int | None, tid: int | None, as_pid: int | None, as_tid: int | None) -> str:
    """The root frame that names task ``(pid, tid)`` as ``(as_pid, as_tid)``,
    for a sample whose stack starts with ``root``: the task's bare command
    (perf script's) or a ``comm-PID/TID`` frame of that same task (a trace's)."""
    task = parse_task_frame(root)
    if task.pid == pid and task.tid == tid:
        return root if (as_pid, as_tid) == (pid, tid) else task_frame(task.comm, as_pid, as_tid)
    return task_frame(root, as_pid, as_tid)


#: The largest int64: counts and times the formats carry (folded counts, pprof values).
INT64_MAX = 2**63 - 1


def stack_excerpt(stack: Stack, width: int = 80) -> str:
    """``stack`` as folded text cut to ``width`` characters, for a message."""
    text = ";".join(stack)
    return text if len(text) <= width else text[: width - 3] + "..."


#: What a terminal would act on rather than show: C0 and C1 controls and DEL
#: (escape sequences can retitle the window, rewrite the screen or, in some
#: terminals, write files), the bidirectional controls that reorder a line
#: (a table's columns), and the lone surrogates decoding leaves for bytes that
#: are not UTF-8 (written back raw, a 0x9b byte is a C1 CSI).
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def _shown(m: re.Match[str]) -> str:
    c = ord(m.group())
    if 0xDC80 <= c <= 0xDCFF:
        return "\\x%02x" % (c - 0xDC00)
    return "\\x%02x" % c if c < 0x100 else "\\u%04x" % c


def printable(text: str) -> str:
    """``text`` for a terminal: the characters it would act on (controls,
    escape sequences, bidirectional overrides, invalid UTF-8 bytes) shown as
    ``\\xNN`` / ``\\uNNNN``, as the SVG shows them.  Frame names, thread names
    and command lines come from any process on the host, so every text table
    goes through this; the data formats (folded, CSV, JSON) keep the bytes."""
    return _UNPRINTABLE.sub(_shown, text) if _UNPRINTABLE.search(text) else text


def normalize_weight(w: Weight) -> Weight:
    """Integral floats become ints, so ``3.0`` and ``3`` print alike."""
    if isinstance(w, float) and w.is_integer() and abs(w) < 2**63:
        return int(w)
    return w


def tidy_weight(w: Weight) -> Weight:
    """A sum of float weights rounded to 12 significant digits, for reports:
    what the input's decimals add up to (0.1 + 0.2 is 0.3, not
    0.30000000000000004), so two sums of the same weights in another order
    compare equal instead of differing by 1e-16.  Integers are unchanged."""
    if isinstance(w, float) and w == w and abs(w) != float("inf"):
        return normalize_weight(float(f"{w:.12g}"))
    return normalize_weight(w)


def format_weight(w: Weight) -> str:
    w = normalize_weight(w)
    if isinstance(w, int):
        return str(w)
    text = repr(w)
    if "e" in text or "E" in text:
        text = f"{w:.17f}".rstrip("0").rstrip(".")
    return text


@dataclass
class Profile:
    """Stacks (root first) to weights, plus the time range, rate and labels.

    ``start_ns``/``end_ns`` are nanoseconds since the Unix epoch (``None`` when
    unknown), ``sample_rate`` is in Hz, ``labels`` holds host, pid, comm, unit
    of the weights (``"unit": "samples"`` by default) and the like.
    """

    stacks: dict[Stack, Weight] = field(default_factory=dict)
    start_ns: int | None = None
    end_ns: int | None = None
    sample_rate: float | None = None
    labels: dict[str, str] = field(default_factory=dict)

    # -- building --------------------------------------------------------
    def add(self, stack: Iterable[str], weight: Weight = 1) -> None:
        key = stack if isinstance(stack, tuple) else tuple(stack)
        if not key:
            key = (EMPTY_STACK_FRAME,)
        stacks = self.stacks
        stacks[key] = stacks.get(key, 0) + weight

    def update(self, other: Mapping[Stack, Weight]) -> None:
        stacks = self.stacks
        for k, w in other.items():
            stacks[k] = stacks.get(k, 0) + w

    # -- reading ---------------------------------------------------------
    def total(self) -> Weight:
        return normalize_weight(sum(self.stacks.values()))

    def __len__(self) -> int:
        return len(self.stacks)

    def sorted_items(self) -> list[tuple[Stack, Weight]]:
        """Stacks in a stable order (by frames), as every writer emits them."""
        return sorted(self.stacks.items(), key=lambda kv: kv[0])

    @property
    def duration_ns(self) -> int | None:
        if self.start_ns is None or self.end_ns is None:
            return None
        return self.end_ns - self.start_ns

    def copy(self, stacks: dict[Stack, Weight] | None = None) -> Profile:
        return dataclasses.replace(
            self, stacks=dict(self.stacks) if stacks is None else stacks, labels=dict(self.labels)
        )

    # -- algebra ---------------------------------------------------------
    def merged(self, *others: Profile) -> Profile:
        """Sum of this and ``others``: weights add, the time range is the union.

        Labels that agree are kept; labels that disagree are dropped.  The sample
        rate is kept when all agree, else ``None``.
        """
        out = self.copy()
        for o in others:
            out.update(o.stacks)
            out.start_ns = _min_opt(out.start_ns, o.start_ns)
            out.end_ns = _max_opt(out.end_ns, o.end_ns)
            if out.sample_rate != o.sample_rate:
                out.sample_rate = None
            out.labels = {k: v for k, v in out.labels.items() if o.labels.get(k) == v}
        return out

    def scaled(self, factor: float) -> Profile:
        return self.copy({k: normalize_weight(w * factor) for k, w in self.stacks.items()})

    def filtered(
        self,
        *,
        frame: str | re.Pattern[str] | None = None,
        exclude_frame: str | re.Pattern[str] | None = None,
        pid: int | Iterable[int] | None = None,
        tid: int | Iterable[int] | None = None,
        comm: str | re.Pattern[str] | None = None,
        predicate: Callable[[Stack], bool] | None = None,
    ) -> Profile:
        """Keep the stacks that match every given condition.

        ``frame``: some frame matches the regex (``re.search``).
        ``exclude_frame``: no frame matches.
        ``pid``/``tid``/``comm``: the task in the root frame (see
        :func:`parse_task_frame`) matches; stacks whose root carries no pid never
        match a pid filter.
        """
        fre = re.compile(frame) if isinstance(frame, str) else frame
        xre = re.compile(exclude_frame) if isinstance(exclude_frame, str) else exclude_frame
        cre = re.compile(comm) if isinstance(comm, str) else comm
        pids = _as_set(pid)
        tids = _as_set(tid)

        def keep(stack: Stack) -> bool:
            if fre is not None and not any(fre.search(f) for f in stack):
                return False
            if xre is not None and any(xre.search(f) for f in stack):
                return False
            if pids is not None or tids is not None or cre is not None:
                task = parse_task_frame(stack[0])
                if pids is not None and task.pid not in pids:
                    return False
                if tids is not None and task.tid not in tids:
                    return False
                if cre is not None and not cre.search(task.comm):
                    return False
            if predicate is not None and not predicate(stack):
                return False
            return True

        return self.copy({k: w for k, w in self.stacks.items() if keep(k)})

    def map_stacks(self, fn: Callable[[Stack], Stack | None]) -> Profile:
        """Rewrite every stack with ``fn`` (``None`` drops it); weights of equal results add."""
        out: dict[Stack, Weight] = {}
        for k, w in self.stacks.items():
            nk = fn(k)
            if nk is None:
                continue
            out[nk] = out.get(nk, 0) + w
        return self.copy(out)


def _as_set(v: int | Iterable[int] | None) -> set[int] | None:
    if v is None:
        return None
    if isinstance(v, int):
        return {v}
    return set(v)


def _min_opt(a: int | None, b: int | None) -> int | None:
    if a is None:
        return b
    if b is None:
        return a
    return min(a, b)


def _max_opt(a: int | None, b: int | None) -> int | None:
    if a is None:
        return b
    if b is None:
        return a
    return max(a, b)


# ---------------------------------------------------------------------------
# Sample streams


@dataclass(frozen=True, slots=True)
class Sample:
    """One timestamped sample. ``time_ns``: ns since the epoch (or the source's clock)."""

    time_ns: int
    stack: Stack
    weight: Weight = 1
    pid: int | None = None
    tid: int | None = None
    source: int = 0  # index of the input it came from, after a merge


SampleStream = Iterator[Sample]


def merge_streams(streams: Iterable[Iterable[Sample]]) -> Iterator[Sample]:
    """K-way merge of time-ordered streams by ``time_ns``; stable across inputs.

    Memory is one pending sample per stream.  Ties keep input order (stream 0
    first), so the result is deterministic.
    """
    return heapq.merge(*streams, key=lambda s: s.time_ns)


def profile_from_samples(
    samples: Iterable[Sample],
    *,
    sample_rate: float | None = None,
    labels: dict[str, str] | None = None,
) -> Profile:
    """Aggregate a stream into a Profile whose time range is that of the samples."""
    p = Profile(sample_rate=sample_rate, labels=dict(labels or {}))
    stacks = p.stacks
    lo: int | None = None
    hi: int | None = None
    for s in samples:
        stacks[s.stack] = stacks.get(s.stack, 0) + s.weight
        t = s.time_ns
        if lo is None or t < lo:
            lo = t
        if hi is None or t > hi:
            hi = t
    p.start_ns, p.end_ns = lo, hi
    return p


def filter_time(samples: Iterable[Sample], start_ns: int | None, end_ns: int | None) -> Iterator[Sample]:
    """Samples with ``start_ns <= time_ns < end_ns`` (either bound may be ``None``)."""
    for s in samples:
        if start_ns is not None and s.time_ns < start_ns:
            continue
        if end_ns is not None and s.time_ns >= end_ns:
            continue
        yield s


def time_unit_ns(profile: Profile) -> int | None:
    """Nanoseconds per weight of a profile of times (``kind`` and ``unit``
    labels: off-CPU or wall-clock time); None for sample counts."""
    if profile.labels.get("kind", "") not in TIME_KINDS:
        return None
    return UNIT_NS.get(profile.labels.get("unit", ""))


def time_kind(profile: Profile) -> tuple[str, str] | None:
    """``(what it measures, short unit)`` of a profile of times (``kind`` and
    ``unit`` labels), e.g. ``("off-CPU time", "µs")``; None for sample counts."""
    what = TIME_KINDS.get(profile.labels.get("kind", ""))
    unit = profile.labels.get("unit", "")
    if what is None or unit not in UNIT_ABBREV:
        return None
    return what, UNIT_ABBREV[unit]
