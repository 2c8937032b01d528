"""Giving back the memory that compiling a BPF program used.

bcc compiles C with clang/LLVM inside the daemon's process.  Afterwards two
kinds of memory stay resident although the daemon no longer needs them:

* heap that clang and LLVM freed but glibc keeps in its arenas (tens of MB);
  ``malloc_trim(0)`` returns it to the kernel;
* the code and relocated data pages of ``libLLVM`` and ``libclang-cpp`` that
  compilation touched (about 70 MB here).  ``madvise(MADV_PAGEOUT)`` asks the
  kernel to reclaim them.  It loses nothing: clean code pages are dropped and
  read back from the library file if a later compile (a reload with a new
  program) needs them; written pages stay unless there is swap to put them in.

The daemon calls :func:`release_compiler_memory` after each compile; the
measured effect is in docs/daemon.md ("Memory").
"""

from __future__ import annotations

import ctypes
import logging
import re

log = logging.getLogger("flamed.sampling.memory")

MADV_PAGEOUT = 21  # Linux 5.4+
#: Libraries only compilation uses (bcc's symbolization and map access live in libbcc).
COMPILER_LIBS = re.compile(r"/lib(LLVM|clang)[^/]*\.so[^/]*$")


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None


def compiler_mappings(maps: str = "/proc/self/maps") -> list[tuple[int, int, str]]:
    """(start, end, path) of every mapping of a compiler library in this process."""
    out = []
    try:
        with open(maps) as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and COMPILER_LIBS.search(parts[5].strip()):
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    out.append((lo, hi, parts[5].strip()))
    except OSError:
        pass
    return out


def release_compiler_memory() -> int:
    """Trim the heap and page out compiler code; returns the bytes asked to be paged out."""
    libc = _libc()
    if libc is None:
        return 0
    try:
        libc.malloc_trim(0)
    except AttributeError:
        pass  # not glibc
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    total = 0
    for lo, hi, path in compiler_mappings():
        if madvise(lo, hi - lo, MADV_PAGEOUT) == 0:
            total += hi - lo
        else:  # EINVAL before Linux 5.4: harmless, memory just stays resident
            log.debug("madvise(MADV_PAGEOUT) on %s: errno %d", path, ctypes.get_errno())
            break
    return total
