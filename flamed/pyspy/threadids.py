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

That needs the process alive when py-spy's trace arrives, which is at the
end of a py-spy run: the threads of a process that exits before (a short
command, threads started after the last run ended) would all be lost.  So
:meth:`ThreadIds.track` maps every live thread while the process runs,
without py-spy: ``get_robust_list(tid)`` gives the address of the robust
mutex list head inside the thread's ``struct pthread`` (glibc registers one
for every thread as it starts), and on x86-64 that struct begins with its
thread control block, whose first word and third word (``tcb``, ``self``)
hold the struct's own address.  The nearest such address below the head is
the pthread id; nothing is guessed and the thread is not stopped.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform
import struct
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from flamed.model import Stack
from flamed.procstat import ptrace_advice
from flamed.pyspy.chrometrace import PyTrace
from flamed.sampling.cpython.process import nspids

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


#: get_robust_list(2) where :meth:`ThreadIds.track` knows the thread control
#: block's layout (x86-64: ``tcb`` and ``self`` at 0 and 16 point to the block).
_GET_ROBUST_LIST = {"x86_64": 274}.get(platform.machine())
_libc = ctypes.CDLL(None, use_errno=True)
#: A thread's first get_robust_list calls may come before glibc registered its
#: head (the thread is that new): it is asked again at the next track, this often.
TRACK_TRIES = 3
#: Threads remembered per process with the pthread id they had (exited ones
#: included, until a trace that covers them arrives): a process that starts
#: 20 threads a second keeps ~200 s of them.
MAX_HISTORY = 4096


@dataclass
class _Process:
    offset: int | None = None
    tids: dict[int, int] = field(default_factory=dict)  # pthread id -> OS tid (host)
    #: tid in the process's own PID namespace -> host tid ({} on the host)
    ns_tids: dict[int, int] = field(default_factory=dict)
    #: host tid -> tracks that tried it (TRACK_TRIES: mapped, or given up); live threads only
    tracked: dict[int, int] = field(default_factory=dict)
    #: host tid -> the pthread id it had, for every thread tracked (exited ones too, the
    #: oldest dropped past MAX_HISTORY): glibc gives a new thread the struct pthread (and
    #: so the pthread id) of one that exited, so one id of py-spy's names many threads in turn.
    history: dict[int, int] = field(default_factory=dict)
    #: in a PID namespace of its own? (None: not known yet; settled once, from one task:
    #: a process never changes namespace, so no other task's status is read on the host)
    in_namespace: bool | None = None


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
            if e.errno in (errno.ENOENT, errno.ESRCH):
                return f"pid {pid} exited before its threads could be mapped"
            return f"cannot read the memory of pid {pid} ({e.strerror}); {ptrace_advice(pid)}"
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

    def track(self, pid: int) -> int:
        """Map the pthread id of each thread of the live ``pid`` not mapped yet
        (module doc: get_robust_list, no py-spy needed), so that a trace that
        arrives after the process or the thread exited still finds it.  Call
        it often while py-spy records a process older than 3.11; a thread
        that starts and exits between two calls is left to :meth:`learn`.
        Returns how many threads it mapped; 0 where the method is not known
        (another architecture, a libc that registers no robust list, such as
        musl): :meth:`learn` does it then, as before."""
        if _GET_ROBUST_LIST is None:
            return 0
        proc = self._procs.setdefault(pid, _Process())
        root = self.proc_root
        try:
            tids = [int(t) for t in os.listdir(f"{root}/{pid}/task")]
        except OSError:
            return 0
        live = set(tids)
        for gone in [t for t in proc.tracked if t not in live]:
            del proc.tracked[gone]
        new = [t for t in tids if proc.tracked.get(t, 0) < TRACK_TRIES]
        if not new:
            return 0
        # In a PID namespace py-spy names the namespace's tids (3.11+): learnt while they live, too.
        self._learn_namespace(pid, proc, new)
        try:
            fd = os.open(f"{root}/{pid}/mem", os.O_RDONLY)
        except OSError:
            return 0
        mapped = 0
        try:
            for tid in new:
                proc.tracked[tid] = proc.tracked.get(tid, 0) + 1
                head = _robust_list_head(tid)
                if not head or head < SEARCH_BYTES:
                    continue
                try:
                    block = os.pread(fd, SEARCH_BYTES + 8, head - SEARCH_BYTES)
                except OSError:
                    continue
                ptid = _tcb_below(block, head - SEARCH_BYTES)
                if ptid is None:
                    continue
                proc.tids[ptid] = tid
                proc.tracked[tid] = TRACK_TRIES
                proc.history.pop(tid, None)
                proc.history[tid] = ptid
                if len(proc.history) > MAX_HISTORY:
                    del proc.history[next(iter(proc.history))]
                mapped += 1
        finally:
            os.close(fd)
        return mapped

    def pending(self, pid: int) -> bool:
        """Has ``pid`` a thread :meth:`track` found but could not map yet (too new
        to have registered its robust list), which a later track will try again?"""
        proc = self._procs.get(pid)
        return proc is not None and any(n < TRACK_TRIES for n in proc.tracked.values())

    def _nspid(self, pid: int, tid: int) -> list[int]:
        """The ``NSpid:`` ids of one task (host first); [] when it cannot be read."""
        return nspids(Path(self.proc_root) / str(pid) / "task" / str(tid) / "status")

    def _learn_namespace(self, pid: int, proc: _Process, tids: Iterable[int]) -> dict[int, int]:
        """Namespace tid -> host tid of ``pid``'s threads ({} on the host), from ``NSpid:``."""
        for tid in tids:
            if proc.in_namespace is False:
                break
            if tid in proc.ns_tids.values():
                continue
            ids = self._nspid(pid, tid)
            if not ids:  # unreadable (the thread exited): nothing settled
                continue
            proc.in_namespace = len(ids) > 1
            if proc.in_namespace:
                proc.ns_tids[ids[-1]] = tid
        return proc.ns_tids

    def namespaced(self, pid: int) -> bool:
        """Is ``pid`` in a PID namespace of its own (py-spy then reports that namespace's tids)?"""
        proc = self._procs.setdefault(pid, _Process())
        try:
            tids = [int(t) for t in os.listdir(f"{self.proc_root}/{pid}/task")]
        except OSError:
            return bool(proc.ns_tids)
        # The first task read tells whether the process is namespaced; then all are mapped.
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
        proc = self._procs.get(pid, _Process())
        # 3.11+ in a PID namespace: py-spy names the namespace's OS tids.
        ns = proc.ns_tids
        for key in set(trace.threads) - trace.pthread_ids:
            if ns and key in ns:
                mapping[key] = ns[key]
        # The other threads that had one of these pthread ids (one after another: a
        # thread per request) get the same changes; each has samples only while it
        # lived, when the id's stack was its own.
        earlier: dict[int, list[int]] = {}
        for tid, ptid in proc.history.items():
            if ptid in mapping and ptid in trace.pthread_ids and mapping[ptid] != tid:
                earlier.setdefault(ptid, []).append(tid)
        threads: dict[int, list[tuple[int, Stack]]] = {}
        names: dict[int, str] = {}
        for key, changes in trace.threads.items():
            if key in trace.pthread_ids:
                if key not in mapping:
                    trace.unmapped += 1
                    continue
                for tid in earlier.get(key, ()):
                    threads[tid] = changes
                    if key in trace.thread_names:
                        names[tid] = trace.thread_names[key]
            threads[mapping.get(key, key)] = changes
        names.update({mapping.get(k, k): v for k, v in trace.thread_names.items()
                      if k not in trace.pthread_ids or k in mapping})
        trace.thread_names = names
        trace.threads = threads
        trace.pthread_ids = set()
        return why

    #: Reasons kept for processes forgotten already (``flamed record``'s summary names them).
    MAX_REASONS = 256

    def forget(self, pid: int) -> None:
        self._procs.pop(pid, None)
        # The reason stays for the summary, the oldest going once there are MAX_REASONS.
        while len(self.reasons) > self.MAX_REASONS:
            del self.reasons[next(iter(self.reasons))]


def _robust_list_head(tid: int) -> int:
    """get_robust_list(tid): the address of the thread's robust list head, 0 if none or unreadable."""
    head = ctypes.c_void_p()
    size = ctypes.c_size_t()
    if _libc.syscall(_GET_ROBUST_LIST, ctypes.c_long(tid), ctypes.byref(head), ctypes.byref(size)) != 0:
        return 0
    return int(head.value or 0)


def _tcb_below(block: bytes, base: int) -> int | None:
    """The highest address ``a`` in ``block`` (read at ``base``) whose words at
    ``a`` and ``a + 16`` both hold ``a``: an x86-64 thread control block,
    the start of glibc's ``struct pthread``."""
    words = struct.unpack(f"<{len(block) // 8}Q", block[:len(block) // 8 * 8])
    for i in range(len(words) - 3, -1, -1):
        a = base + 8 * i
        if words[i] == a and words[i + 2] == a:
            return a
    return None


def _fits(blocks: dict[int, bytes], k: int, tids: set[int]) -> bool:
    # The kernel zeroes the tid of a thread that exited (CLONE_CHILD_CLEARTID):
    # 0 fits any slot and maps nothing.
    vals = [v for v in (struct.unpack_from("<i", b, k)[0] for b in blocks.values()) if v != 0]
    return bool(vals) and all(v in tids for v in vals) and len(set(vals)) == len(vals)
