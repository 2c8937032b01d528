"""speedscope JSON (https://www.speedscope.app/file-format-schema.json).

* A Profile becomes ``sampled`` profiles: one per task when the root frames
  are ``comm-PID`` / ``comm-PID/TID`` (the root frame is kept, so the union
  of the profiles is the input), else one.  Weights are the Profile's
  (``unit: none`` for sample counts).
* A time-ordered sample stream becomes ``evented`` profiles, one per thread,
  named from the capture (``worker 0 (pid 11166, tid 11168)``), in nanoseconds since the first sample: speedscope's time-order view then
  shows when each function ran (see :mod:`flamed.outputs._timeline`).

Python frames ``func (file.py:N)`` are written as ``name``/``file``/``line``
so speedscope shows the source location; :func:`read_speedscope` puts them
back together, so ``read_speedscope(write(p))`` gives ``p``'s stacks.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from typing import Any, BinaryIO

from flamed import __version__
from flamed.errors import InputError
from flamed.folded import ReadStats
from flamed.model import (
    INT64_MAX,
    Profile,
    Sample,
    Stack,
    Weight,
    is_task,
    normalize_weight,
    parse_task_frame,
    fold_safe,
)
from flamed.outputs._timeline import group_by_thread, intervals, thread_names, typical_interval
from flamed.outputs.base import OutputFormat, OutputOptions
from flamed.progress import counted

SCHEMA = "https://www.speedscope.app/file-format-schema.json"
_PY = re.compile(r"^(?P<name>.*) \((?P<file>[^()]*\.pyx?):(?P<line>[1-9][0-9]{0,9})\)$", re.S)
_UNITS = ("none", "nanoseconds", "microseconds", "milliseconds", "seconds", "bytes")


class _Frames:
    def __init__(self) -> None:
        self.index: dict[str, int] = {}
        self.frames: list[dict[str, Any]] = []

    def get(self, frame: str) -> int:
        i = self.index.get(frame)
        if i is None:
            i = len(self.frames)
            self.index[frame] = i
            m = _PY.match(frame)
            if m is not None:
                self.frames.append({"name": m.group("name"), "file": m.group("file"), "line": int(m.group("line"))})
            else:
                self.frames.append({"name": frame})
        return i


def _task_name(root: str) -> str | None:
    return root if is_task(parse_task_frame(root)) else None


def _unit(profile: Profile) -> str:
    unit = profile.labels.get("unit", "samples")
    return unit if unit in _UNITS else "none"


def _dump(doc: dict[str, Any], out: BinaryIO) -> None:
    # ensure_ascii keeps invalid UTF-8 (lone surrogates) representable as \udcXX escapes.
    out.write(json.dumps(doc, ensure_ascii=True, separators=(",", ":"), allow_nan=False).encode("ascii"))
    out.write(b"\n")


def to_document(profile: Profile, name: str | None = None) -> dict[str, Any]:
    frames = _Frames()
    groups: dict[str, list[tuple[Stack, Weight]]] = {}
    items = profile.sorted_items()
    by_task = bool(items) and all(_task_name(s[0]) is not None for s, _ in items)
    for stack, w in items:
        if not w > 0:
            continue
        groups.setdefault(stack[0] if by_task else "", []).append((stack, w))
    title = name or profile.labels.get("comm") or "flamed"
    profiles = []
    for key in sorted(groups):
        rows = groups[key]
        total = normalize_weight(sum(w for _, w in rows))
        profiles.append(
            {
                "type": "sampled",
                "name": key or title,
                "unit": _unit(profile),
                "startValue": 0,
                "endValue": total,
                "samples": [[frames.get(f) for f in stack] for stack, _ in rows],
                "weights": [normalize_weight(w) for _, w in rows],
            }
        )
    if not profiles:
        # speedscope never finishes loading a file without profiles (its page
        # hangs); an empty profile shows as an empty graph.
        profiles.append({"type": "sampled", "name": title, "unit": _unit(profile), "startValue": 0, "endValue": 0,
                         "samples": [], "weights": []})
    return {
        "$schema": SCHEMA,
        "shared": {"frames": frames.frames},
        "profiles": profiles,
        "name": title,
        "activeProfileIndex": 0,
        "exporter": f"flamed {__version__}",
    }


def samples_document(samples: Iterable[Sample], *, name: str = "flamed", rate_hz: float | None = None) -> dict[str, Any]:
    frames = _Frames()
    groups = group_by_thread(samples)
    t0 = min((lst[0].time_ns for lst in groups.values() if lst), default=0)
    profiles = []
    names = thread_names(groups)
    for key, lst in counted(groups.items(), "timelines", len(groups), "threads"):
        interval = typical_interval(lst, rate_hz)
        events: list[tuple[int, int, int, int]] = []  # (at, order, kind 0=C 1=O, frame)
        # Opens and closes from the intervals; at equal times closes come first,
        # deeper frames close before their parents and open after them.
        for iv in intervals(lst, interval):
            if iv.end_ns <= iv.start_ns:
                continue  # two samples at one instant: nothing to draw
            fi = frames.get(iv.name)
            events.append((iv.start_ns - t0, 1, iv.depth, fi))
            events.append((iv.end_ns - t0, 0, -iv.depth, fi))
        events.sort(key=lambda e: (e[0], e[1], e[2]))
        label = names[key].label
        profiles.append(
            {
                "type": "evented",
                "name": label,
                "unit": "nanoseconds",
                "startValue": events[0][0] if events else 0,
                "endValue": events[-1][0] if events else 0,
                "events": [{"type": "O" if kind else "C", "frame": fi, "at": at} for at, kind, _, fi in events],
            }
        )
    if not profiles:  # as in to_document: never a file without profiles
        profiles.append({"type": "evented", "name": name, "unit": "nanoseconds", "startValue": 0, "endValue": 0, "events": []})
    return {
        "$schema": SCHEMA,
        "shared": {"frames": frames.frames},
        "profiles": profiles,
        "name": name,
        "activeProfileIndex": 0,
        "exporter": f"flamed {__version__}",
    }


def _frame_text(f: Any, source: str) -> str:
    if not isinstance(f, dict) or not isinstance(f.get("name"), str):
        raise InputError("speedscope frame without a name", source=source)
    name: str = f["name"]
    file, line = f.get("file"), f.get("line")
    if isinstance(file, str) and isinstance(line, int) and line > 0 and re.search(r"\.pyx?$", file):
        name = f"{name} ({file}:{line})"
    return fold_safe(name)  # any program's names: no ; or newline in a frame


def _bad_number(x: float, what: str) -> str | None:
    """Why ``x`` cannot be a sample's weight or an event's time, or ``None``."""
    if x != x or x in (math.inf, -math.inf):
        return f"{what} {x} is not a finite number"
    if x < 0 and what == "weight":
        return f"weight {x} is negative: a weight is 0 or more"
    if x > INT64_MAX:
        return f"{what} {x} is over the int64 maximum ({INT64_MAX})"
    return None


def read_speedscope(
    stream: BinaryIO | bytes, *, source: str = "<input>", strict: bool = False, stats: ReadStats | None = None
) -> Profile:
    """A Profile from a speedscope file: sampled weights, or evented durations.

    A sample whose weight is negative, NaN, infinite or past int64 (and an event
    whose time is not a finite number) is malformed, as a folded line with such a
    count is: skipped and counted in ``stats``, or an error with ``strict``.
    A weight of 0 is a sample of no weight: nothing to add, nothing wrong.
    """
    st = stats if stats is not None else ReadStats()

    def malformed(where: str, why: str) -> None:
        if strict:
            raise InputError(f"{where}: {why}", source=source)
        st.skip_sample(source, where, why)
    data = stream if isinstance(stream, bytes) else stream.read()
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:  # RecursionError: [[[[... nested too deep
        raise InputError(f"not JSON: {e}", source=source) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("profiles"), list):
        raise InputError("not a speedscope file (no 'profiles' list)", source=source)
    shared = doc.get("shared", {})
    raw_frames = shared.get("frames", []) if isinstance(shared, dict) else []
    if not isinstance(raw_frames, list):
        raise InputError("speedscope 'shared.frames' is not a list", source=source)
    names = [_frame_text(f, source) for f in raw_frames]
    p = Profile()
    units = set()

    def frame(i: Any) -> str:
        if not isinstance(i, int) or not 0 <= i < len(names):
            raise InputError(f"frame index {i!r} out of range", source=source)
        return names[i]

    for pi, prof in enumerate(doc["profiles"]):
        if not isinstance(prof, dict):
            raise InputError("speedscope profile is not an object", source=source)
        unit = prof.get("unit", "none")
        units.add(unit if isinstance(unit, str) else "none")
        kind = prof.get("type")
        if kind == "sampled":
            samples = prof.get("samples", [])
            if not isinstance(samples, list):
                raise InputError("sampled profile: 'samples' is not a list", source=source)
            weights = prof.get("weights") or [1] * len(samples)
            if not isinstance(weights, list) or len(samples) != len(weights):
                raise InputError("sampled profile: 'samples' and 'weights' differ in length", source=source)
            for si, (stack_ids, w) in enumerate(zip(samples, weights)):
                if not isinstance(stack_ids, list) or not isinstance(w, (int, float)) or isinstance(w, bool):
                    raise InputError("sampled profile: bad sample or weight", source=source)
                why = _bad_number(w, "weight")
                if why is not None:
                    malformed(f"profile {pi}, sample {si}", why)
                    continue
                st.records += 1
                if w > 0:
                    p.add(tuple(frame(i) for i in stack_ids), normalize_weight(w))
        elif kind == "evented":
            stack: list[str] = []
            last: float | None = None
            events = prof.get("events", [])
            if not isinstance(events, list):
                raise InputError("evented profile: 'events' is not a list", source=source)
            for ei, ev in enumerate(events):
                if not isinstance(ev, dict) or not isinstance(ev.get("at"), (int, float)) or isinstance(ev["at"], bool):
                    raise InputError("evented profile: bad event", source=source)
                at = ev["at"]
                why = _bad_number(at, "time")
                if why is not None:
                    # Its open or close still counts (the nesting stays right); the
                    # time around it, which cannot be measured, is left out.
                    malformed(f"profile {pi}, event {ei}", why)
                    last = None
                elif last is not None and at < last:
                    # Time went back: the span cannot be measured, and counting from
                    # here would count what lies between twice.  The event's open or
                    # close still counts; the clock stays where it was.
                    malformed(f"profile {pi}, event {ei}", f"time {at} is before the previous event's ({last})")
                else:
                    st.records += 1
                    if stack and last is not None and at > last:
                        p.add(tuple(stack), normalize_weight(at - last))
                    last = at
                name = frame(ev.get("frame"))
                if ev.get("type") == "O":
                    stack.append(name)
                elif ev.get("type") == "C":
                    if not stack or stack[-1] != name:
                        raise InputError(f"evented profile: close of {name!r} that is not open", source=source)
                    stack.pop()
                else:
                    raise InputError(f"evented profile: unknown event type {ev.get('type')!r}", source=source)
            if stack:
                # Frames never closed: their time after the last event is not in the file.
                malformed(f"profile {pi}", f"{len(stack)} frame(s) still open at the last event "
                          f"({stack[-1]!r} innermost): their time after it is not counted")
        else:
            raise InputError(f"unsupported speedscope profile type {kind!r}", source=source)
    units.discard("none")
    if len(units) == 1:
        p.labels["unit"] = units.pop()
    return p


class SpeedscopeFormat(OutputFormat):
    name = "speedscope"
    extensions = (".speedscope.json", ".speedscope")
    description = "speedscope JSON: sampled profiles per task, or evented per thread from a sample stream"
    wants_samples = True

    def write(self, profile: Profile, out: BinaryIO, options: OutputOptions | None = None) -> None:
        title = options.title if options is not None else None
        _dump(to_document(profile, title), out)

    def write_samples(self, samples: Iterable[Sample], out: BinaryIO, options: OutputOptions | None = None) -> None:
        title = (options.title if options is not None else None) or "flamed"
        rate = None
        if options is not None and options.extra.get("sample_rate"):
            rate = float(options.extra["sample_rate"])
        _dump(samples_document(samples, name=title, rate_hz=rate), out)
