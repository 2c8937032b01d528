"""What the daemon hands to fleet backends: windows as pprof (with labels) or folded bytes.

Both the pull endpoint (``/debug/pprof/profile``) and the Pyroscope push
encode windows of the ring here.  In pprof every sample carries string labels
``pid``, ``thread``, ``comm`` and ``host``, so a backend can filter by task and
machine; the stacks keep the configured root frame, as the files do.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

from flamed.daemon.ring import RingWindow
from flamed.folded import write_folded
from flamed.model import Profile, task_frame
from flamed.outputs.pprof import LabelledSample, write_pprof
from flamed.sampling.contract import CountKey, counts_to_profile


def _merged(windows: Sequence[RingWindow]) -> tuple[dict[CountKey, int], int | None, int | None, float | None]:
    counts: dict[CountKey, int] = {}
    for w in windows:
        for k, n in w.counts.items():
            counts[k] = counts.get(k, 0) + n
    rates = {w.sample_rate for w in windows}
    rate = rates.pop() if len(rates) == 1 else None
    start = windows[0].start_ns if windows else None
    end = windows[-1].end_ns if windows else None
    return counts, start, end, rate


def _rooted(root: str, tgid: int, tid: int, comm: str) -> tuple[str, ...]:
    if root == "none":
        return ()
    if root == "pid":
        return (task_frame(comm, tgid),)
    if root == "tid":
        return (task_frame(comm, tgid, tid),)
    return (task_frame(comm),)


def windows_pprof(windows: Sequence[RingWindow], *, root: str, host: str,
                  start_ns: int | None = None, end_ns: int | None = None) -> bytes:
    """Gzipped pprof of ``windows``: one sample per (task, stack), labelled.

    ``start_ns``/``end_ns`` override the windows' own range (a pull request
    states the span it asked for; its windows may begin a little earlier).
    """
    counts, start, end, rate = _merged(windows)
    profile = Profile(start_ns=start_ns if start_ns is not None else start,
                      end_ns=end_ns if end_ns is not None else end,
                      sample_rate=rate, labels={"host": host, "unit": "samples"})
    samples: list[LabelledSample] = []
    for (tgid, tid, comm, stack), n in counts.items():
        labels = {"pid": str(tgid), "thread": str(tid), "comm": comm or "[unknown]", "host": host}
        samples.append((_rooted(root, tgid, tid, comm) + stack, n, labels))
    # Deterministic: the same windows give the same bytes.
    samples.sort(key=lambda e: (e[0], sorted(e[2].items())))
    buf = io.BytesIO()
    write_pprof(profile, buf, samples)
    return buf.getvalue()


def windows_folded(windows: Sequence[RingWindow], *, root: str) -> bytes:
    counts, _, _, _ = _merged(windows)
    buf = io.BytesIO()
    write_folded(counts_to_profile(counts, root), buf)
    return buf.getvalue()
