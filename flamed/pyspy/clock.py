"""Loads ``bpf/pyspy_clock.bpf.c``: kernel timestamps of py-spy's recorder calls.

One :class:`PySpyClock` serves every py-spy child of a daemon or a ``flamed
record``: the uprobe is attached to the py-spy binary (not to a pid), and
:class:`flamed.pyspy.mixed.MixedMode` starts no py-spy before it is attached,
so it sees each child's very first ``Chrometrace::increment``: every sample
time, and the upper bound of the clock fit in
:func:`flamed.pyspy.clockfit.fit_clock` (which does not rely on it).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import select
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any

from flamed.sampling.bpfimage import load_bpf
from flamed.sampling.bpfload import BPF_DIR_ENV, adopt, bpf_dirs, close_bpf, find_bpf_source
from flamed.errors import CapabilityError

log = logging.getLogger(__name__)

#: py-spy's recorder; Rust mangling adds a hash that changes per build.
INCREMENT_SYMBOL = r".*[Cc]hrometrace.*[Rr]ecorder.*increment.*"

#: The program, found like the sampler's (flamed.sampling.bpfload): checkout or installed copy.
BPF_SOURCE_NAME = "pyspy_clock.bpf.c"


class _Hit(ctypes.Structure):
    _fields_ = [("ktime_ns", ctypes.c_uint64), ("tgid", ctypes.c_uint32), ("kind", ctypes.c_uint32)]


HIT_INCREMENT = 1
HIT_VM_READV = 2


def bpf_source() -> str:
    path = find_bpf_source(BPF_SOURCE_NAME)
    try:
        return path.read_text()
    except OSError as e:
        raise CapabilityError(
            f"cannot read {path}: {e.strerror}; set {BPF_DIR_ENV} to the directory holding {BPF_SOURCE_NAME} "
            f"(searched: {', '.join(str(d) for d in bpf_dirs())})") from None


def find_increment_symbol(pyspy: str) -> tuple[str, int]:
    """(symbol, address) of py-spy's chrometrace ``increment``; CapabilityError if absent."""
    from bcc import BPF  # noqa: PLC0415 - bcc only where BPF is used

    try:
        found = BPF.get_user_functions_and_addresses(pyspy.encode(), INCREMENT_SYMBOL.encode())
    except Exception as e:  # bcc raises bare Exception for unreadable ELF files
        raise CapabilityError(f"cannot read symbols of {pyspy}: {e}") from None
    if not found:
        raise CapabilityError(
            f"{pyspy} has no chrometrace recorder symbol (stripped build?); "
            "install py-spy from PyPI, whose binary keeps its symbols")
    name, addr = sorted(found)[0]
    return (name.decode() if isinstance(name, bytes) else str(name)), int(addr)


class PySpyClock:
    """Collects the uprobe hits of every py-spy process, by tgid.

    ``hits(tgid)`` returns (and keeps) the sorted hit times of one process;
    ``forget(tgid)`` frees them.  A background thread polls the ring buffer.
    """

    def __init__(self, pyspy: str, *, vm_readv: bool = True, cache_dir: Path | None = None,
                 isolated: bool = False) -> None:
        self.pyspy = os.path.realpath(pyspy)
        self.vm_readv = vm_readv
        #: Compiled-program cache and compile isolation (flamed.sampling.bpfimage.load_bpf).
        self.cache_dir = cache_dir
        self.isolated = isolated
        self._reads: dict[int, list[int]] = defaultdict(list)
        self._bpf: Any = None
        self._hits: dict[int, list[int]] = defaultdict(list)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # libbpf's ring buffer must not be consumed from two threads at once.
        self._poll_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._wake_fd = -1  # eventfd: close() wakes the poll thread with it
        self.symbol = ""

    def start(self) -> None:
        try:
            import bcc  # noqa: F401, PLC0415
        except ImportError:
            raise CapabilityError("bcc is not importable (Debian python3-bpfcc)") from None
        name, addr = find_increment_symbol(self.pyspy)
        self.symbol = name
        try:
            cflags = ["-DTRACE_VM_READV"] if self.vm_readv else []
            self._bpf = adopt(load_bpf(bpf_source(), cflags, cache_dir=self.cache_dir, isolated=self.isolated)[0])
            self._bpf.attach_uprobe(name=self.pyspy.encode(), addr=addr, fn_name=b"on_increment")
        except Exception as e:
            self.close()
            raise CapabilityError(f"cannot load the py-spy clock uprobe: {e}") from None
        self._bpf[b"pyspy_hits"].open_ring_buffer(self._on_hit)
        self._wake_fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._thread = threading.Thread(target=self._poll, name="pyspy-clock", daemon=True)
        self._thread.start()
        log.info("py-spy clock: uprobe on %s in %s", re.sub(r"17h[0-9a-f]+E$", "", name), self.pyspy)

    def _on_hit(self, ctx: Any, data: Any, size: int) -> None:
        h = ctypes.cast(data, ctypes.POINTER(_Hit)).contents
        with self._lock:
            if h.kind == HIT_VM_READV:
                self._reads[int(h.tgid)].append(int(h.ktime_ns))
            else:
                self._hits[int(h.tgid)].append(int(h.ktime_ns))

    def _poll(self) -> None:
        # A ring buffer map's fd is readable when records are in it: wait on
        # it and on close()'s eventfd without a timeout, so no py-spy means
        # no wakeups.
        ep = select.epoll()
        try:
            ep.register(self._bpf[b"pyspy_hits"].map_fd, select.EPOLLIN)
            ep.register(self._wake_fd, select.EPOLLIN)
            while not self._stop.is_set():
                ep.poll()
                if self._stop.is_set():
                    return
                try:
                    with self._poll_lock:
                        self._bpf.ring_buffer_consume()
                except Exception:  # noqa: BLE001 - closing races the poll; nothing to report
                    if self._stop.is_set():
                        return
                    raise
        finally:
            ep.close()

    def drain(self) -> None:
        """Consume whatever is in the ring buffer now (before reading hits)."""
        if self._bpf is not None:
            with self._poll_lock:
                self._bpf.ring_buffer_consume()

    def hits(self, tgid: int) -> list[int]:
        with self._lock:
            out = list(self._hits.get(tgid, ()))
        out.sort()
        return out

    def has_hits(self, tgid: int) -> bool:
        """Has this py-spy process recorded a sample yet?"""
        with self._lock:
            return bool(self._hits.get(tgid))

    def reads(self, tgid: int) -> list[int]:
        """Times of the py-spy process's process_vm_readv calls (with ``vm_readv``)."""
        with self._lock:
            out = list(self._reads.get(tgid, ()))
        out.sort()
        return out

    def track(self, tgid: int) -> None:
        """Report this py-spy process's stack reads (call right after spawning it)."""
        if self._bpf is not None and self.vm_readv:
            table = self._bpf[b"pyspy_pids"]
            try:
                table[ctypes.c_uint32(tgid)] = ctypes.c_uint64(0)
            except Exception:  # noqa: BLE001 - bcc raises plain Exception (E2BIG: the map is full)
                # Only completed runs are forgotten; py-spy runs that failed (target exited,
                # crash, timeout) stay in the map until it is full -- found by the churn test
                # of tests/faults, where every later spawn then raised.  A dead process makes
                # no more syscalls, so dropping its entry loses nothing.
                for k in list(table.keys()):
                    if not os.path.exists(f"/proc/{int(k.value)}"):
                        with contextlib.suppress(KeyError):
                            del table[k]
                try:
                    table[ctypes.c_uint32(tgid)] = ctypes.c_uint64(0)
                except Exception as e:  # noqa: BLE001
                    log.warning("py-spy clock: cannot track py-spy %d (%s); its reads are not timed", tgid, e)

    def forget(self, tgid: int) -> None:
        with self._lock:
            self._hits.pop(tgid, None)
            self._reads.pop(tgid, None)
        if self._bpf is not None and self.vm_readv:
            try:
                del self._bpf[b"pyspy_pids"][ctypes.c_uint32(tgid)]
            except KeyError:
                pass

    def stats(self) -> dict[str, int]:
        if self._bpf is None:
            return {"submitted": 0, "dropped": 0}
        t = self._bpf[b"pyspy_clock_stats"]
        return {"submitted": int(t[ctypes.c_int(0)].value), "dropped": int(t[ctypes.c_int(1)].value)}

    def close(self) -> None:
        self._stop.set()
        if self._wake_fd >= 0:
            with contextlib.suppress(OSError):
                os.eventfd_write(self._wake_fd, 1)
        alive = False
        if self._thread is not None:
            self._thread.join(timeout=2)
            alive = self._thread.is_alive()
            if alive:
                log.warning("the py-spy clock thread did not stop within 2 s")
            self._thread = None
        if self._wake_fd >= 0 and not alive:  # a thread still waiting keeps its fd
            os.close(self._wake_fd)
            self._wake_fd = -1
        if self._bpf is not None:
            try:
                close_bpf(self._bpf)  # detaches the uprobe without tracefs, and bcc's exit hook with it
            finally:
                self._bpf = None

    def __enter__(self) -> PySpyClock:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
