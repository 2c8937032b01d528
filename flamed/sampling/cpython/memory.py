"""Reading another process's memory with process_vm_readv(2), batched.

One syscall reads many (address, size) pieces; the kernel stops at the first
piece it cannot read, so the pieces after it are retried one by one and each
piece comes back whole or as None.  Needs the right to ptrace the process
(root, or CAP_SYS_PTRACE).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence

#: Pieces per syscall (the kernel's UIO_MAXIOV is 1024).
MAX_IOV = 1024
#: No single piece is larger than this (bounded reads).
MAX_PIECE = 1 << 20


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_readv = _libc.process_vm_readv
_readv.argtypes = [
    ctypes.c_int,
    ctypes.POINTER(_Iovec),
    ctypes.c_ulong,
    ctypes.POINTER(_Iovec),
    ctypes.c_ulong,
    ctypes.c_ulong,
]
_readv.restype = ctypes.c_ssize_t


class ProcessMemory:
    """Reads of one process's memory; ``syscalls`` and ``errors`` count what happened."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.syscalls = 0
        #: errno of the last failed read (ESRCH: the process is gone)
        self.last_errno = 0

    def read(self, addr: int, size: int) -> bytes | None:
        return self.read_many([(addr, size)])[0]

    def read_many(self, pieces: Sequence[tuple[int, int]]) -> list[bytes | None]:
        out: list[bytes | None] = [None] * len(pieces)
        todo = [i for i, (addr, size) in enumerate(pieces) if 0 < size <= MAX_PIECE and addr > 0]
        while todo:
            batch = todo[:MAX_IOV]
            done = self._read_batch(pieces, batch, out)
            # Everything up to the piece that failed is settled; that piece
            # failed alone, the rest is retried in the next batch.
            todo = todo[done + 1 :] if done < len(batch) else todo[len(batch) :]
        return out

    def _read_batch(
        self, pieces: Sequence[tuple[int, int]], batch: list[int], out: list[bytes | None]
    ) -> int:
        """Read ``batch``; returns how many leading pieces were read whole."""
        sizes = [pieces[i][1] for i in batch]
        buf = ctypes.create_string_buffer(sum(sizes))
        local = (_Iovec * len(batch))()
        remote = (_Iovec * len(batch))()
        base = ctypes.addressof(buf)
        pos = 0
        for k, i in enumerate(batch):
            addr, size = pieces[i]
            local[k].iov_base = base + pos
            local[k].iov_len = size
            remote[k].iov_base = addr
            remote[k].iov_len = size
            pos += size
        self.syscalls += 1
        got = _readv(self.pid, local, len(batch), remote, len(batch), 0)
        if got < 0:
            self.last_errno = ctypes.get_errno()
            got = 0
        raw = buf.raw
        pos = 0
        for k, i in enumerate(batch):
            size = sizes[k]
            if pos + size > got:
                if self.last_errno == 0 and got >= 0:
                    self.last_errno = 14  # EFAULT: a short read
                return k
            out[i] = raw[pos : pos + size]
            pos += size
        return len(batch)

    def alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
