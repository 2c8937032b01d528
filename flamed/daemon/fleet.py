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
from collections.abc import Callable, Mapping, Sequence
from typing import Any

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


#: Counts of tasks and the identities that name them (tgid -> identity).
Part = tuple[dict[CountKey, int], Mapping[int, CgroupIdentity]]


def _add_all(w: RingWindow, into: dict[CountKey, int], cache: DecodeCache) -> None:
    for k, n in window_items(w.counts, cache):
        into[k] = into.get(k, 0) + n


def identity_parts(windows: Sequence[RingWindow],
                   add: Callable[[RingWindow, dict[CountKey, int], DecodeCache], None] = _add_all) -> list[Part]:
    """The counts of ``windows`` (each added to a part by ``add``), merged so
    that each sample keeps the identity of the window it was counted in.

    Most processes have one identity over the windows: their counts go in the
    first part, named by :func:`merged_identities`.  A process that moved to
    another cgroup meanwhile (a restarted unit keeping its pid, a process put
    into a container's cgroup) has its counts of the windows that named it
    otherwise in one more part per other identity, so that a snapshot's root
    frames and labels say where each sample was taken, as its filters do; a
    window that did not resolve the process's cgroup leaves its counts to the
    newest identity."""
    newest = merged_identities(windows)
    moved = {t for w in windows for t, ident in w.identities.items() if ident != newest[t]}
    main: dict[CountKey, int] = {}
    others: dict[CgroupIdentity, dict[CountKey, int]] = {}
    cache: DecodeCache = {}
    for w in windows:
        olds = {t: ident for t, ident in w.identities.items() if t in moved and ident != newest[t]} if moved else {}
        if not olds:
            add(w, main, cache)
            continue
        part: dict[CountKey, int] = {}
        add(w, part, cache)
        for k, n in part.items():
            ident = olds.get(k[0])
            into = main if ident is None else others.setdefault(ident, {})
            into[k] = into.get(k, 0) + n
    parts: list[Part] = [(main, newest)]
    for ident, counts in others.items():
        parts.append((counts, dict.fromkeys({k[0] for k in counts}, ident)))
    return parts


def parts_profile(parts: Sequence[Part], root: str, **profile: Any) -> Profile:
    """:func:`counts_to_profile` of each part, summed into one profile."""
    counts, idents = parts[0] if parts else ({}, {})
    out = counts_to_profile(counts, root, identities=idents, **profile)
    stacks = out.stacks
    for counts, idents in parts[1:]:
        for stack, n in counts_to_profile(counts, root, identities=idents).stacks.items():
            stacks[stack] = stacks.get(stack, 0) + n
    return out


def _merged(windows: Sequence[RingWindow]) -> tuple[list[Part], int | None, int | None, float | None]:
    parts = identity_parts(windows)
    rates = {w.sample_rate for w in windows}
    rate = rates.pop() if len(rates) == 1 else None
    start = windows[0].start_ns if windows else None
    end = windows[-1].end_ns if windows else None
    return parts, start, end, rate


#: The labels of a profile of off-CPU nanoseconds (pprof sample type off_cpu/nanoseconds).
OFFCPU_LABELS = {"unit": "nanoseconds", "kind": "off_cpu"}


def labelled_pprof(profile: Profile, parts: Sequence[Part], *, root: str, host: str,
                   sample_type: str | None = None) -> bytes:
    """Gzipped pprof of task-keyed counts (:func:`identity_parts`): one sample
    per (task, identity, stack), labelled with its task, host and cgroup
    identity (see the module's doc)."""
    kinds = parse_root(root)
    samples: list[LabelledSample] = []
    for counts, identities in parts:
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
    parts, start, end, rate = _merged(windows)
    offcpu = (kind or (windows[0].kind if windows else "cpu")) == "offcpu"
    profile = Profile(start_ns=start_ns if start_ns is not None else start,
                      end_ns=end_ns if end_ns is not None else end,
                      sample_rate=None if offcpu else rate,
                      labels={"host": host, **(OFFCPU_LABELS if offcpu else {"unit": "samples"})})
    return labelled_pprof(profile, parts, root=root, host=host, sample_type=sample_type if offcpu else None)


def windows_folded(windows: Sequence[RingWindow], *, root: str) -> bytes:
    parts, _, _, _ = _merged(windows)
    profile = parts_profile(parts, root)
    if windows and windows[0].kind == "offcpu":
        profile.stacks = ns_to_us(profile.stacks)
    buf = io.BytesIO()
    write_folded(profile, buf)
    return buf.getvalue()
