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
measured effect is in docs/daemon.md ("Memory").  :func:`memory_by_part`
says where the process's memory is now (``flamed status``, the metrics).
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import threading
import time

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


#: mallopt's M_ARENA_MAX.
_M_ARENA_MAX = -8
_last_trim = [0.0]


def limit_arenas(n: int = 2) -> bool:
    """At most ``n`` glibc malloc arenas.  glibc gives each new thread an
    arena of its own (up to 8 per core); memory freed in one is reused by that
    arena only, so a daemon whose threads each hold a few MB at their peak
    keeps all those peaks resident.  Call before the threads start."""
    libc = _libc()
    try:
        return bool(libc is not None and libc.mallopt(_M_ARENA_MAX, n) == 1)
    except AttributeError:
        return False  # not glibc


def trim_heap(every_s: float = 5.0) -> bool:
    """``malloc_trim(0)`` (free pages in every arena back to the kernel), at
    most once per ``every_s`` seconds: after a drain, whose transient objects
    are freed by then.  A trim takes well under a millisecond with the daemon's
    two arenas; once a minute left a drain's freed memory resident until the
    next one whenever drains came less than a minute apart."""
    now = time.monotonic()
    if now - _last_trim[0] < every_s:
        return False
    _last_trim[0] = now
    libc = _libc()
    try:
        return bool(libc is not None and libc.malloc_trim(0))
    except AttributeError:
        return False


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


def memory_by_part(pid: str = "self") -> dict[str, int]:
    """Bytes resident by kind, from /proc/PID/smaps, and the BPF maps' locked
    kernel memory, from the fdinfo of the process's map descriptors:

    ``rss`` (all), ``anon`` (heap, Python objects, caches, bcc's buffers),
    ``compiler`` (libLLVM and libclang pages still resident), ``files`` (the
    other file-backed pages: Python, libraries, libbcc) and ``bpf_maps``
    (kernel memory of the maps this process holds; not part of ``rss``).
    Empty when /proc cannot be read."""
    out = {"rss": 0, "anon": 0, "compiler": 0, "files": 0, "bpf_maps": 0}
    try:
        with open(f"/proc/{pid}/smaps") as f:
            path = ""
            for line in f:
                head = line.split(None, 1)[0]
                if "-" in head and not head.endswith(":"):
                    parts = line.split(None, 5)
                    path = parts[5].strip() if len(parts) == 6 else ""
                elif head == "Rss:":
                    kb = int(line.split()[1]) * 1024
                    out["rss"] += kb
                    if not path.startswith("/"):
                        out["anon"] += kb
                    elif COMPILER_LIBS.search(path):
                        out["compiler"] += kb
                    else:
                        out["files"] += kb
    except (OSError, ValueError, IndexError):
        return {}
    fd_dir = f"/proc/{pid}/fdinfo"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        fds = []
    for fd in fds:
        try:
            with open(f"{fd_dir}/{fd}") as f:
                info = f.read()
        except OSError:
            continue
        if "map_type:" not in info:
            continue
        for line in info.splitlines():
            if line.startswith("memlock:"):
                out["bpf_maps"] += int(line.split()[1])
    return out


_cache: tuple[float, dict[str, int]] = (0.0, {})
_cache_lock = threading.Lock()


def memory_by_part_cached(max_age_s: float = 1.0) -> dict[str, int]:
    """:func:`memory_by_part` of this process, read at most once per
    ``max_age_s`` (a few ms each: status and scrapes may come often)."""
    global _cache
    with _cache_lock:
        at, parts = _cache
        now = time.monotonic()
        if not parts or now - at > max_age_s:
            parts = memory_by_part()
            _cache = (now, parts)
        return dict(parts)
