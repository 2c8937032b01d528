"""Rotating folded files in the state directory, with sidecars, ``latest`` links and retention.

One file per rotation period, ``HOST-YYYYMMDDTHHMMSSZ.folded[.gz]`` (UTC start
of its first window), pure folded text that flamegraph.pl reads as it is.
With ``[sampling] off_cpu`` each period also gives an off-CPU file,
``offcpu-HOST-YYYYMMDDTHHMMSSZ.folded[.gz]``, whose weights are microseconds
off the CPU (its sidecar says ``"kind": "offcpu"``, ``"unit": "microseconds"``);
both kinds are under the same retention limits.
Its metadata is in the sidecar ``HOST-YYYYMMDDTHHMMSSZ.json``, with the
cgroup identities of its processes (``identities``: pid -> labels) so files
can be filtered by service or container later.

A closed period is written straight from its windows into the file's
temporary file (:class:`StreamedFile`): its text, tens of MB for a period
of 100 k distinct stacks per window, is never held whole in memory;
the sidecar (its digest and size) follows from what was written.  Only
while the disk refuses files is a period's text kept in memory
(:class:`PendingFile`, the backlog below).

Crash safety: the sidecar is in place (temp, fsync, rename) *before* the
folded file is renamed into place, so every folded file has its sidecar; a crash between the two
leaves at most an orphan sidecar, which :meth:`ProfileStore.recover` removes,
as it removes temp files.  ``latest.folded`` is a symlink replaced atomically
(rename of a new link over the old one).

A full disk (ENOSPC, EDQUOT): the oldest profile files are deleted, one at a
time, until the newest fits -- the newest data is worth more -- and counted in
``flamed_files_deleted_total{reason="disk_full"}``.  Other disk errors (EIO,
EROFS...), or a disk full with none of our files left to delete: the closed
period stays in an in-memory backlog, bounded by ``backlog_max_bytes``, and is
written once the disk accepts it again.  What the bound drops is counted as
lost samples (``flamed_samples_lost_total{reason="backlog_full"}``), and so is
what is still unwritten at exit (``reason="unwritten_at_exit"``): every sample
the store was given is either in a file written or counted lost
(:meth:`ProfileStore.log_exit_accounting`).  Nothing half-written stays behind
because :func:`flamed.fileio.atomic_write` removes its temp file.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import hashlib
import io
import json
import logging
import os
import re
import socket
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, BinaryIO, TypeVar, cast

from flamed import __version__
from flamed.daemon.config import OutputConfig, RetentionConfig
from flamed.daemon.metrics import DaemonMetrics
from flamed.fileio import atomic_write
from flamed.folded import write_folded, write_lines
from flamed.model import Weight
from flamed.daemon.ring import DecodeCache, PackedCounts, window_items
from flamed.sampling.cgroups import CgroupIdentity
from flamed.sampling.contract import CountKey, counts_to_profile, parse_root, root_frames
from flamed.sampling.packed import MergedByRoot

log = logging.getLogger("flamed.daemon")
_K = TypeVar("_K")

#: Profile file names the store owns (and retention may delete).
FILE_RE = re.compile(
    r"^(?P<stem>(?:(?P<kind>offcpu)-)?(?P<host>.+)-(?P<ts>\d{8}T\d{6}Z)(?:-(?P<seq>\d+))?)\.folded(?P<gz>\.gz)?$")
SIDECAR_RE = re.compile(r"^(?P<stem>.+-\d{8}T\d{6}Z(?:-\d+)?)\.json$")
LATEST = "latest"
#: File kinds: CPU samples (no prefix), off-CPU time (``offcpu-`` prefix, microseconds).
KIND_PREFIX = {"cpu": "", "offcpu": "offcpu-"}
#: What the folded weights of each kind are.
KIND_UNIT = {"cpu": "samples", "offcpu": "microseconds"}


def file_kind(m: re.Match[str]) -> str:
    """The kind of a FILE_RE match: ``cpu`` or ``offcpu``."""
    return "offcpu" if m.group("kind") else "cpu"


def _kind_of(name: str) -> str:
    """The kind of a profile file's name (``cpu`` for a name FILE_RE does not match)."""
    m = FILE_RE.match(name)
    return file_kind(m) if m is not None else "cpu"


def _ns_to_us(ns: Weight) -> int:
    """Nanoseconds to whole microseconds, rounded."""
    return int(ns + 500) // 1000


def ns_to_us(counts: Mapping[_K, Weight]) -> dict[_K, Weight]:
    """Nanoseconds per key to microseconds, rounded once per key; keys under 0.5 us are left out."""
    out: dict[_K, Weight] = {}
    for k, ns in counts.items():
        us = _ns_to_us(ns)
        if us > 0:
            out[k] = us
    return out


def host_name(configured: str) -> str:
    name = configured or socket.gethostname() or "localhost"
    # The host goes into file names: keep it one safe path component.
    return re.sub(r"[^A-Za-z0-9._-]", "_", name).strip(".") or "localhost"


@dataclass
class Period:
    """The rotation period being filled."""

    start_ns: int | None = None
    end_ns: int | None = None
    #: The windows' counts as they were added (the ring's packed windows are
    #: shared, not copied: merged only when the file is written).
    parts: list[Mapping[CountKey, int]] = field(default_factory=list)
    samples: int = 0
    lost: dict[str, int] = field(default_factory=dict)
    sample_rate: float | None = None
    windows: int = 0
    #: (start_ns, end_ns, samples) of every window, so a viewer can draw the
    #: period at the drain resolution without reading the stacks.
    window_samples: list[tuple[int, int, int]] = field(default_factory=list)
    #: (start_ns, end_ns, weight) of every window (off-CPU: nanoseconds).
    window_weights: list[tuple[int, int, int]] = field(default_factory=list)
    #: tgid -> who owns its cgroup, the newest window's where they differ
    identities: dict[int, CgroupIdentity] = field(default_factory=dict)

    def add(self, start_ns: int, end_ns: int, counts: Mapping[CountKey, int], samples: int,
            lost: dict[str, int], sample_rate: float | None,
            identities: Mapping[int, CgroupIdentity] | None = None) -> None:
        if identities:
            self.identities.update(identities)
        if self.start_ns is None:
            self.start_ns = start_ns
        self.end_ns = end_ns
        self.parts.append(counts)
        self.samples += samples
        for r, n in lost.items():
            self.lost[r] = self.lost.get(r, 0) + n
        if self.windows == 0:
            self.sample_rate = sample_rate
        elif self.sample_rate != sample_rate:
            self.sample_rate = None  # the rate changed (reload) inside this period
        self.windows += 1
        self.window_samples.append((start_ns, end_ns, samples))
        self.window_weights.append((start_ns, end_ns, sum(counts.values())))

    def tgids(self) -> set[int]:
        """The processes with counts in the period."""
        out: set[int] = set()
        for part in self.parts:
            out |= part.tgids() if isinstance(part, PackedCounts) else {k[0] for k in part}
        return out

    @property
    def counts(self) -> dict[CountKey, int]:
        """The period's counts, merged (each packed key decoded once)."""
        out: dict[CountKey, int] = {}
        cache: DecodeCache = {}
        for part in self.parts:
            for k, n in window_items(part, cache):
                out[k] = out.get(k, 0) + n
        return out


def _merged(p: Period, root: str) -> MergedByRoot | None:
    """The period's windows merged by folded line, when they are all packed in one table."""
    parts = p.parts
    if not parts or not all(isinstance(x, PackedCounts) for x in parts):
        return None
    packed = cast(list[PackedCounts], parts)
    states = [x._state for x in packed]  # each taken once: a sweep may move a window meanwhile
    table = states[0][0]
    if any(st[0] is not table for st in states):
        return None
    kinds = parse_root(root)
    idents = p.identities
    return MergedByRoot(table, [PackedCounts(*st) for st in states],
                        lambda t: root_frames(kinds, t[0], t[1], t[2], idents.get(t[0])))


@dataclass(eq=False)
class PendingFile:
    """A closed period, serialized in memory, waiting to be written (the backlog)."""

    stem: str
    suffix: str
    payload: bytes
    sidecar: bytes
    start_ns: int
    samples: int = 0
    kind: str = "cpu"

    @property
    def size(self) -> int:
        return len(self.payload) + len(self.sidecar)

    def emit(self, out: BinaryIO) -> bytes:
        """Write the profile to ``out``; return its sidecar."""
        out.write(self.payload)
        return self.sidecar


class _Hashing:
    """A write-only stream that hashes and counts what it passes on."""

    def __init__(self, out: BinaryIO) -> None:
        self.out = out
        self.sha = hashlib.sha256()
        self.n = 0

    def write(self, b: bytes) -> int:
        self.sha.update(b)
        self.n += len(b)
        return self.out.write(b)

    def flush(self) -> None:
        self.out.flush()


@dataclass(eq=False)
class StreamedFile:
    """A closed period written straight from its windows into the file: the
    text of a large period (tens of MB with 100 k distinct stacks per
    window) is never held whole in memory.  Emitted again from the period
    if a write has to be retried."""

    store: ProfileStore
    period: Period
    kind: str
    stem: str
    suffix: str
    size: int = 0

    @property
    def samples(self) -> int:
        return self.period.samples

    def emit(self, out: BinaryIO) -> bytes:
        h = _Hashing(out)
        lines, weight, total = self.store._fold_to(self.period, self.kind, cast(BinaryIO, h))
        sidecar = self.store._sidecar(self.period, self.kind, self.stem + self.suffix, h.n, h.sha.hexdigest(),
                                      lines, weight, total)
        self.size = h.n + len(sidecar)
        return sidecar


@dataclass
class StoreStats:
    files: int = 0
    bytes: int = 0


class ProfileStore:
    def __init__(
        self,
        output: OutputConfig,
        retention: RetentionConfig,
        metrics: DaemonMetrics,
        *,
        clock_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        self.metrics = metrics
        self._clock_ns = clock_ns
        self.period = Period()
        #: Off-CPU windows of the current period (nanoseconds), with [sampling] off_cpu.
        self.offcpu_period = Period()
        self.last_written_offcpu: str | None = None
        self.backlog: deque[PendingFile] = deque()
        self.backlog_bytes = 0
        self.last_written: str | None = None
        self.last_error: str | None = None
        self.files_written = 0
        #: Samples given to the store, in files written, dropped unwritten (backlog over budget).
        self.samples_added = 0
        self.samples_written = 0
        self.samples_dropped = 0
        #: (files, bytes) deleted to make room since the disk became full; None: it has room.
        self._full_episode: tuple[int, int] | None = None
        self._drop_logged = False
        self._names_used: set[str] = set()
        #: Profile files a deletion was refused for (warned about once each).
        self._undeletable: set[str] = set()
        #: File name -> the order this run wrote it in: what retention deletes first is the file
        #: written first, even when the wall clock went back and a newer file has an older name.
        self._written_order: dict[str, int] = {}
        self._writes = 0
        #: Called when the directory was made again, and at every check_dir (the daemon checks its lock).
        self.on_dir_made: Callable[[], None] | None = None
        self.configure(output, retention)

    # -- configuration ---------------------------------------------------
    def configure(self, output: OutputConfig, retention: RetentionConfig) -> None:
        self.output = output
        self.retention = retention
        new_dir = os.path.abspath(output.state_dir)
        if new_dir != getattr(self, "dir", new_dir):
            self._written_order = {}  # names in another directory
        self.dir = new_dir
        self.host = host_name(output.host)

    def ensure_dir(self) -> None:
        """The state directory, made again if it was removed while the daemon ran (said, and
        :attr:`on_dir_made` called: the daemon takes its lock in the new directory)."""
        if os.path.isdir(self.dir):
            return
        if os.path.lexists(self.dir):
            # makedirs would say "File exists", which names neither the path nor what is wrong.
            what = "a dangling symbolic link" if not os.path.exists(self.dir) else "not a directory"
            raise NotADirectoryError(errno.ENOTDIR, f"the state directory {self.dir} is {what} (was it replaced?)")
        os.makedirs(self.dir, mode=0o755, exist_ok=True)
        log.warning("state directory %s was removed while the daemon ran; made it again (the files that were "
                    "in it are gone)", self.dir)
        if self.on_dir_made is not None:
            self.on_dir_made()

    def check_dir(self) -> None:
        """At each drain: the directory made again if it went, then :attr:`on_dir_made`'s
        check of the daemon's lock; an error is left to the next write, which reports it."""
        try:
            self.ensure_dir()
        except OSError:
            return
        if self.on_dir_made is not None:
            self.on_dir_made()

    # -- filling ---------------------------------------------------------
    def add(self, start_ns: int, end_ns: int, counts: Mapping[CountKey, int], samples: int,
            lost: dict[str, int], sample_rate: float | None,
            identities: Mapping[int, CgroupIdentity] | None = None) -> None:
        self.period.add(start_ns, end_ns, counts, samples, lost, sample_rate, identities)
        self.samples_added += samples

    def add_offcpu(self, start_ns: int, end_ns: int, counts_ns: Mapping[CountKey, int],
                   identities: Mapping[int, CgroupIdentity] | None = None) -> None:
        """One window's off-CPU time (nanoseconds per task and stack) into the current period."""
        self.offcpu_period.add(start_ns, end_ns, counts_ns, 0, {}, None, identities)

    def due(self, now_ns: int, next_drain_ns: int | None = None) -> bool:
        """Should the current period close at a drain ending at ``now_ns``?

        Yes once its boundary (a multiple of rotate_interval) is reached; before
        it, only when this drain is nearer to the boundary than the next
        scheduled one (``next_drain_ns``), which is how a period ends near its
        boundary when no scheduled drain falls on it.  A drain forced by a
        snapshot just before a boundary that the next scheduled drain meets
        leaves the closing to that drain, so no short file is split off."""
        if self.period.start_ns is None:
            return False
        if now_ns < self.period.start_ns:
            # The wall clock went back past the period's start: its boundary is
            # that far away; close it now, the next period starts at the new time.
            return True
        rot = int(self.output.rotate_interval * 1e9)
        boundary = (self.period.start_ns // rot + 1) * rot
        if now_ns >= boundary:
            return True
        return next_drain_ns is not None and boundary - now_ns <= next_drain_ns - boundary

    # -- closing and writing ---------------------------------------------
    def rotate(self) -> str | None:
        """Close the current period (if it has any window) and write what is pending.

        A closed period is written straight from its windows when no file
        waits before it; otherwise, or when that write fails, its text joins
        the backlog.  Returns the path of the newest file written, or ``None``.
        """
        closed: list[tuple[Period, str]] = []
        o = self.offcpu_period
        if o.windows:
            # Before the CPU file of the period: last_written stays the CPU file's.
            self.offcpu_period = Period()
            closed.append((o, "offcpu"))
        p = self.period
        if p.windows:
            self.period = Period()
            closed.append((p, "cpu"))
        newest: str | None = None
        failed = False
        for period, kind in closed:
            suffix = ".folded.gz" if self.output.compress else ".folded"
            stem = self._unique_stem(period.start_ns or 0, suffix, KIND_PREFIX[kind])
            if not self.backlog:
                path = self._try_write(StreamedFile(self, period, kind, stem, suffix))
                if path is not None:
                    if kind == "cpu":
                        newest = path
                    continue
                failed = True
            self._queue(self._serialize(period, kind, stem, suffix))
        if self.backlog and not failed:
            newest = self.write_pending() or newest
        elif newest is not None:
            self.apply_retention()
        return newest

    def _fold_to(self, p: Period, kind: str, dest: BinaryIO) -> tuple[int, int, Weight]:
        """Write the period as folded text (gzipped if configured) to ``dest``:
        (lines, the windows' weight, the file's weight)."""
        out: BinaryIO = dest
        gz = gzip.GzipFile(fileobj=dest, mode="wb", mtime=0) if self.output.compress else None
        if gz is not None:
            out = cast(BinaryIO, gz)
        with gz if gz is not None else contextlib.nullcontext():
            merged = _merged(p, self.output.root_frame)
            if merged is not None:
                # Packed windows of one table: lines written from frame numbers,
                # no tuple of frames per line (docs/bpf.md, "Where a large drain's memory stays").
                weight = sum(merged.counts.values())
                weigh = _ns_to_us if kind == "offcpu" else None
                total: Weight = weight if weigh is None else sum(map(weigh, merged.counts.values()))
                lines = write_lines(merged.lines(merged.sorted_keys(), weigh), out)
            else:
                counts = p.counts
                weight = sum(counts.values())
                profile = counts_to_profile(counts, self.output.root_frame, identities=p.identities)
                if kind == "offcpu":
                    # Nanoseconds to microseconds once per stack of the file (several tasks may fold into one).
                    profile.stacks = ns_to_us(profile.stacks)
                lines = write_folded(profile, out)
                total = profile.total()
        return lines, weight, total

    def _sidecar(self, p: Period, kind: str, name: str, size: int, sha256: str, lines: int, weight: int,
                 total: Weight) -> bytes:
        """The sidecar of the period's file ``name`` (``size`` bytes, that digest)."""
        assert p.start_ns is not None and p.end_ns is not None
        meta: dict[str, Any] = {
            "file": name,
            "format": "folded",
            "compressed": self.output.compress,
            "host": self.host,
            "start_ns": p.start_ns,
            "end_ns": p.end_ns,
            "start": _iso(p.start_ns),
            "end": _iso(p.end_ns),
            "sample_rate": p.sample_rate,
            "samples": p.samples,
            "weight": weight,
            "lost": dict(sorted(p.lost.items())),
            "stacks": lines,
            "windows": p.windows,
            "window_samples": [list(w) for w in p.window_samples],
            "root_frame": self.output.root_frame,
            "identities": _identities(p),
            **({"kind": kind, "unit": KIND_UNIT[kind], "weight_ns": weight,
                "weight": total,
                # per window: (start_ns, end_ns, microseconds off the CPU), for viewers' timelines
                "window_samples": [[ws, we, _ns_to_us(n)] for ws, we, n in p.window_weights]}
               if kind != "cpu" else {}),
            "bytes": size,
            "sha256": sha256,
            "flamed_version": __version__,
        }
        return (json.dumps(meta, indent=2, sort_keys=True) + "\n").encode()

    def _serialize(self, p: Period, kind: str, stem: str, suffix: str) -> PendingFile:
        """The period's file in memory, for the backlog."""
        assert p.start_ns is not None
        buf = io.BytesIO()
        f = StreamedFile(self, p, kind, stem, suffix)
        sidecar = f.emit(buf)
        return PendingFile(stem, suffix, buf.getvalue(), sidecar, p.start_ns, p.samples, kind)

    def _unique_stem(self, start_ns: int, suffix: str, prefix: str = "") -> str:
        base = f"{prefix}{self.host}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime(start_ns // 1_000_000_000))}"
        stem, n = base, 1
        # Two periods can start in the same second (flush): add -2, -3...
        while stem in self._names_used or os.path.exists(os.path.join(self.dir, stem + ".json")):
            n += 1
            stem = f"{base}-{n}"
        self._names_used.add(stem)
        if len(self._names_used) > 4096:
            self._names_used = {stem}
        return stem

    def _queue(self, f: PendingFile) -> None:
        self.backlog.append(f)
        self.backlog_bytes += f.size
        # Keep the newest: drop the oldest unwritten files beyond the budget (but never the one just closed).
        while len(self.backlog) > 1 and self.backlog_bytes > self.output.backlog_max_bytes:
            old = self.backlog.popleft()
            self.backlog_bytes -= old.size
            self.samples_dropped += old.samples
            self.metrics.backlog_dropped.inc()
            self.metrics.samples_lost.labels(reason="backlog_full").inc(old.samples)
            # Once per outage: every rotation drops one more while it lasts.
            log.log(logging.DEBUG if self._drop_logged else logging.ERROR,
                    "dropped unwritten profile %s%s (%d samples, counted lost: "
                    "flamed_samples_lost_total{reason=\"backlog_full\"}) from memory: backlog over "
                    "output.backlog_max_bytes=%d while the state directory refuses writes%s",
                    old.stem, old.suffix, old.samples, self.output.backlog_max_bytes,
                    "" if self._drop_logged else "; further drops are only counted until it accepts them")
            self._drop_logged = True
        self._update_backlog_metrics()

    def _update_backlog_metrics(self) -> None:
        self.metrics.backlog_bytes.set(self.backlog_bytes)
        self.metrics.backlog_files.set(len(self.backlog))

    def write_pending(self) -> str | None:
        """Write the backlog oldest first; stop at the first failure and keep the rest."""
        newest: str | None = None
        while self.backlog:
            f = self.backlog[0]
            path = self._try_write(f)
            if path is None:
                break
            self.backlog.popleft()
            self.backlog_bytes -= f.size
            if f.kind == "cpu":
                newest = path
        self._update_backlog_metrics()
        if newest is not None:
            self.apply_retention()
        return newest

    def _try_write(self, f: PendingFile | StreamedFile) -> str | None:
        """Write one file, making room on a full disk; its path, or ``None``
        when it could not be written (the error is counted and logged)."""
        try:
            path = self._write_making_room(f)
        except OSError as e:
            name = errno.errorcode.get(e.errno or 0, "EUNKNOWN")
            self.metrics.write_errors.labels(errno=name).inc()
            msg = f"cannot write {os.path.join(self.dir, f.stem + f.suffix)}: {e.strerror or e}"
            # Once per kind of error, not once per file: each drain retries a new one.
            if self.last_error is None or self.last_error.split(": ")[-1] != msg.split(": ")[-1]:
                log.error("%s; keeping the unwritten file(s) in memory (output.backlog_max_bytes=%d; "
                          "now %d file(s), %d bytes, before this one) and retrying at every drain", msg,
                          self.output.backlog_max_bytes, len(self.backlog) - (f in self.backlog),
                          self.backlog_bytes - (f.size if f in self.backlog else 0))
            self.last_error = msg
            # No file was written, so no retention pass follows: the disk gauges say what
            # is left (files deleted to make room, a directory removed or replaced), as
            # status does.
            self._set_disk_metrics(self.list_files())
            return None
        self.samples_written += f.samples
        self.metrics.samples_written.inc(f.samples)
        if self.last_error is not None:
            log.warning("state directory writable again: wrote %s", path)
            self.last_error = None
            self._drop_logged = False
        return path

    def _write_making_room(self, f: PendingFile | StreamedFile) -> str:
        """Write ``f``; while the disk is full, delete the oldest profile file and try again."""
        deleted = False
        while True:
            try:
                self.ensure_dir()
                path = self._write(f)
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EDQUOT) or not self._delete_oldest(e):
                    raise
                deleted = True
                continue
            if not deleted and self._full_episode is not None:
                files, size = self._full_episode
                self._full_episode = None
                log.info("state directory has room again: %d profile file(s), %d bytes were deleted to make "
                         "room while it was full", files, size)
            return path

    def _delete_oldest(self, e: OSError) -> bool:
        """Delete the oldest profile file (and sidecar) for a full disk; False when none is left
        that can be deleted (a file that refuses, e.g. immutable, is passed over)."""
        for stem, name, size, _mtime in self.list_files():
            if self._delete(stem, name, size, "disk_full"):
                break
        else:
            return False
        if self._full_episode is None:
            self._full_episode = (0, 0)
            log.warning("state directory %s is full (%s): deleting the oldest profile files to make room for "
                        "the newest (counted in flamed_files_deleted_total{reason=\"disk_full\"}; logged "
                        "again once it has room)", self.dir, e.strerror or e)
        files_n, bytes_n = self._full_episode
        self._full_episode = (files_n + 1, bytes_n + size)
        return True

    def _delete(self, stem: str, name: str, size: int, reason: str) -> bool:
        """Delete a profile file and its sidecar; False (said once per file, and counted) when the
        file cannot be deleted (immutable, a mount point, ...): it stays, sidecar included."""
        try:
            os.unlink(os.path.join(self.dir, name))
        except FileNotFoundError:
            pass  # someone else deleted it: gone all the same
        except OSError as e:
            self.metrics.delete_errors.labels(errno=errno.errorcode.get(e.errno or 0, "EUNKNOWN")).inc()
            if name not in self._undeletable:
                if len(self._undeletable) >= 4096:
                    self._undeletable.clear()
                self._undeletable.add(name)
                log.warning("%s: cannot delete %s: %s; it stays (and still counts against the retention "
                            "limits), the next oldest file is deleted instead (counted in "
                            "flamed_delete_errors_total)", reason, os.path.join(self.dir, name), e.strerror or e)
            return False
        self._undeletable.discard(name)
        self._written_order.pop(name, None)
        self._unlink_latest_of(name)
        try:
            os.unlink(os.path.join(self.dir, stem + ".json"))
        except FileNotFoundError:
            pass
        except OSError as e:
            # The profile is gone; its orphan sidecar is removed by the next start's recovery.
            log.warning("%s: deleted %s but not its sidecar: %s", reason, name, e.strerror or e)
        self.metrics.files_deleted.labels(reason=reason).inc()
        self.metrics.bytes_deleted.labels(reason=reason).inc(size)
        log.debug("%s: deleted %s", reason, name)
        return True

    def log_exit_accounting(self) -> None:
        """At exit: every sample given to the store is in a file written or counted lost; say so.
        (Samples the program could not count, a full map, were never drained: the
        sampler's own stop line and flamed_samples_lost_total say those.)"""
        unwritten = sum(f.samples for f in self.backlog)
        if unwritten:
            self.metrics.samples_lost.labels(reason="unwritten_at_exit").inc(unwritten)
        lost = self.samples_dropped + unwritten
        log.log(logging.ERROR if lost else logging.INFO,
                "stopping: %d samples drained since start: %d in profile files written, %d lost on the way to them (%d dropped from "
                "the backlog over output.backlog_max_bytes=%d, %d in %d profile file(s), %d bytes, that could "
                "not be written at exit%s)", self.samples_added, self.samples_written, lost, self.samples_dropped,
                self.output.backlog_max_bytes, unwritten, len(self.backlog), self.backlog_bytes,
                f": {self.last_error}" if self.backlog else "")

    def _write(self, f: PendingFile | StreamedFile) -> str:
        fsync = self.output.fsync
        sidecar_path = os.path.join(self.dir, f.stem + ".json")
        path = os.path.join(self.dir, f.stem + f.suffix)
        placed = False
        try:
            with atomic_write(path, fsync=fsync) as out:
                sidecar = f.emit(out)
                # The sidecar is in place before the file it describes (see the module's docstring).
                with atomic_write(sidecar_path, fsync=fsync) as side:
                    side.write(sidecar)
                placed = True
        except BaseException:
            if placed:
                with contextlib.suppress(OSError):
                    os.unlink(sidecar_path)
            raise
        self._writes += 1
        self._written_order[os.path.basename(path)] = self._writes
        self.metrics.files_written.inc()
        self.files_written += 1
        self.metrics.bytes_written.inc(f.size)
        self.metrics.last_rotation.set(self._clock_ns() / 1e9)
        latest = LATEST
        if f.kind == "cpu":
            self.last_written = path
        else:
            self.last_written_offcpu = path
            latest = f"{LATEST}-{f.kind}"
        try:
            self._link_latest(f.stem + f.suffix, f.suffix, latest)
            self._link_latest(f.stem + ".json", ".json", latest)
        except OSError as e:
            log.warning("cannot update %s links: %s", LATEST, e.strerror or e)
        return path

    def _unlink_latest_of(self, name: str) -> None:
        """The ``latest`` links (file and sidecar) that name the profile file ``name``, just
        deleted, go with it instead of pointing at nothing (the newest file of a kind no
        longer recorded, ``off_cpu`` turned off, once retention deletes it)."""
        for latest in (LATEST, f"{LATEST}-offcpu"):
            for suffix in (".folded", ".folded.gz"):
                link = os.path.join(self.dir, latest + suffix)
                try:
                    if os.readlink(link) != name:
                        continue
                    os.unlink(link)
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(self.dir, latest + ".json"))
                except OSError:
                    continue  # no such link (or not a link): nothing names the file
        if self.last_written_offcpu is not None and os.path.basename(self.last_written_offcpu) == name:
            self.last_written_offcpu = None

    def _link_latest(self, target: str, suffix: str, latest: str = LATEST) -> None:
        link = os.path.join(self.dir, latest + suffix)
        tmp = os.path.join(self.dir, f".{latest}{suffix}.{os.getpid()}.tmp")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        os.symlink(target, tmp)
        os.replace(tmp, link)  # rename(2) replaces the old link atomically
        # A compress switch on reload leaves the other latest link pointing at an older file.
        other = ".folded" if suffix == ".folded.gz" else ".folded.gz" if suffix == ".folded" else None
        if other is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.dir, latest + other))

    # -- the directory ---------------------------------------------------
    def list_files(self) -> list[tuple[str, str, int, float]]:
        """Profile files as (stem, name, bytes incl. sidecar, mtime), oldest first: those this
        run did not write by the time in their names, then those it wrote, in the order it wrote
        them (after a step back of the wall clock a new file's name is older than the last one's)."""
        out: list[tuple[tuple[int, str, int, int], str, str, int, float]] = []
        order = dict(self._written_order)  # a copy: status() lists the files from a client thread
        try:
            entries = list(os.scandir(self.dir))
        except OSError:
            return []  # missing, not a directory, unreadable: the write errors say why
        sizes: dict[str, int] = {}
        for e in entries:
            if SIDECAR_RE.match(e.name):
                with contextlib.suppress(OSError):
                    sizes[e.name[: -len(".json")]] = e.stat(follow_symlinks=False).st_size
        for e in entries:
            m = FILE_RE.match(e.name)
            if m is None or not e.is_file(follow_symlinks=False):
                continue
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            stem = m.group("stem")
            # -10 after -9: periods that started in the same second, in the order they were written
            seq = int(m.group("seq") or 1)
            written = order.get(e.name)
            key = (0, m.group("ts"), seq, 0) if written is None else (1, "", 0, written)
            out.append((key, stem, e.name, st.st_size + sizes.get(stem, 0), st.st_mtime))
        out.sort(key=lambda t: (t[0], t[1]))
        return [(stem, name, size, mtime) for _key, stem, name, size, mtime in out]

    def apply_retention(self) -> StoreStats:
        """Delete the oldest files beyond max_files, max_bytes or max_age; update the disk metrics.

        ``max_files`` counts each kind on its own (CPU files, off-CPU files:
        with ``off_cpu`` on every period writes one of each, and a limit of N
        keeps N periods of both); ``max_bytes`` is all the files together;
        ``max_age`` is each file's.  The newest file is never deleted, whatever
        the limits, and the newest of the other kind only by ``max_age`` (the
        last off-CPU file, once ``off_cpu`` is turned off, ages out)."""
        r = self.retention
        files = self.list_files()
        present = {f[1] for f in files}
        if any(n not in present for n in self._written_order):
            # Files someone else deleted: forget them (here, in the loop's thread).
            self._written_order = {n: i for n, i in self._written_order.items() if n in present}
        total = sum(f[2] for f in files)
        now = self._clock_ns() / 1e9
        count = len(files)
        by_kind: dict[str, int] = {}
        newest: dict[str, str] = {}
        for _stem, name, _size, _mtime in files:
            kind = _kind_of(name)
            by_kind[kind] = by_kind.get(kind, 0) + 1
            newest[kind] = name
        last = files[-1][1] if files else None
        kinds_newest = set(newest.values())
        # Oldest first.  A file that cannot be deleted stays (and still counts): the
        # next oldest goes in its place.
        for stem, name, size, mtime in files:
            if name == last:
                continue
            kind = _kind_of(name)
            counted = name not in kinds_newest
            if counted and r.max_files and by_kind[kind] > r.max_files:
                reason = "max_files"
            elif counted and r.max_bytes and total > r.max_bytes:
                reason = "max_bytes"
            elif r.max_age and now - mtime > r.max_age:
                reason = "max_age"
            else:
                continue  # a file of the other kind may still be over its limit
            if not self._delete(stem, name, size, reason):
                continue
            self.metrics.retention_deletions.labels(reason=reason).inc()
            count -= 1
            by_kind[kind] -= 1
            total -= size
        self.metrics.disk_bytes.set(total)
        self.metrics.disk_files.set(count)
        return StoreStats(count, total)

    def _set_disk_metrics(self, files: list[tuple[str, str, int, float]]) -> None:
        self.metrics.disk_bytes.set(sum(f[2] for f in files))
        self.metrics.disk_files.set(len(files))

    def recover(self) -> list[str]:
        """Clean up after a crash: temp files, orphan sidecars; sidecar for a folded file without one."""
        done: list[str] = []
        try:
            names = os.listdir(self.dir)
        except OSError:
            return done
        present = set(names)
        for name in sorted(names):
            path = os.path.join(self.dir, name)
            if name.startswith(".") and name.endswith(".tmp"):
                with contextlib.suppress(OSError):
                    os.unlink(path)
                    done.append(f"removed temp file {name}")
                continue
            m = SIDECAR_RE.match(name)
            if m and not (m.group("stem") + ".folded" in present or m.group("stem") + ".folded.gz" in present):
                with contextlib.suppress(OSError):
                    os.unlink(path)
                    done.append(f"removed orphan sidecar {name}")
                continue
            fm = FILE_RE.match(name)
            if fm and fm.group("stem") + ".json" not in present:
                try:
                    self._recover_sidecar(path, fm.group("stem"), name)
                    done.append(f"wrote missing sidecar for {name}")
                except OSError as e:
                    log.warning("cannot write a sidecar for %s: %s", name, e.strerror or e)
        for msg in done:
            log.warning("state directory: %s", msg)
        return done

    def _recover_sidecar(self, path: str, stem: str, name: str) -> None:
        with open(path, "rb") as fh:
            payload = fh.read()
        st = os.stat(path)
        meta = {
            "file": name,
            "format": "folded",
            "compressed": name.endswith(".gz"),
            "host": self.host,
            "recovered": True,
            **({"kind": "offcpu", "unit": KIND_UNIT["offcpu"]} if name.startswith(KIND_PREFIX["offcpu"]) else {}),
            "end": _iso(int(st.st_mtime * 1e9)),
            "bytes": len(payload),
            "sha256": hashlib.sha256(payload).hexdigest(),
            "flamed_version": __version__,
        }
        with atomic_write(os.path.join(self.dir, stem + ".json"), fsync=self.output.fsync) as out:
            out.write((json.dumps(meta, indent=2, sort_keys=True) + "\n").encode())


def _identities(p: Period) -> dict[str, dict[str, str]]:
    """pid -> cgroup labels (cgroup, service_name, container_id, pod) of the
    processes in the file, for the sidecar: JSON keys are strings."""
    pids = sorted(p.tgids() & p.identities.keys())
    return {str(pid): p.identities[pid].labels() for pid in pids}


def _iso(ns: int) -> str:
    secs, rem = divmod(ns, 1_000_000_000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(secs)) + f".{rem // 1000:06d}Z"
