"""What the daemon hands to fleet backends: windows as pprof (with labels) or folded bytes.

Both the pull endpoint (``/debug/pprof/profile``) and the Pyroscope push
encode windows of the ring here.  In pprof every sample carries string labels
``pid``, ``thread``, ``comm`` and ``host``, and, when its task's cgroup is
known, ``cgroup``, ``service_name`` (systemd unit without its suffix, or the
container's name or short id), ``container_id`` and ``pod`` (the pod UID), so
a backend can filter by task, service, container and machine; the stacks keep
the configured root frames, as the files do.

Off-CPU windows (``kind == "offcpu"``, weights in nanoseconds) are encoded
with one sample type of time: ``off_cpu``/``nanoseconds`` as ``flamed record
--mode offcpu`` writes it, or another name given (the push names it as
Pyroscope's eBPF collector does, see docs/fleet.md); in folded text their
weights are microseconds, as in the files.
"""

from __future__ import annotations

import gzip
import io
from collections.abc import Mapping, Sequence

from flamed.daemon.ring import DecodeCache, RingWindow, window_items
from flamed.daemon.store import ns_to_us
from flamed.folded import write_folded
from flamed.model import Profile
from flamed.outputs.pprof import LabelledSample, to_proto, write_pprof
from flamed.sampling.cgroups import CgroupIdentity
from flamed.sampling.contract import CountKey, counts_to_profile, parse_root, root_frames


def merged_identities(windows: Sequence[RingWindow]) -> dict[int, CgroupIdentity]:
    """tgid -> identity over ``windows``, the newest window's where they differ."""
    out: dict[int, CgroupIdentity] = {}
    for w in windows:
        out.update(w.identities)
    return out


def _merged(windows: Sequence[RingWindow]) -> tuple[dict[CountKey, int], int | None, int | None, float | None]:
    counts: dict[CountKey, int] = {}
    cache: DecodeCache = {}
    for w in windows:
        for k, n in window_items(w.counts, cache):
            counts[k] = counts.get(k, 0) + n
    rates = {w.sample_rate for w in windows}
    rate = rates.pop() if len(rates) == 1 else None
    start = windows[0].start_ns if windows else None
    end = windows[-1].end_ns if windows else None
    return counts, start, end, rate


#: The labels of a profile of off-CPU nanoseconds (pprof sample type off_cpu/nanoseconds).
OFFCPU_LABELS = {"unit": "nanoseconds", "kind": "off_cpu"}


def labelled_pprof(profile: Profile, counts: Mapping[CountKey, int], identities: Mapping[int, CgroupIdentity],
                   *, root: str, host: str, sample_type: str | None = None) -> bytes:
    """Gzipped pprof of task-keyed ``counts``: one sample per (task, stack),
    labelled with its task, host and cgroup identity (see the module's doc)."""
    kinds = parse_root(root)
    samples: list[LabelledSample] = []
    for (tgid, tid, comm, stack), n in counts.items():
        ident = identities.get(tgid)
        labels = {"pid": str(tgid), "thread": str(tid), "comm": comm or "[unknown]", "host": host}
        if ident is not None:
            labels.update(ident.labels())
        samples.append((root_frames(kinds, tgid, tid, comm, ident) + stack, n, labels))
    # Deterministic: the same windows give the same bytes.
    samples.sort(key=lambda e: (e[0], sorted(e[2].items())))
    if sample_type is not None:
        # The one sample type renamed (off_cpu -> offcpu for Pyroscope), the rest as write_pprof makes it.
        msg = to_proto(profile, samples)
        table = msg.string_table
        for vt in msg.sample_type:
            table[vt.type] = sample_type
        return gzip.compress(msg.SerializeToString(deterministic=True), compresslevel=6, mtime=0)
    buf = io.BytesIO()
    write_pprof(profile, buf, samples)
    return buf.getvalue()


def windows_pprof(windows: Sequence[RingWindow], *, root: str, host: str,
                  start_ns: int | None = None, end_ns: int | None = None, sample_type: str | None = None,
                  kind: str | None = None) -> bytes:
    """Gzipped pprof of ``windows``: one sample per (task, stack), labelled.

    ``start_ns``/``end_ns`` override the windows' own range (a pull request
    states the span it asked for; its windows may begin a little earlier).
    """
    counts, start, end, rate = _merged(windows)
    offcpu = (kind or (windows[0].kind if windows else "cpu")) == "offcpu"
    profile = Profile(start_ns=start_ns if start_ns is not None else start,
                      end_ns=end_ns if end_ns is not None else end,
                      sample_rate=None if offcpu else rate,
                      labels={"host": host, **(OFFCPU_LABELS if offcpu else {"unit": "samples"})})
    return labelled_pprof(profile, counts, merged_identities(windows), root=root, host=host,
                          sample_type=sample_type if offcpu else None)


def windows_folded(windows: Sequence[RingWindow], *, root: str) -> bytes:
    counts, _, _, _ = _merged(windows)
    profile = counts_to_profile(counts, root, identities=merged_identities(windows))
    if windows and windows[0].kind == "offcpu":
        profile.stacks = ns_to_us(profile.stacks)
    buf = io.BytesIO()
    write_folded(profile, buf)
    return buf.getvalue()
