"""Timestamped trace: ``TIMESTAMP STACK COUNT`` per sample, in time order.

The reader is :mod:`flamed.collapse.trace`.  The first line is
``# flamed trace ...`` so the format is recognised even without samples.
Timestamps are integer nanoseconds, or seconds with 9 decimals when
``OutputOptions.extra["time_format"] == "seconds"``.  A profile without
sample times cannot be written as a trace.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import BinaryIO

from flamed.collapse.trace import TRACE_MAGIC, format_timestamp
from flamed.errors import UsageError
from flamed.model import Profile, Sample, encode_frame, format_weight, task_root
from flamed.outputs.base import OutputFormat, OutputOptions


def with_task_roots(samples: Iterable[Sample]) -> Iterator[Sample]:
    """``samples`` with each one's task in its root frame (``comm-PID/TID``, as
    ``flamed merge`` writes it) where the root is its bare command (perf
    script's): a trace keeps a task nowhere else, and a timeline drawn from a
    trace without it shows every thread of a command as one."""
    roots: dict[tuple[str, int | None, int | None], str] = {}
    for s in samples:
        stack = s.stack
        if (s.pid is not None or s.tid is not None) and stack:
            key = (stack[0], s.pid, s.tid)
            root = roots.get(key)
            if root is None:
                root = task_root(stack[0], s.pid, s.tid, s.pid, s.tid)
                if len(roots) < 100_000:
                    roots[key] = root
            if root != stack[0]:
                s = dataclasses.replace(s, stack=(root, *stack[1:]))
        yield s


def write_trace(samples: Iterable[Sample], out: BinaryIO, *, time_format: str = "ns") -> int:
    unit = "seconds" if time_format == "seconds" else "ns"
    out.write(TRACE_MAGIC + f": TIMESTAMP({unit}) STACK COUNT\n".encode())
    n = 0
    buf: list[bytes] = []
    seconds = time_format == "seconds"
    for s in samples:
        t = format_timestamp(s.time_ns, "seconds") if seconds else str(s.time_ns)
        w = s.weight
        ws = str(w) if type(w) is int else format_weight(w)
        buf.append(encode_frame(f"{t} {';'.join(s.stack)} {ws}\n"))
        n += 1
        if len(buf) >= 8192:
            out.write(b"".join(buf))
            buf.clear()
    out.write(b"".join(buf))
    return n


class TraceFormat(OutputFormat):
    name = "trace"
    extensions = (".trace",)
    description = "timestamped trace 'TIMESTAMP STACK COUNT' per sample (flamed merge)"
    wants_samples = True
    writes_profiles = False

    def write(self, profile: Profile, out: BinaryIO, options: OutputOptions | None = None) -> None:
        raise UsageError("a trace needs timestamped samples; this input was aggregated (write folded instead)")

    def write_samples(self, samples: Iterable[Sample], out: BinaryIO, options: OutputOptions | None = None) -> None:
        fmt = (options.extra.get("time_format", "ns") if options is not None else "ns")
        write_trace(samples, out, time_format=fmt)
