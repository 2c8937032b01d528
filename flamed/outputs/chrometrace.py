"""Chrome trace event JSON (chrome://tracing, Perfetto UI, ui.perfetto.dev's JSON importer).

* From a time-ordered sample stream (:meth:`ChromeTraceFormat.write_samples`):
  one track per thread, a complete event (``"ph": "X"``) per frame interval
  (see :mod:`flamed.outputs._timeline`), timestamps in microseconds since the
  first sample, plus ``process_name``/``thread_name`` metadata from the
  capture: a process is named after its main thread's command, a thread
  ``comm (pid P, tid T)``; a capture without pids (perf script's default)
  shows each thread as its own process.
* From a Profile (no time): the flame graph laid out on a time axis -- each
  box an ``X`` event whose duration is its weight (one sample = the sampling
  interval, or 1 ms when the rate is unknown; an off-CPU or wall-clock
  profile's weights are times already, in its ``unit``) -- useful to look at
  an aggregate in the same tool.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, BinaryIO

from flamed.layout import flame_frames, table_from_profile
from flamed.model import Profile, Sample, frame_kind, time_unit_ns
from flamed.outputs._timeline import group_by_thread, intervals, thread_names, typical_interval
from flamed.outputs.base import OutputFormat, OutputOptions
from flamed.progress import counted


def _us(ns: float) -> float:
    # Microseconds with ns precision kept as decimals (the format's unit is us).
    return round(ns / 1000.0, 3)


def _dump(doc: dict[str, Any], out: BinaryIO) -> None:
    out.write(json.dumps(doc, ensure_ascii=True, separators=(",", ":"), allow_nan=False).encode("ascii"))
    out.write(b"\n")


def samples_trace(samples: Iterable[Sample], *, rate_hz: float | None = None) -> dict[str, Any]:
    groups = group_by_thread(samples)
    t0 = min((lst[0].time_ns for lst in groups.values() if lst), default=0)
    events: list[dict[str, Any]] = []
    named_pids: set[int] = set()
    names = thread_names(groups)
    # Ids for the lanes of a capture without any (each command its own): past every real one.
    spare = max((max(k[0], k[1]) for k in groups), default=0) + 1
    for key, lst in counted(groups.items(), "timelines", len(groups), "threads"):
        n = names[key]
        tid = key[1]
        if n.tid is None:
            tid, spare = spare, spare + 1
        # Without a pid in the capture each thread is shown as its own process
        # (under its tid) rather than all of them under one made-up process 0.
        pid = n.pid if n.pid is not None else tid
        if pid not in named_pids:
            named_pids.add(pid)
            if n.pid is not None:
                pname = f"{n.process} ({pid})"
            elif n.tid is not None:
                pname = f"{n.comm} (tid {tid}; no pid in the capture)"
            else:
                pname = f"{n.comm} (no ids in the capture)"
            events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": tid, "args": {"name": pname}})
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": n.label}})
        interval = typical_interval(lst, rate_hz)
        spans = sorted(
            (iv for iv in intervals(lst, interval) if iv.end_ns > iv.start_ns),
            key=lambda iv: (iv.start_ns, iv.depth),
        )
        for iv in spans:
            events.append(
                {
                    "ph": "X",
                    "name": iv.name,
                    "cat": frame_kind(iv.name),
                    "pid": pid,
                    "tid": tid,
                    "ts": _us(iv.start_ns - t0),
                    "dur": _us(iv.end_ns - iv.start_ns),
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"generator": "flamed", "t0_ns": t0}}


def profile_trace(profile: Profile) -> dict[str, Any]:
    # Weights that are times (off-CPU, wall-clock) are laid out as they are;
    # sample counts one sampling interval each.
    time_ns = time_unit_ns(profile)
    unit_ns = float(time_ns) if time_ns else 1e9 / profile.sample_rate if profile.sample_rate else 1e6
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": 1, "tid": 1, "args": {"name": "flamed profile (aggregate)"}}
    ]
    for b in flame_frames(table_from_profile(profile))[1:]:
        events.append(
            {
                "ph": "X",
                "name": b.name,
                "cat": frame_kind(b.name),
                "pid": 1,
                "tid": 1,
                "ts": _us(float(b.start) * unit_ns),
                "dur": _us(float(b.width) * unit_ns),
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"generator": "flamed", "aggregate": True}}


class ChromeTraceFormat(OutputFormat):
    name = "chrometrace"
    extensions = (".trace.json", ".chrometrace.json")
    description = "Chrome trace event JSON (Perfetto, chrome://tracing); per-thread timeline from a sample stream"
    wants_samples = True

    def write(self, profile: Profile, out: BinaryIO, options: OutputOptions | None = None) -> None:
        _dump(profile_trace(profile), out)

    def write_samples(self, samples: Iterable[Sample], out: BinaryIO, options: OutputOptions | None = None) -> None:
        rate = None
        if options is not None and options.extra.get("sample_rate"):
            rate = float(options.extra["sample_rate"])
        _dump(samples_trace(samples, rate_hz=rate), out)
