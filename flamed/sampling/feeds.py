"""The handlers the process manager hands each new process to: they describe
it to the program's walkers, so that its stacks are walked in BPF.

* :class:`PythonFeed`: CPython processes to bpf/python.bpf.c (their
  ``flamed_pyproc`` in the ``pyprocs`` map), and the code objects of the
  stacks it reports new, named while the process runs.
* :class:`UnwindFeed`: every process to the native unwinder
  (bpf/unwind.bpf.c), whose tables flamed.sampling.unwind.tables keeps.
"""

from __future__ import annotations

import ctypes as ct
import logging
import os
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from flamed.sampling import pysource
from flamed.sampling.processes import Process, ProcessHandler, ProcessManager, ProcessTable, Slot
from flamed.sampling.program import KernelProgram
from flamed.sampling.pyframes import PythonFrames, parse_pystack
from flamed.sampling.symbols import ProcessIdentity, read_identity
from flamed.sampling.unwind.tables import TableCache, Unwinder

log = logging.getLogger("flamed.bpf")

#: struct flamed_py_new of bpf/python.bpf.c: tgid, generation, stack id.
_PY_NEW = struct.Struct("<IIQ")


@dataclass
class _PyProc:
    """What the feed keeps of one process."""

    #: Its flamed_pyproc is in the program's pyprocs map.
    described: bool = False
    #: The image that description is of: the process's identity read just
    #: before the probe (an exec during the probe leaves the old one here).
    image: ProcessIdentity | None = None
    #: Found exited at the last drain: forgotten at the next one.
    gone: bool = False


class PythonFeed(ProcessHandler):
    """CPython processes, described to the program when first sampled."""

    #: Longest wait between two probes of a process that is not ready yet.
    PY_RETRY_MAX_S = 0.5

    def __init__(self, manager: ProcessManager, frames: PythonFrames) -> None:
        self.frames = frames
        self._m = manager
        self._slot: Slot[_PyProc] = Slot(_PyProc)
        self._new: list[tuple[int, int, int]] = []  # (tgid, gen, stack id) reported new, from the perf buffer
        self._retry: deque[tuple[float, int, float]] = deque()  # (due, tgid, delay) of probes to repeat
        self._retry_lock = threading.Lock()

    def open(self, program: KernelProgram) -> None:
        program.bpf["py_new"].open_perf_buffer(self._on_new, page_cnt=program.options.prime_pages,
                                               lost_cb=lambda _n: None)

    def attach(self, tgid: int) -> None:
        if self.described(tgid):
            m = self._m
            with m.lock:
                st = self._slot.get(m.table.get(tgid))
                image = st.image if st is not None else None
            if image is not None and read_identity(tgid) == image:
                # Described already, as the image it runs now: the walker's
                # claim (python_claim) probed it before the priming thread
                # read its report.  Taking the description out to probe again
                # would leave every sample and wait meanwhile without Python
                # frames.
                return
            # A new image of a process described before (it exec'd): until the
            # new one is probed, the old description would walk the new
            # memory at the old addresses.
            with m.lock:
                if m.program.bpf is not None and not m.closed:
                    m.program.map_del("pyprocs", tgid, ct.c_uint32)
                self._undescribe(tgid)
        self._describe(tgid, 0.002)

    def due(self) -> float | None:
        return self._retry[0][0] if self._retry else None

    def work(self) -> None:
        self._warm_new()
        self._retry_due()

    def described(self, tgid: int) -> bool:
        """Is ``tgid``'s flamed_pyproc in the program's map?"""
        st = self._slot.get(self._m.table.get(tgid))
        return st is not None and st.described

    def gone_pending(self) -> frozenset[int]:
        """Processes found exited at the last drain, forgotten at the next."""
        with self._m.lock:
            return frozenset(p.tgid for p in self._m.table if (st := self._slot.get(p)) is not None and st.gone)

    def _tidy(self, proc: Process) -> None:
        st = self._slot.get(proc)
        if st is not None and not (st.described or st.gone):
            self._slot.clear(proc)
        self._m.table.release(proc)

    def _describe(self, tgid: int, delay: float) -> None:
        """Probe ``tgid``; install its flamed_pyproc, or probe again later."""
        image = read_identity(tgid)
        res = self.frames.describe(tgid)
        if res is True:
            # Gently growing: the interpreter of a new process is ready
            # within milliseconds, an embedded one maybe much later.
            with self._retry_lock:
                self._retry.append((time.monotonic() + delay, tgid, min(delay * 1.25, self.PY_RETRY_MAX_S)))
            self._m.wake()
            return
        m = self._m
        with m.lock:
            if m.program.bpf is None or m.closed:
                return
            t = m.program.bpf["pyprocs"]
            if isinstance(res, bytes):
                leaf = t.Leaf()
                if len(res) != ct.sizeof(leaf):
                    log.warning("flamed_pyproc of %d bytes, the program's is %d: not installed", len(res),
                                ct.sizeof(leaf))
                    return
                ct.memmove(ct.byref(leaf), res, len(res))
                t[ct.c_uint32(tgid)] = leaf
                st = self._slot.of(m.table.ensure(tgid))
                st.described = True
                st.image = image
            elif self.described(tgid):
                m.program.map_del("pyprocs", tgid, ct.c_uint32)
                self._undescribe(tgid)
        if isinstance(res, bytes):
            self._seed_threads(tgid)

    def _seed_threads(self, tgid: int) -> None:
        """Put the process's thread states in the program's tid cache: the
        program searches a thread list FLAMED_PY_MAX_THREADS entries per
        sample, so without this the old threads of a big pool (at the end of
        the list) would miss their first samples' Python frames."""
        states = self.frames.thread_states(tgid)  # user-space reads: outside the lock
        if not states:
            return
        m = self._m
        with m.lock:
            if m.program.bpf is None or m.closed:
                return
            t = m.program.bpf["py_tstates"]
            for tid, ts in states.items():
                t[ct.c_uint32(tid)] = ct.c_uint64(ts)

    def _undescribe(self, tgid: int) -> None:
        proc = self._m.table.get(tgid)
        st = self._slot.get(proc)
        if proc is not None and st is not None:
            st.described = False
            st.image = None
            self._tidy(proc)

    def _retry_due(self) -> None:
        now = time.monotonic()
        with self._retry_lock:
            due = [r for r in self._retry if r[0] <= now]
            self._retry = deque(sorted(r for r in self._retry if r[0] > now))
        for _due, tgid, delay in due:
            self._describe(tgid, delay)

    def claim(self, tgid: int) -> tuple[bool | None, str]:
        """Does the program read ``tgid``'s Python frames itself?  ``(True,
        "walked")``; ``(False, reason)`` (then py-spy may); ``(None, "")``: not
        ready yet, ask again.  Probes the process now if it has not been."""
        return pysource.walker_claim(self.frames, tgid, self.described, lambda t: self._describe(t, 0.002))

    def _on_new(self, _cpu: int, data: Any, size: int) -> None:
        if size >= _PY_NEW.size:
            self._new.append(_PY_NEW.unpack(ct.string_at(data, _PY_NEW.size)))

    def _warm_new(self) -> None:
        """Name the code objects of the stacks the program reported new."""
        new, self._new = self._new, []
        program = self._m.program
        b = program.bpf
        if not new or b is None:
            return
        key = ct.c_uint64(0)
        for tgid, gen, sid in dict.fromkeys(new):
            if self._m.stopping.is_set():
                break
            token = self.frames.warm_token(gen)
            try:
                t = b[f"pystacks{gen & 1}"]
                key.value = sid
                leaf = t.Leaf()
                if program.lib.bpf_lookup_elem(t.map_fd, ct.byref(key), ct.byref(leaf)) != 0:
                    continue  # drained meanwhile: the drain names it
            except Exception:  # noqa: BLE001 -- closing
                return
            frames, _flags, guards = parse_pystack(bytes(leaf), program.options.python_depth)
            if guards is None:
                self.frames.warm(tgid, frames, gen=gen, sid=sid, token=token)
            else:
                self.frames.warm(tgid, frames, gen=gen, sid=sid, token=token, guards=guards)

    def settle(self, table: ProcessTable) -> None:
        procs = list(table)
        states = {p.tgid: st for p in procs if (st := self._slot.get(p)) is not None}
        if not any(p.exited for p in procs) and not any(st.described for st in states.values()):
            return
        # Exited processes are forgotten one drain after they are found
        # gone: the generation that began at this drain's flip may still
        # hold their last samples, named from the cache.
        gone = {p.tgid for p in procs if p.exited} | {t for t, st in states.items() if st.gone}
        found = set(self.frames.gone()) - gone
        for st in states.values():
            st.gone = False
        for tgid in found:
            self._slot.of(table.ensure(tgid)).gone = True
        for pid in gone:
            self.frames.forget(pid)
            st = states.get(pid)
            if st is not None and st.described:
                self._m.program.map_del("pyprocs", pid, ct.c_uint32)
                st.described = False
                st.image = None
            proc = table.get(pid)
            if proc is not None:
                self._tidy(proc)


class UnwindFeed(ProcessHandler):
    """Every process, described to the native unwinder (``options.unwind``)."""

    def __init__(self, manager: ProcessManager) -> None:
        self.unwinder: Unwinder | None = None
        self._m = manager

    def open(self, program: KernelProgram) -> None:
        o = program.options
        self.unwinder = Unwinder(program.bpf, program.lib, rows_capacity=o.unwind_rows, max_maps=o.unwind_maps,
                                 max_procs=o.unwind_max_procs, cache=TableCache(o.unwind_cache_dir),
                                 skip=frozenset({os.getpid()}), on_described=self._m.remap)
        self.unwinder.start()
        program.bpf["uw_miss"].open_perf_buffer(self._on_miss, page_cnt=o.prime_pages, lost_cb=lambda _n: None)

    def _on_miss(self, _cpu: int, data: Any, size: int) -> None:
        # A stack met an address without a table: read the maps again, and
        # load the binary of that address.
        if size >= 16 and self.unwinder is not None:
            tgid, _pad, addr = struct.unpack("<IIQ", ct.string_at(data, 16))
            self.unwinder.submit(tgid, addr)
            self._m.remap(tgid, (addr,))

    def attach(self, tgid: int) -> None:
        if self.unwinder is not None:
            self.unwinder.submit(tgid)

    def refresh(self, tgid: int) -> None:
        self.attach(tgid)  # libraries mapped since the first read

    def ready(self, tgid: int) -> bool:
        """Has ``tgid`` been described (its stacks are unwound from tables)?"""
        return self.unwinder is not None and self.unwinder.described(tgid)

    def settle(self, table: ProcessTable) -> None:
        if self.unwinder is not None:
            for p in table:
                if p.exited:
                    self.unwinder.forget(p.tgid)

    def close(self) -> None:
        if self.unwinder is not None:
            self.unwinder.stop()
