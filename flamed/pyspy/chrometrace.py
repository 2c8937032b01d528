"""Reading py-spy's chrometrace: the Python stacks of each OS thread, by time.

Chrometrace only has an event when a thread's stack *changes*, stamped in
microseconds since py-spy created its recorder (``-t`` adds a
``thread (OS_TID): name`` root frame, which is how a pthread id becomes the
OS tid BPF reports).  :mod:`flamed.pyspy.clockfit` puts those microseconds
on CLOCK_MONOTONIC, :mod:`flamed.pyspy.align` places and joins the changes.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from flamed.errors import InputError
from flamed.model import Stack, sanitize_frame
from flamed.sampling.pystack import short_filename

_THREAD_FRAME = re.compile(r"^thread \((?P<id>\d+|0x[0-9a-fA-F]+)\)(?:: (?P<name>.*))?$")
_PROCESS_FRAME = re.compile(r"^process \d+:")


@dataclass
class PyTrace:
    """One py-spy chrometrace, per OS thread.

    ``threads[tid]``: ``[(ts_us, python_stack)]`` in time order, one entry per
    sample at which the thread's Python stack changed (root first, without the
    thread frame).  ``first_ts_us``/``last_ts_us``: first event and the final
    write (after the last sample).  ``unmapped``: threads whose root frame had
    no id (py-spy without ``-t``).  ``pthread_ids``: keys of ``threads`` that
    are pthread ids, not OS tids: before CPython 3.11 the interpreter keeps no
    native id, and py-spy's ``thread (0x...)`` frame names ``pthread_self()``;
    :mod:`flamed.pyspy.threadids` maps them to OS tids.
    """

    threads: dict[int, list[tuple[int, Stack]]] = field(default_factory=dict)
    thread_names: dict[int, str] = field(default_factory=dict)
    change_ts_us: list[int] = field(default_factory=list)
    first_ts_us: int | None = None
    last_ts_us: int | None = None
    unmapped: int = 0
    pthread_ids: set[int] = field(default_factory=set)


def python_frame(name: str, filename: str, line: int | None) -> str:
    """A Python frame in py-spy's folded convention: ``func (file.py:line)``."""
    fn = short_filename(filename)
    where = f"{fn}:{line}" if line else fn
    return sanitize_frame(f"{name} ({where})")


def parse_chrometrace(data: bytes | str | BinaryIO, *, source: str = "<chrometrace>") -> PyTrace:
    """Read py-spy's ``--format chrometrace`` output (a JSON list of B/E events)."""
    if not isinstance(data, (bytes, str)):
        data = data.read()
    try:
        events = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:  # RecursionError: nested too deep
        raise InputError(f"not a py-spy chrometrace: {e}", source=source) from None
    if not isinstance(events, list):
        raise InputError("not a py-spy chrometrace: expected a JSON list of events", source=source)
    return _build_trace(events, source)


def _build_trace(events: list[Any], source: str) -> PyTrace:
    trace = PyTrace()
    # The frames open per py-spy thread id (pthread id), root first.
    open_frames: dict[int, list[tuple[str, str, int | None]]] = defaultdict(list)
    os_tid: dict[int, int | None] = {}
    last_stack: dict[int, Stack] = {}
    changes: set[int] = set()

    def flush(ts: int, touched: Iterable[int]) -> None:
        for ptid in touched:
            frames = open_frames[ptid]
            tid = os_tid.get(ptid)
            if tid is None:
                continue
            if not frames:
                # Every frame closed: py-spy wrote its file (end of recording).
                continue
            stack = tuple(python_frame(n, f, ln) for n, f, ln in frames if not _is_meta_frame(n, f))
            if last_stack.get(tid) == stack:
                continue  # only the thread frame changed (its name appeared)
            last_stack[tid] = stack
            trace.threads.setdefault(tid, []).append((ts, stack))
            changes.add(ts)

    cur_ts: int | None = None
    touched: set[int] = set()
    for i, ev in enumerate(events):
        try:
            ph = ev["ph"]
            ts = int(ev["ts"])
            ptid = int(ev["tid"])
            name = str(ev["name"])
            args = ev.get("args") or {}
            filename = str(args.get("filename") or "")
            line_raw = args.get("line")
            line = int(line_raw) if line_raw is not None else None
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError):  # Overflow: "ts": 1e999
            raise InputError(f"event {i} is not a py-spy trace event", source=source) from None
        if cur_ts is not None and ts != cur_ts:
            flush(cur_ts, touched)
            touched = set()
        cur_ts = ts
        if trace.first_ts_us is None:
            trace.first_ts_us = ts
        trace.last_ts_us = ts if trace.last_ts_us is None else max(trace.last_ts_us, ts)
        touched.add(ptid)
        frames = open_frames[ptid]
        if ph == "B":
            if not frames:
                # The root frame of a thread names it (``-t``); its name may
                # appear only in a later sample, under the same OS tid.
                m = _THREAD_FRAME.match(name) if not filename else None
                if m is not None:
                    ident = m.group("id")
                    tid = int(ident, 16) if ident.startswith("0x") else int(ident)
                    if ident.startswith("0x"):
                        trace.pthread_ids.add(tid)
                    os_tid[ptid] = tid
                    if m.group("name"):
                        trace.thread_names[tid] = m.group("name")
                elif ptid not in os_tid:
                    os_tid[ptid] = None
                    trace.unmapped += 1
            frames.append((name, filename, line))
        elif ph == "E":
            if frames:
                frames.pop()
        else:
            continue
    if cur_ts is not None:
        flush(cur_ts, touched)
    trace.change_ts_us = sorted(changes)
    return trace


def _is_meta_frame(name: str, filename: str) -> bool:
    return not filename and (_THREAD_FRAME.match(name) is not None or _PROCESS_FRAME.match(name) is not None)
