"""The index behind ``flamed serve``: which file covers which time, and queries over it.

Daemon state directories are indexed from their sidecars only (time range,
weight, per-window sample counts, the cgroup identities of the processes), so opening days of files reads a few KB
per file; stacks are read when a range is asked for, a file at a time, with
a cache of parsed files bounded in bytes: each kept in a compact form (its
stacks as packed ids into one shared table of frame names), several times
smaller than the parsed profile.  Any other input the toolkit reads is an
entry too; inputs that keep time per sample (perf script, timestamped traces)
keep their samples in memory, which is what gives the subsecond heatmap.
"""

from __future__ import annotations

import bisect
import json
import sys
import os
import re
import stat
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from flamed.daemon.protocol import IdentityQuery
from flamed.daemon.fleet import OFFCPU_LABELS as _OFFCPU_NS
from flamed.daemon.store import FILE_RE, KIND_UNIT, SIDECAR_RE, file_kind
from flamed.errors import InputError, UsageError
from flamed.model import Profile, Stack, Weight, frame_kind, normalize_weight, parse_task_frame
from flamed.sampling.cgroups import CgroupError, CgroupIdentity, identity_from_path, parse_cgroup_spec
from flamed.sampling.contract import CGROUP_ROOTS, parse_root, root_frames

NS = 1_000_000_000
KINDS = ("kernel", "native", "python")
#: Kinds of daemon files: CPU samples, off-CPU time (see flamed.daemon.store).
PROFILE_KINDS = ("cpu", "offcpu")
#: The labels of an off-CPU profile read from the files (microseconds).
OFFCPU_LABELS = {**_OFFCPU_NS, "unit": KIND_UNIT["offcpu"]}
#: Bytes of parsed files kept in memory (compact forms and their frame table), by default.
CACHE_BYTES = 64 * 1024 * 1024
#: A state directory is looked at again at most this often (seconds), on a request.
REFRESH_S = 1.0
#: Nice histogram bucket widths, seconds.
_BUCKETS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400)


@dataclass(frozen=True)
class Filters:
    """What the timeline and graphs keep. Empty strings: no condition.

    pid: comma-separated pids of the root frame's task.
    tid: comma-separated thread ids of the root frame's task (``comm-PID/TID``).
    comm: regex searched in the task's comm.
    include/exclude: regex that some / no frame of the stack matches.
    kinds: frame kinds drawn (the root frame, which names the task, is always kept).
    unit/container/pod/cgroup: comma-separated names of the task's systemd
    unit, container, pod or cgroup (as ``flamed snapshot --unit`` ... takes
    them), read from the sidecars' identities: daemon files whose root
    frames name the pid only.
    group: ``unit``, ``container`` or ``cgroup``: a frame of that name above
    each task (``[unknown cgroup]`` where the sidecar does not say).
    profile: which daemon files: ``cpu`` (samples) or ``offcpu`` (microseconds
    off the CPU, ``[sampling] off_cpu``); the two are never mixed.
    """

    pid: str = ""
    tid: str = ""
    comm: str = ""
    include: str = ""
    exclude: str = ""
    kinds: frozenset[str] = frozenset(KINDS)
    unit: str = ""
    container: str = ""
    pod: str = ""
    cgroup: str = ""
    group: str = ""
    profile: str = "cpu"

    @classmethod
    def parse(cls, q: dict[str, str]) -> Filters:
        kinds = frozenset(k for k in q.get("kinds", ",".join(KINDS)).split(",") if k)
        bad = kinds - set(KINDS)
        if bad:
            raise UsageError(f"unknown frame kind(s) {', '.join(sorted(bad))}; use {', '.join(KINDS)}")
        group = q.get("group", "").strip()
        if group and group not in CGROUP_ROOTS:
            raise UsageError(f"group {group!r}: use {', '.join(CGROUP_ROOTS)}")
        profile = q.get("profile", "cpu") or "cpu"
        if profile not in PROFILE_KINDS:
            raise UsageError(f"profile {profile!r}: use {', '.join(PROFILE_KINDS)}")
        f = cls(q.get("pid", "").strip(), q.get("tid", "").strip(), q.get("comm", ""), q.get("include", ""),
                q.get("exclude", ""), kinds, unit=q.get("unit", "").strip(), container=q.get("container", "").strip(),
                pod=q.get("pod", "").strip(), cgroup=q.get("cgroup", "").strip(), group=group, profile=profile)
        f.compiled()  # say now when a regex or pid is invalid
        f.identity()
        return f

    def active(self) -> bool:
        return bool(self.pid or self.tid or self.comm or self.include or self.exclude or self.kinds != frozenset(KINDS)
                    or self.by_cgroup())

    def by_cgroup(self) -> bool:
        """Do these filters need the sidecars' identities (an identity filter, or a group)?"""
        return bool(self.unit or self.container or self.pod or self.cgroup or self.group)

    def identity(self) -> IdentityQuery:
        def names(text: str) -> tuple[str, ...] | None:
            return tuple(n.strip() for n in text.split(",") if n.strip()) or None

        cgroups = names(self.cgroup)
        try:
            specs = None if cgroups is None else tuple(parse_cgroup_spec(c, key="cgroup") for c in cgroups)
        except CgroupError as e:
            raise UsageError(str(e)) from None
        return IdentityQuery(names(self.unit), names(self.container), names(self.pod), specs)

    def apply_identities(self, profile: Profile, identities: dict[int, CgroupIdentity], task_at: int | None
                         ) -> Profile:
        """One daemon file's stacks, kept by its processes' identities and grouped (see the class)."""
        query = self.identity()
        if not query.active() and not self.group:
            return profile
        if query.active() and task_at is None:
            return Profile()  # no pid in the root frames: nothing can be told apart

        def ident_of(stack: Stack) -> CgroupIdentity | None:
            pid = parse_task_frame(stack[task_at]).pid if task_at is not None and len(stack) > task_at else None
            return identities.get(pid) if pid is not None else None

        out = Profile(start_ns=profile.start_ns, end_ns=profile.end_ns)
        for stack, w in profile.stacks.items():
            ident = ident_of(stack)
            if query.active() and (ident is None or not query.matches(ident)):
                continue
            if self.group:
                stack = root_frames((self.group,), 0, 0, "", ident) + stack
            out.stacks[stack] = out.stacks.get(stack, 0) + w
        return out

    def compiled(self) -> tuple[set[int] | None, set[int] | None, re.Pattern[str] | None, re.Pattern[str] | None,
                                re.Pattern[str] | None]:
        ids: list[set[int] | None] = []
        for what, text in (("pid", self.pid), ("tid", self.tid)):
            try:
                ids.append({int(p) for p in text.split(",") if p.strip()} or None)
            except ValueError:
                raise UsageError(f"{what} filter {text!r}: expected comma-separated numbers") from None
        out: list[re.Pattern[str] | None] = []
        for what, rx in (("comm", self.comm), ("include", self.include), ("exclude", self.exclude)):
            try:
                out.append(re.compile(rx) if rx else None)
            except re.error as e:
                raise UsageError(f"{what} filter {rx!r} is not a valid regex: {e}") from None
        return ids[0], ids[1], out[0], out[1], out[2]

    def apply(self, profile: Profile) -> Profile:
        if not self.active():
            return profile
        pids, tids, cre, ire, xre = self.compiled()
        some = pids is not None or tids is not None or cre or ire or xre
        p = profile.filtered(pid=pids, tid=tids, comm=cre, frame=ire, exclude_frame=xre) if some else profile
        if self.kinds == frozenset(KINDS):
            return p
        kinds = self.kinds

        def strip(stack: Stack) -> Stack:
            return stack[:1] + tuple(f for f in stack[1:] if frame_kind(f) in kinds)

        return p.map_stacks(strip)


@dataclass
class Entry:
    """One input file (or one timestamped input) and the time it covers."""

    name: str
    path: str
    start_ns: int
    end_ns: int
    weight: Weight
    #: (start_ns, end_ns, samples) per daemon window; [] when unknown.
    windows: list[tuple[int, int, int]] = field(default_factory=list)
    timed: bool = True
    #: Placed from its sidecar (False: from its name, to be read again once the sidecar is there).
    sidecar: bool = False
    #: pid -> who owned its cgroup, from the sidecar's ``identities``.
    identities: dict[int, CgroupIdentity] = field(default_factory=dict)
    #: Which root frame names the task with its pid (from the sidecar's root_frame); None: none does.
    task_at: int | None = 0
    #: ``cpu`` (samples) or ``offcpu`` (a daemon's off-CPU file: microseconds).
    kind: str = "cpu"


@dataclass
class Trace:
    """Samples of timestamped inputs, time-ordered, stacks interned."""

    times: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    weights: list[Weight] = field(default_factory=list)
    stacks: list[Stack] = field(default_factory=list)


class FrameTable:
    """Frame names of parsed files, each stored once; compact stacks are ids into it."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.ids: dict[str, int] = {}
        self.nbytes = 0

    def pack(self, stack: Stack) -> bytes:
        ids = self.ids
        out = array("I")
        for name in stack:
            i = ids.get(name)
            if i is None:
                i = ids[name] = len(self.names)
                self.names.append(name)
                # the string, its list slot and its dict entry (amortised)
                self.nbytes += sys.getsizeof(name) + 8 + 48
            out.append(i)
        return out.tobytes()

    def unpack(self, key: bytes) -> Stack:
        return tuple(map(self.names.__getitem__, memoryview(key).cast("I")))


@dataclass
class Compact:
    """One parsed file: its stacks packed (4 bytes a frame) with their weights."""

    table: FrameTable
    keys: list[bytes]
    weights: list[Weight]
    start_ns: int | None
    end_ns: int | None
    nbytes: int
    sample_rate: float | None = None
    labels: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, p: Profile, table: FrameTable) -> Compact:
        keys = [table.pack(st) for st in p.stacks]
        weights = list(p.stacks.values())
        # bytes objects, two list slots per stack, weights that are not small cached ints
        size = 200 + sum(sys.getsizeof(k) + 16 for k in keys) + 32 * sum(
            1 for w in weights if not (isinstance(w, int) and -5 <= w <= 256))
        return cls(table, keys, weights, p.start_ns, p.end_ns, size, p.sample_rate, p.labels)

    def profile(self) -> Profile:
        unpack = self.table.unpack
        return Profile({unpack(k): w for k, w in zip(self.keys, self.weights)}, start_ns=self.start_ns,
                       end_ns=self.end_ns, sample_rate=self.sample_rate, labels=dict(self.labels))


class Index:
    def __init__(self, entries: list[Entry], trace: Trace, *, kind: str, source: str,
                 state_dir: str | None = None, cache_bytes: int = CACHE_BYTES) -> None:
        self.entries = sorted(entries, key=lambda e: (e.start_ns, e.name))
        self.trace = trace
        self.kind = kind
        self.source = source
        self.state_dir = state_dir
        self._cache: OrderedDict[str, Compact] = OrderedDict()
        self.cache_limit = cache_bytes
        self._cache_bytes = 0
        self._table = FrameTable()
        self._lock = threading.Lock()
        self._parsing: dict[str, threading.Lock] = {}  # path -> held while one request parses it
        self._refresh_lock = threading.Lock()
        self._filtered_weight: OrderedDict[tuple[str, Filters], Weight] = OrderedDict()
        self._next_check = time.monotonic() + REFRESH_S
        self._dir_mtime = _mtime_ns(state_dir) if state_dir else None
        #: Directory listings read since start (the refresh's cost, for tests and the bench).
        self.rescans = 0
        #: Files parsed since start: a range asked for again within the cache costs none.
        self.parses = 0
        #: Inputs given but not indexed: those without time among inputs with time (from_files).
        self.left_out: list[str] = []
        #: Files of the state directory not indexed, and why (not a regular file, no time).
        self.skipped: dict[str, str] = {}

    # -- building ----------------------------------------------------------
    @classmethod
    def from_state_dir(cls, state_dir: str, cache_bytes: int = CACHE_BYTES) -> Index:
        # The directory's time before its listing: a file written during the scan changes it again.
        mtime = _mtime_ns(state_dir)
        try:
            names = os.listdir(state_dir)
        except OSError as e:
            raise UsageError(f"cannot read the state directory {state_dir}: {e.strerror or e}; "
                             "give the daemon's output.state_dir") from None
        skipped: dict[str, str] = {}
        index = cls(_scan(state_dir, names, {}, skipped), Trace(), kind="store", source=os.path.abspath(state_dir),
                    state_dir=state_dir, cache_bytes=cache_bytes)
        index.skipped = skipped
        index._dir_mtime = mtime
        return index

    def refresh(self) -> bool:
        """Take in the files the daemon wrote (or retention removed) since the last look.

        At most once per REFRESH_S, and only when the directory's mtime moved
        (or is recent enough that a change in the same clock tick could hide):
        one stat per request at most, one listing per change, and only the
        sidecars of new files are read. True when the entries changed.
        """
        if self.state_dir is None:
            return False
        now = time.monotonic()
        with self._lock:
            if now < self._next_check:
                return False
            self._next_check = now + REFRESH_S
        if not self._refresh_lock.acquire(blocking=False):
            return False  # another request is scanning; this one answers from the current entries
        try:
            mtime = _mtime_ns(self.state_dir)
            if mtime is None or (mtime == self._dir_mtime and time.time_ns() - mtime > 2 * NS):
                return False
            try:
                names = os.listdir(self.state_dir)
            except OSError:
                return False  # gone or unreadable for now: keep what is known
            self.rescans += 1
            known = {e.name: e for e in self.entries}
            skipped: dict[str, str] = {}
            entries = sorted(_scan(self.state_dir, names, known, skipped), key=lambda e: (e.start_ns, e.name))
            # Only now: a listing that failed half-way is tried again at the next look.
            self._dir_mtime = mtime
            self.skipped = skipped
            if [id(e) for e in entries] == [id(e) for e in self.entries]:
                return False
            kept = {e.path for e in entries}
            with self._lock:
                self.entries = entries
                for path in [p for p in self._cache if p not in kept]:
                    self._cache_bytes -= self._cache.pop(path).nbytes
            return True
        finally:
            self._refresh_lock.release()

    @classmethod
    def from_files(cls, paths: Sequence[str], cache_bytes: int = CACHE_BYTES) -> Index:
        import contextlib

        from flamed.inputs import load_profile, open_sample_streams

        entries: list[Entry] = []
        untimed: list[Entry] = []
        trace = Trace()
        interned: dict[Stack, int] = {}
        for path in paths:
            with contextlib.ExitStack() as stack:
                stream = open_sample_streams([path], stack)
                if stream is not None:
                    lo = hi = None
                    total: Weight = 0
                    for s in stream:
                        i = interned.get(s.stack)
                        if i is None:
                            i = interned[s.stack] = len(trace.stacks)
                            trace.stacks.append(s.stack)
                        trace.times.append(s.time_ns)
                        trace.ids.append(i)
                        trace.weights.append(s.weight)
                        total += s.weight
                        lo = s.time_ns if lo is None else min(lo, s.time_ns)
                        hi = s.time_ns if hi is None else max(hi, s.time_ns)
                    if lo is not None and hi is not None:
                        entries.append(Entry(os.path.basename(path), "", lo, hi + 1, normalize_weight(total)))
                    continue
            p = load_profile([path])
            if p.start_ns is not None and p.end_ns is not None:
                entries.append(Entry(os.path.basename(path), path, p.start_ns, max(p.end_ns, p.start_ns + 1),
                                     p.total()))
            else:
                # No time in the file: one second each, in argument order, from 0.
                n = len(untimed)
                untimed.append(Entry(os.path.basename(path), path, n * NS, (n + 1) * NS, p.total(), timed=False))
        # Inputs without time only make a timeline of their own: next to inputs that
        # carry real times they would sit in 1970 and stretch the timeline over
        # decades. They are left out then (the command says so).
        left_out = [e.name for e in untimed] if entries else []
        if not entries:
            entries = untimed
        if trace.times:
            order = sorted(range(len(trace.times)), key=trace.times.__getitem__)
            trace.times = [trace.times[i] for i in order]
            trace.ids = [trace.ids[i] for i in order]
            trace.weights = [trace.weights[i] for i in order]
        index = cls(entries, trace, kind="trace" if trace.times else "files", source=", ".join(paths),
                    cache_bytes=cache_bytes)
        index.left_out = left_out
        return index

    # -- reading -----------------------------------------------------------
    @property
    def start_ns(self) -> int:
        return min((e.start_ns for e in self.entries), default=0)

    @property
    def end_ns(self) -> int:
        return max((e.end_ns for e in self.entries), default=0)

    def summary(self) -> dict[str, object]:
        return {
            "live": self.state_dir is not None,
            "kind": self.kind,
            "source": self.source,
            "files": len([e for e in self.entries if e.path and e.kind == "cpu"]),
            "start_ms": self.start_ns // 1_000_000,
            "end_ms": -(-self.end_ns // 1_000_000),
            "weight": normalize_weight(sum(e.weight for e in self.entries if e.kind == "cpu")),
            # What each kind of daemon file weighs, in its own unit (never summed across kinds).
            "profiles": {k: {"files": len([e for e in self.entries if e.path and e.kind == k]),
                             "weight": normalize_weight(sum(e.weight for e in self.entries if e.kind == k)),
                             "unit": KIND_UNIT[k]}
                         for k in PROFILE_KINDS if k == "cpu" or any(e.kind == k for e in self.entries)},
            "timestamped": bool(self.trace.times),
            "timed": all(e.timed for e in self.entries),
            "left_out": self.left_out,
            "skipped": dict(sorted(self.skipped.items())[:100]),
        }

    def status(self) -> dict[str, object]:
        """The cache's state and the work done since start (``/api/status``: tests and the bench)."""
        with self._lock:
            return {"parses": self.parses, "rescans": self.rescans, "cache_files": len(self._cache),
                    "cache_bytes": self._cache_bytes + self._table.nbytes, "cache_limit_bytes": self.cache_limit,
                    "frames": len(self._table.names), "frame_bytes": self._table.nbytes,
                    "entries": len(self.entries)}

    def _load(self, e: Entry) -> Profile:
        return self._compact(e).profile()

    def _compact(self, e: Entry) -> Compact:
        from flamed.inputs import load_profile

        # One parse per file however many requests want it at once (the page
        # asks for a range's graph and its top table together): the others
        # wait for that parse instead of repeating it.
        with self._lock:
            c = self._cache.get(e.path)
            if c is not None:
                self._cache.move_to_end(e.path)
                return c
            flight = self._parsing.get(e.path)
            if flight is None:
                flight = self._parsing[e.path] = threading.Lock()
        with flight:
            with self._lock:
                c = self._cache.get(e.path)
                if c is not None:
                    return c
            try:
                p = load_profile([e.path])
            except InputError:
                if self.state_dir is None or os.path.lexists(e.path):
                    raise
                # Retention removed it since the last listing: nothing to add, and
                # the next request lists the directory again.
                with self._lock:
                    self._parsing.pop(e.path, None)
                    self._next_check = 0.0
                return Compact(self._table, [], [], None, None, 0)
            with self._lock:
                self.parses += 1
                if self._table.nbytes > self.cache_limit // 2:
                    # Names no cached file may need any more would stay forever:
                    # start a new table (files packed with the old one keep it
                    # alive until they leave the cache, which starts now).
                    self._table = FrameTable()
                    self._cache.clear()
                    self._cache_bytes = 0
                table = self._table
            c = Compact.of(p, table)
            del p
            with self._lock:
                self._parsing.pop(e.path, None)
                if c.table is self._table:
                    self._cache[e.path] = c
                    self._cache_bytes += c.nbytes
                while self._cache and self._cache_bytes + self._table.nbytes > self.cache_limit:
                    self._cache_bytes -= self._cache.popitem(last=False)[1].nbytes
                if self._table.nbytes > self.cache_limit:
                    # The names of this one file alone pass the bound: keep none of
                    # them (this request still holds its table, until it is answered).
                    self._table = FrameTable()
                    self._cache.clear()
                    self._cache_bytes = 0
                if not e.sidecar and e.weight == 0:
                    e.weight = normalize_weight(sum(c.weights))  # known now that it is read
        return c

    def overlapping(self, start_ns: int, end_ns: int, kind: str = "cpu") -> list[Entry]:
        return [e for e in self.entries if e.path and e.kind == kind and e.start_ns < end_ns and e.end_ns > start_ns]

    def _entry_profile(self, e: Entry, filters: Filters) -> Profile:
        """One file's stacks through every filter, the cgroup ones by its own sidecar."""
        return filters.apply_identities(filters.apply(self._load(e)), e.identities, e.task_at)

    def profile(self, start_ns: int, end_ns: int, filters: Filters = Filters()) -> Profile:
        """The stacks of ``[start_ns, end_ns)``: whole files that overlap it, samples inside it."""
        out = Profile()
        if filters.by_cgroup():
            # Per file: pids name processes only within the file their sidecar describes.
            for e in self.overlapping(start_ns, end_ns, filters.profile):
                out.update(self._entry_profile(e, filters).stacks)
            out.start_ns, out.end_ns = start_ns, end_ns
            if filters.profile == "offcpu":
                out.labels.update(OFFCPU_LABELS)
            return out  # timestamped inputs have no identities: none passes, none is grouped
        # Summed packed (the same stack is one short bytes key in every file), unpacked once.
        merged: dict[int, tuple[FrameTable, dict[bytes, Weight]]] = {}
        for e in self.overlapping(start_ns, end_ns, filters.profile):
            c = self._compact(e)
            packed = merged.setdefault(id(c.table), (c.table, {}))[1]
            for key, w in zip(c.keys, c.weights):
                packed[key] = packed.get(key, 0) + w
        for table, packed in merged.values():
            out.update({table.unpack(key): w for key, w in packed.items()})
        t = self.trace
        if t.times and filters.profile == "cpu":
            lo = bisect.bisect_left(t.times, start_ns)
            hi = bisect.bisect_left(t.times, end_ns)
            acc: dict[int, Weight] = {}
            for i in range(lo, hi):
                k = t.ids[i]
                acc[k] = acc.get(k, 0) + t.weights[i]
            for k, w in acc.items():
                st = t.stacks[k]
                out.stacks[st] = out.stacks.get(st, 0) + w
        out.start_ns, out.end_ns = start_ns, end_ns
        if filters.profile == "offcpu":
            out.labels.update(OFFCPU_LABELS)  # the graphs say "us" of off-CPU time, not samples
        return filters.apply(out)

    def _ratio(self, e: Entry, filters: Filters) -> float:
        """The share of an entry's weight the filters keep (reads the file)."""
        key = (e.path, filters)
        with self._lock:
            w = self._filtered_weight.get(key)
        if w is None:
            w = self._entry_profile(e, filters).total()
            with self._lock:
                self._filtered_weight[key] = w
                while len(self._filtered_weight) > 100_000:
                    self._filtered_weight.popitem(last=False)
        return float(w) / float(e.weight) if e.weight else 0.0

    def points(self, start_ns: int, end_ns: int, filters: Filters) -> Iterable[tuple[int, float]]:
        """(time_ns, weight) of the finest things known: samples, windows, or whole files."""
        t = self.trace
        if t.times and not filters.by_cgroup() and filters.profile == "cpu":
            lo = bisect.bisect_left(t.times, start_ns)
            hi = bisect.bisect_left(t.times, end_ns)
            if filters.active():
                keep: dict[int, bool] = {}
                for i in range(lo, hi):
                    k = t.ids[i]
                    ok = keep.get(k)
                    if ok is None:
                        p = Profile({t.stacks[k]: 1})
                        ok = keep[k] = bool(filters.apply(p).stacks)
                    if ok:
                        yield t.times[i], float(t.weights[i])
            else:
                for i in range(lo, hi):
                    yield t.times[i], float(t.weights[i])
        for e in self.overlapping(start_ns, end_ns, filters.profile):
            ratio = self._ratio(e, filters) if filters.active() else 1.0
            if e.windows:
                for ws, we, n in e.windows:
                    # A window longer than a second (the daemon drains every
                    # drain_interval, 10 s by default) holds no finer times:
                    # its count is spread evenly over its seconds rather than
                    # piled into the first one.
                    secs = max(1, -(-(we - ws) // NS))
                    if secs == 1:
                        if start_ns <= ws < end_ns:
                            yield ws, n * ratio
                        continue
                    share = n * ratio / secs
                    for k in range(secs):
                        at = ws + k * NS
                        if start_ns <= at < end_ns:
                            yield at, share
            else:
                yield max(e.start_ns, start_ns), float(e.weight) * ratio

    def timeline(self, start_ns: int, end_ns: int, filters: Filters = Filters(), view: str = "auto") -> dict[str, object]:
        """Histogram (bars over time) or heatmap (columns of time, rows = offset inside a column).

        Heatmap columns are 1 s with 50 rows of 20 ms for timestamped inputs
        (FlameScope's layout), 60 s with 60 rows of 1 s for daemon windows.
        """
        span = max(1, end_ns - start_ns)
        col_ns, rows = (NS, 50) if self.trace.times else (60 * NS, 60)
        if view == "auto":
            view = "heatmap" if span // col_ns <= 720 and (self.trace.times or any(e.windows for e in self.entries)) else "histogram"
        if view == "heatmap":
            # At most HEATMAP_COLS columns: a longer range gets wider columns (a whole
            # multiple of the layout's, rows as many), never a heatmap of its start only.
            need = -(-(end_ns - start_ns // col_ns * col_ns) // col_ns)
            col_ns *= max(1, -(-need // HEATMAP_COLS))
            c0 = start_ns // col_ns * col_ns
            cols = max(1, -(-(end_ns - c0) // col_ns))
            cells = [[0.0] * rows for _ in range(cols)]
            row_ns = col_ns // rows
            for ts, w in self.points(start_ns, end_ns, filters):
                c = (ts - c0) // col_ns
                if 0 <= c < cols:
                    cells[c][min(rows - 1, (ts - c0 - c * col_ns) // row_ns)] += w
            return {"view": "heatmap", "start_ms": c0 // 1_000_000, "col_ms": col_ns // 1_000_000,
                    "rows": rows, "cols": cols, "cells": [[normalize_weight(round(v, 3)) for v in col] for col in cells]}
        if view != "histogram":
            raise UsageError(f"unknown timeline view {view!r}; use heatmap, histogram or auto")
        day = _BUCKETS[-1] * NS
        # Past 720 days, whole days a bar: the bars stay at most 720 for any
        # range asked for (a year-3000 end once made a list of 10^12 buckets).
        bucket = next((b * NS for b in _BUCKETS if span / (b * NS) <= 720), -(-span // (720 * day)) * day)
        b0 = start_ns // bucket * bucket
        n = max(1, -(-(end_ns - b0) // bucket))
        counts = [0.0] * n
        for ts, w in self.points(start_ns, end_ns, filters):
            i = (ts - b0) // bucket
            if 0 <= i < n:
                counts[i] += w
        return {"view": "histogram", "start_ms": b0 // 1_000_000, "bucket_ms": bucket // 1_000_000,
                "counts": [normalize_weight(round(v, 3)) for v in counts]}


def _mtime_ns(path: str | None) -> int | None:
    if path is None:
        return None
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


#: Most columns of a heatmap (a longer range gets wider columns).
HEATMAP_COLS = 4000
#: Latest time a file may be placed at: what the API's times (ms) and int64 ns hold.
_MAX_NS = 2**63 - 1
#: Bytes of files without a sidecar a listing parses to know their weight
#: (beyond it they weigh 0 on the timeline until a range that opens them).
WEIGH_BYTES = 64 << 20


def _scan(state_dir: str, names: list[str], known: dict[str, Entry],
          skipped: dict[str, str] | None = None) -> list[Entry]:
    """The entries of a listing; ``known`` entries are reused (rotated files do not change).

    Only regular files are entries (a FIFO or a directory under a file's name
    would block or fail every range over it, and a symlink may lead anywhere);
    a file that cannot be placed in time (a name that is no date, a sidecar
    that is no object or times outside 1970..2262) is left out, and why goes
    in ``skipped``.  Nothing a file or sidecar holds stops the listing.
    """
    present = set(names)
    entries: list[Entry] = []
    budget = WEIGH_BYTES
    for name in names:
        m = FILE_RE.match(name)
        if m is None:
            continue
        path = os.path.join(state_dir, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue  # gone since the listing
        if not stat.S_ISREG(st.st_mode):
            if skipped is not None:
                skipped[name] = "not a regular file"
            continue
        stem = m.group("stem")
        has_sidecar = stem + ".json" in present and SIDECAR_RE.match(stem + ".json") is not None
        old = known.get(name)
        if old is not None and (old.sidecar or not has_sidecar):
            entries.append(old)
            continue
        meta: dict[str, object] = {}
        if has_sidecar:
            try:
                with open(os.path.join(state_dir, stem + ".json"), "rb") as fh:
                    loaded = json.load(fh)
                meta = loaded if isinstance(loaded, dict) else {}
            except (OSError, ValueError, RecursionError):
                meta = {}
        try:
            e = _entry_from_sidecar(name, path, m.group("ts"), meta)
        except ValueError as err:
            if skipped is not None:
                skipped[name] = str(err)
            continue
        e.sidecar = bool(meta)
        e.kind = str(meta.get("kind") or file_kind(m))
        if not e.sidecar and budget >= st.st_size:
            # No sidecar (a file copied without it): its weight from the file itself,
            # so that its bar has a height; within a bound per listing.
            budget -= st.st_size
            e.weight = _file_weight(path)
        entries.append(e)
    return entries


def _file_weight(path: str) -> Weight:
    from flamed.inputs import load_profile

    try:
        return load_profile([path]).total()
    except Exception:  # noqa: BLE001 - any input error: it is said when a range opens the file
        return 0


def _entry_from_sidecar(name: str, path: str, ts: str, meta: dict[str, object]) -> Entry:
    """The entry of a file: its time, weight and windows from the sidecar
    ``meta`` where they make sense, else from the time in its name.  ValueError
    (the reason) when it cannot be placed in time."""
    import calendar

    start = meta.get("start_ns")
    end = meta.get("end_ns")
    if not isinstance(start, int) or isinstance(start, bool) or not 0 <= start <= _MAX_NS:
        try:
            start = calendar.timegm(time.strptime(ts, "%Y%m%dT%H%M%SZ")) * NS
        except (ValueError, OverflowError):
            raise ValueError(f"its name's time {ts} is no date, and no sidecar gives one") from None
    if not 0 <= start <= _MAX_NS - 60 * NS:
        raise ValueError(f"its time ({ts}) is outside the times flamed places (1970 to 2262)")
    if not isinstance(end, int) or isinstance(end, bool) or not start < end <= _MAX_NS:
        end = start + 60 * NS
    weight = meta.get("weight")
    if not _is_weight(weight):
        weight = meta.get("samples") if _is_weight(meta.get("samples")) else 0
    assert isinstance(weight, (int, float))
    windows: list[tuple[int, int, int]] = []
    raw = meta.get("window_samples")
    if isinstance(raw, list):
        for w in raw:
            # A window inside the file's time and a count: anything else is not the daemon's.
            if (isinstance(w, list) and len(w) == 3 and all(isinstance(x, int) and not isinstance(x, bool) for x in w)
                    and start - 60 * NS <= w[0] < w[1] <= end + 60 * NS and w[2] >= 0):
                windows.append((w[0], w[1], w[2]))
    return Entry(name, path, start, end, weight, windows, identities=_identities(meta),
                 task_at=_task_at(meta.get("root_frame", "pid")))


def _is_weight(x: object) -> bool:
    """A weight a sidecar may give: a finite number, 0 or more (NaN is no JSON the page reads)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x < float("inf")


def _identities(meta: dict[str, object]) -> dict[int, CgroupIdentity]:
    """pid -> identity from a sidecar's ``identities`` (pid -> labels); the cgroup path says it all."""
    raw = meta.get("identities")
    out: dict[int, CgroupIdentity] = {}
    if isinstance(raw, dict):
        for pid, labels in raw.items():
            if isinstance(pid, str) and pid.isascii() and pid.isdigit() and isinstance(labels, dict):
                path = labels.get("cgroup")
                if isinstance(path, str):
                    out[int(pid)] = identity_from_path(path)
    return out


def _task_at(root_frame: object) -> int | None:
    """Which of a file's root frames names the task with its pid."""
    try:
        kinds = parse_root(root_frame) if isinstance(root_frame, str) else ()
    except ValueError:
        return None
    return next((i for i, k in enumerate(kinds) if k in ("pid", "tid")), None)
