"""pprof: gzipped ``profile.proto``, what ``go tool pprof`` and most profiling UIs read.

Written with the ``protobuf`` package through the generated module
:mod:`flamed.outputs.profile_pb2` (from ``profile.proto`` beside it).

How flamed's frames map onto pprof:

* one Location per distinct frame (no addresses are known), one Line each;
* Python frames ``func (path/file.py:N)`` become Function ``func`` in file
  ``path/file.py`` and a Line with number ``N`` -- so ``pprof -top`` groups a
  function's lines and ``-lines`` still tells them apart;
* kernel frames ``name_[k]`` become Function ``name`` in a Mapping
  ``[kernel.kallsyms]``; frames that name their module (``[libc.so.6]``,
  ``libc.so.6`func``) get a Mapping of that file;
* every other frame is a Function of that exact name, with no ``system_name``
  (pprof "simplifies" a name equal to its system name, see :func:`to_proto`);
* the first Mapping, which pprof reports as the profile's ``File:``, is the
  main binary: the command of the heaviest task (:func:`main_binary`);
* sample types ``samples/count`` and, when the sample rate is known,
  ``cpu/nanoseconds`` (count times the period ``1e9/rate``), the latter the
  default, as in Go's CPU profiles; ``time_nanos``/``duration_nanos`` from the
  Profile's time range; the task of a ``comm-PID/TID`` root frame as numeric
  ``pid``/``tid`` sample labels (``comm-?/TID``: ``tid`` only); Profile labels as ``key=value`` comments.

pprof values are int64: fractional weights are rounded, and a profile whose
weights (or times) sum past 2^63-1 is an error, as pprof's readers would
overflow summing them. pprof strings are
UTF-8: an invalid byte of a frame (kept by the folded reader) is written as the
text ``\\xNN``, as the SVG shows it.

:func:`read_pprof` reads pprof files (ours and others', gzipped or not) back
into a Profile; for files written here, ``read_pprof(write_pprof(p))``
gives ``p``'s stacks, weights, time range, rate and labels.
"""

from __future__ import annotations

import gzip
import io
import re
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO

from flamed.errors import FlamedError, InputError
from flamed.fileio import GZIP_MAGIC
from flamed.folded import ReadStats
from flamed.model import (
    EMPTY_STACK_FRAME,
    INT64_MAX,
    KERNEL_SUFFIX,
    TIME_KINDS,
    UNIT_NS,
    Profile,
    Stack,
    Weight,
    normalize_weight,
    parse_task_frame,
    fold_safe,
    stack_excerpt,
    time_unit_ns,
)
from flamed.outputs.base import OutputFormat, OutputOptions
from flamed.progress import counted

if TYPE_CHECKING:
    # protobuf is imported by the functions that build or read messages: every
    # command lists the output formats, few write pprof.
    from flamed.outputs import profile_pb2 as pb

KERNEL_MAPPING = "[kernel.kallsyms]"
_PY = re.compile(r"^(?P<name>.*) \((?P<file>[^()]*\.pyx?):(?P<line>[1-9][0-9]{0,9})\)$", re.S)
_BRACKET_MODULE = re.compile(r"^\[(?P<module>[^\[\]]+\.so[^\[\]]*|[^\[\]]+)\]$")
_BACKTICK = re.compile(r"^(?P<module>[^`]+)`(?P<name>.+)$", re.S)
#: A sample with labels of its own: (stack root first, weight, {label: value}).
LabelledSample = tuple[Stack, Weight, Mapping[str, str]]
#: Comment carrying the exact sample rate (a period in ns cannot hold e.g. 99 Hz exactly).
_RATE_COMMENT = "flamed.sample_rate="


@dataclass(frozen=True, slots=True)
class FrameInfo:
    """What pprof is told about one frame."""

    name: str
    filename: str = ""
    line: int = 0
    mapping: str = ""


def frame_info(frame: str) -> FrameInfo:
    """The Function name, file, line and mapping of a flamed frame."""
    if frame.endswith(KERNEL_SUFFIX):
        return FrameInfo(frame[: -len(KERNEL_SUFFIX)], mapping=KERNEL_MAPPING)
    m = _PY.match(frame)
    if m is not None:
        return FrameInfo(m.group("name"), m.group("file"), int(m.group("line")))
    m = _BRACKET_MODULE.match(frame)
    if m is not None and m.group("module") != "unknown":
        return FrameInfo(frame, mapping=m.group("module"))
    m = _BACKTICK.match(frame)
    if m is not None:
        return FrameInfo(frame, mapping=m.group("module"))
    return FrameInfo(frame)


def main_binary(profile: Profile) -> str:
    """The command that stands for the profile's main binary: the ``comm`` label, else the
    command of the heaviest root frame (kernel idle threads ``swapper/N`` aside); "" if none."""
    if profile.labels.get("comm"):
        return profile.labels["comm"]
    per_root: dict[str, Weight] = {}
    for stack, w in profile.stacks.items():
        if stack and w > 0:
            per_root[stack[0]] = per_root.get(stack[0], 0) + w
    best = ""
    best_w: Weight = 0
    for root in sorted(per_root):
        comm = parse_task_frame(root).comm
        # A marker is no command (a profile without task frames: its roots are frames).
        if not comm or comm.startswith(("swapper", "[")) or comm == EMPTY_STACK_FRAME:
            continue
        if per_root[root] > best_w:
            best, best_w = comm, per_root[root]
    return best


def function_name(frame: str) -> str:
    """The name pprof shows for ``frame`` (what ``pprof -top`` groups by)."""
    return frame_info(frame).name


#: Lone surrogates: invalid UTF-8 bytes kept by surrogateescape decoding (U+DC80-U+DCFF), or
#: read as such from JSON; a proto3 string must be valid UTF-8 and cannot hold them.
_SURROGATE = re.compile("[\ud800-\udfff]")


def _surrogate_text(m: re.Match[str]) -> str:
    c = ord(m.group())
    return "\\x%02x" % (c - 0xDC00) if 0xDC80 <= c <= 0xDCFF else "\\u%04x" % c


def utf8_text(s: str) -> str:
    """``s`` as valid UTF-8 text: an invalid byte is written ``\\xNN``, as the SVG shows it,
    so that frames differing only in their invalid bytes stay apart."""
    return s if s.isascii() or _SURROGATE.search(s) is None else _SURROGATE.sub(_surrogate_text, s)


class _Strings:
    def __init__(self, table: list[str]) -> None:
        self.table = table
        self.index: dict[str, int] = {}
        self.get("")

    def get(self, s: str) -> int:
        i = self.index.get(s)
        if i is None:
            text = utf8_text(s)
            i = self.index.get(text) if text is not s else None
            if i is None:
                i = len(self.table)
                self.table.append(text)
                self.index[text] = i
            self.index[s] = i
        return i


def to_proto(profile: Profile, labelled: Iterable[LabelledSample] | None = None) -> pb.Profile:
    """The pprof message of ``profile`` (deterministic: stacks sorted, ids in first-use order).

    ``labelled``: the samples with string labels of their own (the daemon's
    pid/comm/thread/host), written instead of ``profile``'s stacks, which then
    only give the time range, rate and comments.
    """
    from flamed.outputs import profile_pb2 as pb

    msg = pb.Profile()
    strings = _Strings(msg.string_table)
    s = strings.get
    unit = profile.labels.get("unit", "samples")
    # Off-CPU and wall-clock time as the OpenTelemetry profiler and Parca
    # name them: one value, in nanoseconds.
    kind = profile.labels.get("kind", "")
    time_scale = time_unit_ns(profile) or 0
    if time_scale:
        msg.sample_type.append(pb.ValueType(type=s(kind), unit=s("nanoseconds")))
        msg.default_sample_type = s(kind)
    else:
        count_type = pb.ValueType(type=s("samples" if unit == "samples" else unit), unit=s("count"))
        msg.sample_type.append(count_type)
    period = 0
    if profile.sample_rate and profile.sample_rate > 0 and unit == "samples":
        period = max(1, round(1e9 / profile.sample_rate))
        msg.sample_type.append(pb.ValueType(type=s("cpu"), unit=s("nanoseconds")))
        msg.period_type.CopyFrom(pb.ValueType(type=s("cpu"), unit=s("nanoseconds")))
        msg.period = period
        msg.default_sample_type = s("cpu")
        msg.comment.append(s(_RATE_COMMENT + repr(float(profile.sample_rate))))
    if profile.start_ns is not None:
        msg.time_nanos = profile.start_ns
        if profile.end_ns is not None:
            msg.duration_nanos = max(0, profile.end_ns - profile.start_ns)
    for k in sorted(profile.labels):
        msg.comment.append(s(f"{k}={profile.labels[k]}"))

    mappings: dict[str, int] = {}
    functions: dict[tuple[str, str], int] = {}
    locations: dict[str, int] = {}
    main = main_binary(profile)
    if main:
        # pprof takes the first mapping for the main binary (its "File:" header and title).
        mappings[main] = 1
        msg.mapping.add(id=1, filename=s(main), has_functions=True)

    def location(frame: str) -> int:
        lid = locations.get(frame)
        if lid is not None:
            return lid
        info = frame_info(frame)
        mid = 0
        if info.mapping:
            mid = mappings.get(info.mapping, 0)
            if not mid:
                mid = len(mappings) + 1
                mappings[info.mapping] = mid
                msg.mapping.add(id=mid, filename=s(info.mapping), has_functions=True)
        fkey = (info.name, info.filename)
        fid = functions.get(fkey)
        if fid is None:
            fid = len(functions) + 1
            functions[fkey] = fid
            # No system_name: pprof treats a function whose system_name equals its name as
            # not demangled yet, and (since it looks like C++) strips every <...> and (...)
            # from it, which turns "<[u8: 32] as T>::f" into "::f" and merges template
            # instantiations. flamed's names are already what should be shown.
            msg.function.add(id=fid, name=s(info.name), filename=s(info.filename))
        lid = len(locations) + 1
        locations[frame] = lid
        loc = msg.location.add(id=lid, mapping_id=mid)
        loc.line.add(function_id=fid, line=info.line)
        return lid

    pid_key = tid_key = 0
    entries: Iterable[tuple[Stack, Weight, Mapping[str, str] | None]] = (
        ((st, w, None) for st, w in profile.sorted_items()) if labelled is None else labelled)
    # pprof values are int64, and its readers sum them in int64: a total past
    # INT64_MAX would wrap (go tool pprof shows negative totals and 2000% shares).
    total = cpu_total = 0
    for stack, w, extra in counted(entries, "samples", len(profile.stacks) if labelled is None else None, "stacks"):
        count = int(round(w * time_scale if time_scale else w))
        if count <= 0:
            continue
        total += count
        if total > INT64_MAX:
            raise FlamedError(_too_heavy(f"the weights sum to more than {INT64_MAX}", stack, count))
        sample = msg.sample.add()
        sample.location_id.extend([location(f) for f in reversed(stack)])
        sample.value.append(count)
        if period:
            cpu_total += count * period
            if cpu_total > INT64_MAX:
                raise FlamedError(_too_heavy(
                    f"the samples times the period of {period} ns (the sample rate) sum to more than {INT64_MAX} ns",
                    stack, count))
            sample.value.append(count * period)
        if extra is not None:
            for k, v in extra.items():
                sample.label.add(key=s(k), str=s(v))
            continue
        # Each id the root frame names: comm-PID/TID both, comm-PID the pid, comm-?/TID
        # (a thread of a capture without pids) the tid; comm-? names none.
        task = parse_task_frame(stack[0])
        if task.pid is not None:
            pid_key = pid_key or s("pid")
            sample.label.add(key=pid_key, num=task.pid)
        if task.tid is not None:
            tid_key = tid_key or s("tid")
            sample.label.add(key=tid_key, num=task.tid)
    return msg


def _too_heavy(why: str, stack: Stack, count: int) -> str:
    return (f"cannot write pprof: its values are int64 and {why} "
            f"(at {stack_excerpt(stack)!r}, weighing {count}); scale the input down")


def write_pprof(profile: Profile, out: BinaryIO, labelled: Iterable[LabelledSample] | None = None) -> None:
    data = to_proto(profile, labelled).SerializeToString(deterministic=True)
    # mtime=0 keeps the gzip header, and so the file, byte-stable.
    with gzip.GzipFile(fileobj=out, mode="wb", mtime=0, compresslevel=6) as gz:
        gz.write(data)


def _frames_of_location(msg: pb.Profile, loc: pb.Location, funcs: dict[int, pb.Function], maps: dict[int, str]) -> list[str]:
    table = msg.string_table
    kernel = maps.get(loc.mapping_id) == KERNEL_MAPPING
    out = []
    for line in loc.line:  # innermost first
        fn = funcs.get(line.function_id)
        if fn is None:
            raise InputError(f"location {loc.id} names missing function {line.function_id}")
        if not (0 <= fn.name < len(table) and 0 <= fn.filename < len(table)):
            raise InputError(f"function {fn.id} names string {fn.name if not 0 <= fn.name < len(table) else fn.filename}, "
                             f"past the string table's {len(table)}")
        name, filename = table[fn.name], table[fn.filename]
        if kernel:
            name += KERNEL_SUFFIX
        elif filename and line.line > 0 and re.search(r"\.pyx?$", filename):
            name = f"{name} ({filename}:{line.line})"
        out.append(fold_safe(name))  # any program's names: no ; or newline in a frame
    if not out:
        mapping = maps.get(loc.mapping_id, "")
        out.append(f"[{mapping}]" if mapping else f"[unknown {loc.address:#x}]")
    return out


def read_pprof(stream: BinaryIO | bytes, *, source: str = "<input>", sample_type: str | None = None,
               strict: bool = False, stats: ReadStats | None = None) -> Profile:
    """A Profile from pprof bytes (gzipped or not).

    The weight is the ``samples`` value when the file has one (else the
    default sample type, else the first); ``sample_type`` picks another by name.
    A sample with a negative weight (a profile of differences: flamed's weigh
    0 or more) is malformed, as a folded line of a negative count is: skipped
    and counted in ``stats``, or an error with ``strict``.  A sample with more
    or fewer values than the file has sample types is corrupt data (an error).
    """
    st_ = stats if stats is not None else ReadStats()
    data = stream if isinstance(stream, bytes) else stream.read()
    if data[:2] == GZIP_MAGIC:
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as e:  # zlib.error: a corrupt deflate stream
            raise InputError(f"corrupt gzip data: {e}", source=source) from None
    from google.protobuf.message import DecodeError

    from flamed.outputs import profile_pb2 as pb

    msg = pb.Profile()
    try:
        msg.ParseFromString(data)
    except DecodeError as e:
        raise InputError(f"not a pprof profile: {e}", source=source) from None
    table: list[str] = list(msg.string_table)
    if table and table[0] != "":
        raise InputError("not a pprof profile: string_table[0] must be empty", source=source)

    def st(i: int) -> str:
        if not 0 <= i < len(table):
            raise InputError(f"string index {i} out of range", source=source)
        return table[i]

    types = [st(t.type) for t in msg.sample_type]
    index = 0
    if sample_type is not None:
        if sample_type not in types:
            raise InputError(f"no sample type {sample_type!r}; the file has {', '.join(types)}", source=source)
        index = types.index(sample_type)
    elif "samples" in types:
        index = types.index("samples")
    elif msg.default_sample_type and st(msg.default_sample_type) in types:
        index = types.index(st(msg.default_sample_type))

    funcs = {f.id: f for f in msg.function}
    maps = {m.id: st(m.filename) for m in msg.mapping}
    locs: dict[int, list[str]] = {}
    for loc in msg.location:
        try:
            locs[loc.id] = _frames_of_location(msg, loc, funcs, maps)
        except InputError as e:
            raise InputError(str(e), source=source) from None

    p = Profile()
    labels: dict[str, str] = {}
    rate: float | None = None
    for c in msg.comment:
        text = st(c)
        if text.startswith(_RATE_COMMENT):
            try:
                rate = float(text[len(_RATE_COMMENT):])
            except ValueError:
                pass
            continue
        k, sep, v = text.partition("=")
        if sep:
            labels[k] = v
    if rate is None and msg.period > 0 and msg.HasField("period_type") and st(msg.period_type.unit) == "nanoseconds":
        rate = 1e9 / msg.period
    time_div = 0
    if types and types[index] in TIME_KINDS and st(msg.sample_type[index].unit) == "nanoseconds":
        # Off-CPU or wall-clock nanoseconds (ours, OpenTelemetry's, Parca's): as the unit the labels
        # name, microseconds by default (flamed's folded unit for times).
        labels.setdefault("kind", types[index])
        if labels.get("unit") not in UNIT_NS:
            labels["unit"] = "microseconds"
        time_div = UNIT_NS[labels["unit"]]
    if types and types[index] not in ("samples", "cpu") and "unit" not in labels:
        labels["unit"] = types[index]
    p.labels = labels
    p.sample_rate = rate
    if msg.time_nanos:
        p.start_ns = msg.time_nanos
        p.end_ns = msg.time_nanos + msg.duration_nanos
    stacks = p.stacks
    for si, sample in enumerate(msg.sample):
        if len(sample.value) != len(types):
            raise InputError(f"sample {si} has {len(sample.value)} value(s) for {len(types)} sample type(s)",
                             source=source)
        w: Weight = sample.value[index]
        if w < 0:
            why = f"value {w} is negative (a profile of differences?): a weight is 0 or more"
            if strict:
                raise InputError(f"sample {si}: {why}", source=source)
            st_.skip_sample(source, f"sample {si}", why)
            continue
        st_.records += 1
        if w == 0:
            continue
        if time_div > 1:
            w = normalize_weight(w / time_div)
        frames: list[str] = []
        for lid in sample.location_id:
            lf = locs.get(lid)
            if lf is None:
                raise InputError(f"sample names missing location {lid}", source=source)
            frames.extend(lf)
        frames.reverse()
        key: Stack = tuple(frames) if frames else ("[no frames]",)
        stacks[key] = stacks.get(key, 0) + w
    return p


def top_functions(profile: Profile) -> dict[str, tuple[Weight, Weight]]:
    """Per pprof function name: (flat, cum) weight -- what ``pprof -top`` lists."""
    flat: dict[str, Weight] = {}
    cum: dict[str, Weight] = {}
    for stack, w in profile.stacks.items():
        names = [function_name(f) for f in stack]
        flat[names[-1]] = flat.get(names[-1], 0) + w
        for n in set(names):
            cum[n] = cum.get(n, 0) + w
    return {n: (flat.get(n, 0), cum[n]) for n in cum}


class PprofFormat(OutputFormat):
    name = "pprof"
    extensions = (".pb.gz", ".pprof", ".pb")
    description = "gzipped pprof profile.proto (go tool pprof, Grafana Pyroscope, ...)"

    def write(self, profile: Profile, out: BinaryIO, options: OutputOptions | None = None) -> None:
        write_pprof(profile, out)


def profile_bytes(profile: Profile) -> bytes:
    buf = io.BytesIO()
    write_pprof(profile, buf)
    return buf.getvalue()


