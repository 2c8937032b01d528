"""pthread ids to OS thread ids, per process, by reading the target's memory.

Before CPython 3.11 an interpreter thread state holds only ``pthread_self()``,
so py-spy's ``thread (0x...)`` frames name pthread ids while the BPF samples
carry OS tids; without a map the join finds no thread and every sample of the
process loses its Python frames.  On glibc (x86-64 and the others that use
the thread pointer as ``pthread_t``) a pthread id is the address of the
thread's ``struct pthread``, which holds its OS tid at a fixed offset.  The
offset is not hard-coded: it is found per process as the one 4-byte slot at
which every known pthread id's struct holds a distinct tid of that process
(``/proc/PID/task``), or 0 for a thread that has exited, and kept for the process's later threads.  A process
whose memory cannot be read, or where no slot fits, is reported with the
reason; its samples keep native and kernel frames.
"""

from __future__ import annotations

import logging
import os
import struct
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from flamed.model import Stack
from flamed.pyspy.chrometrace import PyTrace

log = logging.getLogger(__name__)

#: Bytes of each struct pthread searched for the tid (glibc 2.36 has it at 720).
SEARCH_BYTES = 2048


def pid_max(proc_root: str = "/proc") -> int:
    """The largest pid the kernel hands out: larger thread ids are pthread ids."""
    try:
        with open(f"{proc_root}/sys/kernel/pid_max") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 1 << 22  # the kernel's limit


@dataclass
class _Process:
    offset: int | None = None
    tids: dict[int, int] = field(default_factory=dict)  # pthread id -> OS tid (host)
    #: tid in the process's own PID namespace -> host tid ({} on the host)
    ns_tids: dict[int, int] = field(default_factory=dict)


class ThreadIds:
    """Per-process maps from pthread id to OS tid (see the module doc).

    ``resolve`` is called when a py-spy trace arrives; ``learn`` may be called
    any time the process runs, so that threads still alive are mapped before
    the process exits (its memory is gone then).  ``counters`` counts threads
    ``mapped`` and ``unmapped``; ``reasons`` the last reason per pid.
    """

    def __init__(self, proc_root: str = "/proc") -> None:
        self.proc_root = proc_root
        self._procs: dict[int, _Process] = {}
        self.counters: Counter[str] = Counter()
        self.reasons: dict[int, str] = {}
        # Offsets that fitted in earlier processes: with few threads several
        # slots may fit, and the one that fitted before wins.
        self._votes: Counter[int] = Counter()

    def learn(self, pid: int, ptids: Iterable[int]) -> str | None:
        """Map ``ptids`` of the live ``pid``; the reason when some could not be mapped."""
        proc = self._procs.setdefault(pid, _Process())
        want = sorted(set(ptids) - set(proc.tids))
        if not want:
            return None
        try:
            tids = {int(t) for t in os.listdir(f"{self.proc_root}/{pid}/task")}
        except OSError as e:
            return f"cannot list the threads of pid {pid} ({e.strerror}): it has exited"
        # In a PID namespace, struct pthread holds the namespace's tid.
        ns = self._learn_namespace(pid, proc, tids)
        if ns:
            tids = set(ns)
        blocks: dict[int, bytes] = {}
        err: str | None = None
        try:
            fd = os.open(f"{self.proc_root}/{pid}/mem", os.O_RDONLY)
        except OSError as e:
            return f"cannot read the memory of pid {pid} ({e.strerror}); run as root or grant CAP_SYS_PTRACE"
        try:
            for p in want:
                try:
                    b = os.pread(fd, SEARCH_BYTES, p)
                except OSError as e:
                    err = f"cannot read pid {pid}'s memory at {p:#x} ({e.strerror})"
                    continue
                if len(b) == SEARCH_BYTES:
                    blocks[p] = b
        finally:
            os.close(fd)
        if not blocks:
            return err or f"no thread struct readable in pid {pid}"
        offset = proc.offset
        if offset is None or not _fits(blocks, offset, tids):
            cands = [k for k in range(0, SEARCH_BYTES - 3, 4) if _fits(blocks, k, tids)]
            if not cands:
                return (f"no slot of pid {pid}'s thread structs holds its thread ids "
                        "(not glibc's pthread layout?)")
            offset = max(cands, key=lambda k: (self._votes[k], -k))
            if proc.offset is None:
                self._votes[offset] += 1
            proc.offset = offset
        for p, b in blocks.items():
            tid = struct.unpack_from("<i", b, offset)[0]
            if tid:
                proc.tids[p] = ns.get(tid, tid) if ns else tid
        missing = len(want) - sum(1 for p in want if p in proc.tids)
        return f"{missing} thread(s) of pid {pid} had exited before they could be mapped" if missing else None

    def _learn_namespace(self, pid: int, proc: _Process, tids: Iterable[int]) -> dict[int, int]:
        """Namespace tid -> host tid of ``pid``'s threads ({} on the host), from ``NSpid:``."""
        for tid in tids:
            if tid in proc.ns_tids.values():
                continue
            try:
                with open(f"{self.proc_root}/{pid}/task/{tid}/status", encoding="ascii", errors="replace") as f:
                    ids = next((line.split()[1:] for line in f if line.startswith("NSpid:")), [])
            except OSError:
                continue
            if len(ids) > 1:
                proc.ns_tids[int(ids[-1])] = tid
        return proc.ns_tids

    def namespaced(self, pid: int) -> bool:
        """Is ``pid`` in a PID namespace of its own (py-spy then reports that namespace's tids)?"""
        proc = self._procs.setdefault(pid, _Process())
        try:
            tids = [int(t) for t in os.listdir(f"{self.proc_root}/{pid}/task")]
        except OSError:
            return bool(proc.ns_tids)
        # One task tells whether the process is namespaced; then all are mapped.
        if not proc.ns_tids and not self._learn_namespace(pid, proc, tids[:1]):
            return False
        return bool(self._learn_namespace(pid, proc, tids))

    def resolve(self, pid: int, ptids: Iterable[int]) -> tuple[dict[int, int], str | None]:
        """The OS tid of each of ``ptids`` that can be mapped (memory read now if the process lives)."""
        ptids = set(ptids)
        why = self.learn(pid, ptids)
        known = self._procs.get(pid, _Process()).tids
        out = {p: known[p] for p in ptids if p in known}
        self.counters["mapped"] += len(out)
        self.counters["unmapped"] += len(ptids) - len(out)
        if len(out) < len(ptids):
            why = why or f"{len(ptids) - len(out)} thread(s) of pid {pid} unmapped"
            if self.reasons.get(pid) is None:
                log.warning("pid %d: %s; the samples of those threads keep native and kernel frames only",
                            pid, why)
            self.reasons[pid] = why
        return out, (why if len(out) < len(ptids) else None)

    def rekey(self, pid: int, trace: PyTrace) -> str | None:
        """Key ``trace`` by host OS tid, in place: pthread ids (interpreters
        before 3.11) mapped through memory, a PID namespace's tids (3.11+ in a
        container) through ``NSpid:``.

        Threads left unmapped are dropped from it (counted in its
        ``unmapped``); returns why some were, None when all were mapped.
        """
        mapping, why = self.resolve(pid, trace.pthread_ids) if trace.pthread_ids else ({}, None)
        # 3.11+ in a PID namespace: py-spy names the namespace's OS tids.
        ns = self._procs.get(pid, _Process()).ns_tids
        for key in set(trace.threads) - trace.pthread_ids:
            if ns and key in ns:
                mapping[key] = ns[key]
        threads: dict[int, list[tuple[int, Stack]]] = {}
        for key, changes in trace.threads.items():
            if key in trace.pthread_ids:
                if key not in mapping:
                    trace.unmapped += 1
                    continue
            threads[mapping.get(key, key)] = changes
        trace.thread_names = {mapping.get(k, k): v for k, v in trace.thread_names.items()
                              if k not in trace.pthread_ids or k in mapping}
        trace.threads = threads
        trace.pthread_ids = set()
        return why

    def forget(self, pid: int) -> None:
        self._procs.pop(pid, None)
        self.reasons.pop(pid, None)


def _fits(blocks: dict[int, bytes], k: int, tids: set[int]) -> bool:
    # The kernel zeroes the tid of a thread that exited (CLONE_CHILD_CLEARTID):
    # 0 fits any slot and maps nothing.
    vals = [v for v in (struct.unpack_from("<i", b, k)[0] for b in blocks.values()) if v != 0]
    return bool(vals) and all(v in tids for v in vals) and len(set(vals)) == len(vals)
