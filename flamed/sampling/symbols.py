"""Address to frame-name translation for the BPF sampler, with caches.

Kernel addresses are resolved once per address (kallsyms through bcc) and get
the ``_[k]`` suffix.  User addresses are resolved through one bcc symbol cache
per *process identity*: the pid plus what ``/proc/PID/stat`` says about the
process image (start time, field 22, so pid reuse never attaches another
process's symbols; start of code and of the stack, fields 26 and 28, which
exec changes -- ASLR randomizes both -- so a re-exec'd process gets fresh
symbols).  On top of bcc's cache each process keeps its own address -> frame
dictionary: a profile repeats the same few thousand addresses across hundreds
of thousands of stacks, and a dictionary hit is ~50x cheaper than a call into
bcc.  Below that, one cache shared by all processes is keyed by what the code
*is* -- the mapped file's device, inode and the file offset of the address,
from ``/proc/PID/maps`` -- so the tenth process running the same interpreter
costs neither bcc calls nor bcc loading its ELF symbol tables again; bcc's
per-process cache is only created for a process when that shared cache misses.

An address without a symbol becomes ``[unknown] (module)`` when the module is
known (``[unknown] (libc.so.6)``), else ``[unknown]``.  The first kind is
cached with the process like a symbol.  The second is mostly garbage from a
frame-pointer walk through code built without frame pointers (a Python
interpreter yields a new one in nearly every sample), so it is recognised
without asking bcc: the address lies in no executable mapping of
``/proc/PID/maps`` (re-read at most once per drain, when such an address
shows up, so a library mapped meanwhile is found).  The frame chain broke
there, and every address beyond it (towards the root) is as meaningless, so
the stack is cut: its root becomes a single ``[unknown]`` frame.  That keeps
one broken walk from spreading into dozens of made-up frames and distinct
stacks.  Unnamed addresses inside anonymous executable mappings (JIT code)
are cached for ``unknown_ttl`` drains only.

A process that lives and dies between two drains leaves no /proc/PID/maps
to read at the drain.  :meth:`Symbolizer.prepare` (any thread) and
:meth:`Symbolizer.prime` (the drain's thread or lock) record a process's
identity and mappings when the BPF program first samples it; at the drain its
files are then opened by their recorded path, if that is still the same
device and inode.

bcc is imported lazily; constructing a :class:`Symbolizer` needs it, importing
this module does not.
"""

from __future__ import annotations

import bisect
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from flamed.model import KERNEL_SUFFIX, sanitize_frame
from flamed.procstat import EXITED, read_stat
from flamed.sampling.mappedfile import DELETED, mapped_file
from flamed.sampling.plt import plt_symbols

log = logging.getLogger("flamed.sampling.symbols")

UNKNOWN = "[unknown]"
#: In a process's address cache: "no executable mapping holds this address",
#: valid for the rest of the drain (the maps are read at most once per drain).
#: A ``;`` cannot be in a real frame (sanitize_frame replaces it).
_CUT = ";cut;"


@dataclass(frozen=True, slots=True)
class ProcessIdentity:
    """What tells one process image from another under the same pid."""

    pid: int
    start_time: int  # /proc/PID/stat field 22, clock ticks after boot
    start_code: int  # field 26: changes on exec
    start_stack: int  # field 28: changes on exec (ASLR)


def read_identity(pid: int, proc: Path = Path("/proc")) -> ProcessIdentity | None:
    """The identity of ``pid`` now, or ``None`` when it has exited."""
    rest = read_stat(proc / str(pid) / "stat")
    if not rest or rest[0] in EXITED:
        # A zombie has exited: its memory (and with it start_code and
        # start_stack, now 0) is gone.  Read as an identity, it looked like a
        # new image, and the samples still to be named lost their symbols.
        return None
    try:
        # rest[0] is field 3, so field N is rest[N - 3].
        return ProcessIdentity(pid, int(rest[19]), int(rest[23]), int(rest[25]))
    except (IndexError, ValueError):
        return None


def read_maps(pid: int, proc: Path = Path("/proc")) -> list[_Mapping]:
    """The executable mappings of ``pid``, sorted by address ([] when gone)."""
    try:
        text = (proc / str(pid) / "maps").read_text(errors="surrogateescape")
    except OSError:
        return []
    ranges: list[_Mapping] = []
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 5 or "x" not in parts[1]:
            continue
        lo, _, hi = parts[0].partition("-")
        try:
            ranges.append(_Mapping(int(lo, 16), int(hi, 16), parts[5].strip() if len(parts) > 5 else "",
                                   int(parts[2], 16), parts[3], int(parts[4])))
        except ValueError:
            continue
    ranges.sort()
    return ranges


def _kallsyms_hidden(proc: Path) -> bool:
    """True when /proc/kallsyms shows every address as zero to this process.

    That is kernel.kptr_restrict >= 1 without CAP_SYSLOG (or 2): kernel
    frames cannot be named, and bcc's lookups in an all-zero table cost
    seconds per drain (found by tests/faults/test_security_caps.py), so the
    caller shows ``[unknown]_[k]`` and says which capability is missing.
    """
    try:
        with open(proc / "kallsyms", "rb") as f:
            head = [f.readline() for _ in range(64)]
    except OSError:
        return False
    addrs = [ln.split(b" ", 1)[0] for ln in head if ln]
    if not addrs or any(a.strip(b"0") for a in addrs):
        return False
    try:
        restrict = (proc / "sys" / "kernel" / "kptr_restrict").read_text().strip()
    except OSError:
        restrict = "?"
    log.warning("kernel frames will show as [unknown]_[k]: /proc/kallsyms hides kernel addresses "
                "(kernel.kptr_restrict=%s) from a process without CAP_SYSLOG; grant CAP_SYSLOG "
                "(the systemd unit does) or set kernel.kptr_restrict=0", restrict)
    return True


class Resolver(Protocol):
    """One address space: bcc's SymbolCache, or a fake in tests."""

    def resolve(self, addr: int) -> tuple[bytes | None, bytes | None]:
        """(symbol name, module path); either may be ``None``."""

    def refresh(self) -> None:
        """Re-read the process's mappings (a library was loaded since)."""

    def close(self) -> None: ...


class BccResolver:
    """A bcc symbol cache for one pid (``-1``: the kernel)."""

    def __init__(self, pid: int) -> None:
        from bcc.libbcc import lib

        self._lib: Any = lib
        self._pid = pid
        # bcc prints "Opening /proc/PID/root failed" on fd 2 for a process that
        # has exited (its root is gone while it is a zombie, too) and returns a
        # cache that knows nothing: refuse here, quietly, instead.
        _require_root_link(pid)
        # bcc reads /proc/PID/maps here; the ELF symbol tables load lazily.
        self._cache: Any = lib.bcc_symcache_new(pid, None)
        from bcc.libbcc import bcc_symbol

        self._sym_type: Any = bcc_symbol

    def resolve(self, addr: int) -> tuple[bytes | None, bytes | None]:
        import ctypes as ct

        lib = self._lib
        # A fresh struct per call: a failed lookup must not report the module
        # of the previous one.
        sym = self._sym_type()
        if self._pid < 0:
            res = lib.bcc_symcache_resolve_no_demangle(self._cache, addr, ct.byref(sym))
            name = sym.name if res >= 0 else None
        else:
            res = lib.bcc_symcache_resolve(self._cache, addr, ct.byref(sym))
            if res >= 0:
                name = sym.demangle_name
                lib.bcc_symbol_free_demangle_name(ct.byref(sym))
            else:
                name = None
        module = ct.cast(sym.module, ct.c_char_p).value if sym.module else None
        return name, module

    def refresh(self) -> None:
        try:
            _require_root_link(self._pid)
        except OSError:
            return  # exited: what the cache knows is all there will be
        self._lib.bcc_symcache_refresh(self._cache)

    def close(self) -> None:
        if self._cache:
            self._lib.bcc_free_symcache(self._cache, self._pid)
            self._cache = None


class ProcResolver:
    """What no mapped file names in one process: the symbols of its perf map
    (``/tmp/perf-PID.map``, written by JIT compilers: V8, the JVM's agents,
    CPython 3.12's ``-X perf``) and of the kernel's vDSO; for anything else,
    the module that maps the address.  Everything file-backed is named before
    this is asked (:class:`ElfSymbols`).

    flamed's own, not bcc's per-process symbol cache: bcc before 0.33 closes
    a stray file descriptor each time it builds or refreshes one (its
    ``ModulePath`` for the global perf map path never sets the fd it closes:
    iovisor/bcc#5193), and in a process that holds BPF maps, perf events and
    sockets that closed one of them at random (the unwinder's process map, in
    CI).  The perf map is found where bcc looks: inside the process's root
    under its namespace pid first, then on the host under its host pid.
    """

    def __init__(self, pid: int, proc: Path = Path("/proc")) -> None:
        _require_root_link(pid)
        self._pid = pid
        self._proc = proc
        self._maps: list[tuple[int, int, str]] = []  # (start, end, path), sorted
        self._starts: list[int] = []
        self._perf_path: str | None = None
        self._perf_sig: tuple[int, int] | None = None
        self._perf_starts: list[int] = []
        self._perf: list[tuple[int, int, bytes]] = []  # (start, end, name), sorted by start
        self.refresh()

    def refresh(self) -> None:
        base = self._proc / str(self._pid)
        try:
            text = (base / "maps").read_text(errors="surrogateescape")
        except OSError:
            text = ""  # exited: what is known is all there will be
        maps: list[tuple[int, int, str]] = []
        for line in text.splitlines():
            parts = line.split(None, 5)
            if len(parts) < 5 or "x" not in parts[1]:
                continue
            lo, _, hi = parts[0].partition("-")
            maps.append((int(lo, 16), int(hi, 16), parts[5] if len(parts) > 5 else ""))
        if maps or not self._maps:
            self._maps = sorted(maps)
            self._starts = [m[0] for m in self._maps]
        self._read_perf_map()

    def _perf_map_paths(self) -> list[str]:
        base = self._proc / str(self._pid)
        out = []
        try:
            for line in (base / "status").read_text().splitlines():
                if line.startswith("NSpid:"):
                    nspid = line.split()[-1]
                    out.append(f"{base}/root/tmp/perf-{nspid}.map")
                    break
        except OSError:
            pass
        out.append(f"/tmp/perf-{self._pid}.map")
        return out

    def _read_perf_map(self) -> None:
        for path in ([self._perf_path] if self._perf_path else self._perf_map_paths()):
            try:
                st = os.stat(path)
            except OSError:
                continue
            sig = (st.st_size, st.st_mtime_ns)
            if path == self._perf_path and sig == self._perf_sig:
                return
            try:
                with open(path, "rb") as f:
                    data = f.read(64 << 20)
            except OSError:
                continue
            by_start: dict[int, tuple[int, bytes]] = {}
            for line in data.splitlines():
                fields = line.split(None, 2)
                if len(fields) < 3:
                    continue
                try:
                    start, size = int(fields[0], 16), int(fields[1], 16)
                except ValueError:
                    continue
                by_start[start] = (start + size, fields[2].strip())  # a later line wins (code reused)
            self._perf = [(a, b, n) for a, (b, n) in sorted(by_start.items())]
            self._perf_starts = [e[0] for e in self._perf]
            self._perf_path, self._perf_sig = path, sig
            return

    def resolve(self, addr: int) -> tuple[bytes | None, bytes | None]:
        i = bisect.bisect_right(self._perf_starts, addr) - 1
        if i >= 0 and addr < self._perf[i][1]:
            assert self._perf_path is not None
            return self._perf[i][2], self._perf_path.encode("utf-8", "surrogateescape")
        i = bisect.bisect_right(self._starts, addr) - 1
        if i < 0 or addr >= self._maps[i][1]:
            return None, None
        start, _end, path = self._maps[i]
        module = path.encode("utf-8", "surrogateescape") if path else None
        if path == "[vdso]":
            vdso = host_vdso()
            if vdso is not None:
                name = vdso.lookup(addr - start)
                if name:
                    return name, module
        return None, module

    def close(self) -> None:
        self._perf = []
        self._perf_starts = []


def default_resolver(pid: int) -> Resolver:
    """The kernel's symbols read by flamed from /proc/kallsyms (bcc's need euid 0)
    for ``-1``; :class:`ProcResolver` for a process."""
    if pid < 0:
        from flamed.sampling.kallsyms import Kallsyms  # noqa: PLC0415

        return Kallsyms()
    return ProcResolver(pid)


_VDSO: list[ElfSymbols | None] = []


def host_vdso() -> ElfSymbols | None:
    """The symbols of the kernel's vDSO (one image for every process of this
    kernel), read once from this process's own copy; ``None`` if unreadable."""
    if _VDSO:
        return _VDSO[0]
    elf: ElfSymbols | None = None
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            if line.endswith("[vdso]"):
                lo, _, hi = line.split()[0].partition("-")
                with open("/proc/self/mem", "rb") as mem:
                    mem.seek(int(lo, 16))
                    image = mem.read(int(hi, 16) - int(lo, 16))
                fd = os.memfd_create("flamed-vdso", os.MFD_CLOEXEC)
                try:
                    os.write(fd, image)
                    elf = ElfSymbols(f"/proc/self/fd/{fd}")
                finally:
                    os.close(fd)
                break
    except Exception as e:  # noqa: BLE001 -- bcc and ctypes raise plain errors; [unknown] (vdso) then
        log.debug("no vDSO symbols: %s", e)
        elf = None
    _VDSO.append(elf)
    return elf


def _require_root_link(pid: int) -> None:
    """Raise OSError unless ``/proc/PID/root`` resolves (the process has not exited)."""
    if pid >= 0:
        os.stat(f"/proc/{pid}/root")


def _frame(name: bytes | None, module: bytes | None) -> str:
    if name:
        return sanitize_frame(name.decode("utf-8", "surrogateescape"))
    if module:
        base = os.path.basename(module.decode("utf-8", "surrogateescape"))
        return sanitize_frame(f"{UNKNOWN} ({base})")
    return UNKNOWN


class _Mapping(NamedTuple):
    start: int
    end: int
    path: str  # "" for anonymous memory (JIT code)
    offset: int  # file offset of ``start``
    dev: str
    inode: int


@dataclass
class _ProcessSymbols:
    identity: ProcessIdentity | None
    resolver: Resolver | None = None
    resolver_tried: bool = False
    known: dict[int, str] = field(default_factory=dict)
    #: Addresses outside any module, kept for ``unknown_ttl`` drains.
    unknown: dict[int, str] = field(default_factory=dict)
    #: Executable mappings: sorted starts, and (start, end, path) alike.
    starts: list[int] = field(default_factory=list)
    ranges: list[_Mapping] = field(default_factory=list)
    maps_drain: int = -1  # the drain in which /proc/PID/maps was last read
    seen_drain: int = 0  # the last drain that symbolized one of its samples
    #: Addresses cached as _CUT in ``known`` during this drain.
    cut: list[int] = field(default_factory=list)
    refresh_drain: int = -1  # the drain in which the resolver was last refreshed

    def set_ranges(self, ranges: list[_Mapping]) -> None:
        self.ranges = ranges
        self.starts = [r[0] for r in ranges]

    def holding(self, addr: int) -> _Mapping | None:
        """The executable mapping read so far that holds ``addr``, if any."""
        i = bisect.bisect_right(self.starts, addr) - 1
        return self.ranges[i] if i >= 0 and addr < self.ranges[i].end else None


# ---------------------------------------------------------------------------
# Function symbols of one ELF file, shared by every process that maps it


_STT_FUNC, _STT_GNU_IFUNC = 2, 10
_demangler: Any = None


def demangle(name: bytes) -> bytes:
    """C++ (Itanium ABI) names through libstdc++'s __cxa_demangle; others as is."""
    global _demangler
    if not name.startswith(b"_Z"):
        return name
    import ctypes as ct

    if _demangler is None:
        try:
            fn = ct.CDLL("libstdc++.so.6").__cxa_demangle
            fn.restype = ct.c_void_p
            fn.argtypes = [ct.c_char_p, ct.c_void_p, ct.c_void_p, ct.POINTER(ct.c_int)]
            free = ct.CDLL(None).free
            free.argtypes = [ct.c_void_p]
            _demangler = (fn, free)
        except (OSError, AttributeError):
            _demangler = False
    if not _demangler:
        return name
    fn, free = _demangler
    status = ct.c_int(0)
    out = fn(name, None, None, ct.byref(status))
    if not out:
        return name
    try:
        return ct.string_at(out)
    finally:
        free(out)


def _alias_rank(name: bytes) -> tuple[bool, int, int, bytes]:
    """Among symbols at one address prefer the plain name (``read`` over
    ``__GI___libc_read``): fewest leading underscores, then shortest.  A PLT
    stub's name first: an executable's import whose address is taken has its
    stub's address as its value (``acosh`` at ``acosh@plt``), and the time
    there is the stub's."""
    return (not name.endswith(b"@plt"), len(name) - len(name.lstrip(b"_")), len(name), name)


class ElfSymbols:
    """The function symbols of one ELF file (with its debug file when bcc
    finds one), looked up by *file offset*, so one table serves every process
    mapping the file wherever ASLR put it.  Read with bcc's ELF reader, once."""

    def __init__(self, path: str) -> None:
        import ctypes as ct

        from bcc.libbcc import bcc_symbol_option, lib

        # Collected as they come and sorted once: the callback runs for every
        # symbol (70,000 in libLLVM), so it does no more than an append.
        raw: list[tuple[int, int, bytes]] = []
        add = raw.append

        def on_sym(name: bytes | None, start: int, size: int, _payload: Any) -> int:
            if name and start:
                add((start, size, name))
            return 0

        segs: list[tuple[int, int, int]] = []

        def on_seg(vaddr: int, memsz: int, offset: int, _payload: Any) -> int:
            segs.append((offset, offset + memsz, vaddr))
            return 0

        sym_cb = ct.CFUNCTYPE(ct.c_int, ct.c_char_p, ct.c_uint64, ct.c_uint64, ct.c_void_p)(on_sym)
        seg_cb = ct.CFUNCTYPE(ct.c_int, ct.c_uint64, ct.c_uint64, ct.c_uint64, ct.c_void_p)(on_seg)
        opt = bcc_symbol_option(use_debug_file=1, check_debug_file_crc=1, lazy_symbolize=0,
                                use_symbol_type=(1 << _STT_FUNC) | (1 << _STT_GNU_IFUNC))
        bpath = path.encode("utf-8", "surrogateescape")
        lib.bcc_elf_foreach_sym.argtypes = [ct.c_char_p, ct.c_void_p, ct.c_void_p, ct.c_void_p]
        lib.bcc_elf_foreach_sym.restype = ct.c_int
        lib.bcc_elf_foreach_load_section.argtypes = [ct.c_char_p, ct.c_void_p, ct.c_void_p]
        lib.bcc_elf_foreach_load_section.restype = ct.c_int
        if lib.bcc_elf_foreach_load_section(bpath, ct.cast(seg_cb, ct.c_void_p), None) < 0 or not segs:
            raise OSError(f"{path}: not an ELF file with executable segments")
        lib.bcc_elf_foreach_sym(bpath, ct.cast(sym_cb, ct.c_void_p), ct.byref(opt), None)
        self.segments = sorted(segs)
        # The PLT stubs, in no symbol table (flamed/sampling/plt.py).
        exact: dict[int, bytes] = {}

        def name_at(addr: int) -> bytes | None:
            if not exact:
                for start, _size, name in raw:
                    if start not in exact or _alias_rank(name) < _alias_rank(exact[start]):
                        exact[start] = name
            return exact.get(addr)

        raw.extend(plt_symbols(path, name_at))
        # One entry per address: the largest size of its symbols (sorted by
        # size, the last one), the plainest of their names (_alias_rank).
        raw.sort()
        starts: list[int] = []
        sizes: list[int] = []
        names: list[bytes] = []
        last = -1
        for start, size, name in raw:
            if start != last:
                starts.append(start)
                sizes.append(size)
                names.append(name)
                last = start
            else:
                sizes[-1] = size
                if _alias_rank(name) < _alias_rank(names[-1]):
                    names[-1] = name
        del raw
        # A symbol without a size runs to the next one.
        nexts = starts[1:] + [starts[-1] + 1] if starts else []
        self.starts = starts
        self.ends = [a + size if size else nxt for a, size, nxt in zip(starts, sizes, nexts)]
        self.names = names

    def __len__(self) -> int:
        return len(self.starts)

    def lookup(self, file_offset: int) -> bytes | None:
        for lo, hi, vaddr in self.segments:
            if lo <= file_offset < hi:
                v = file_offset - lo + vaddr
                break
        else:
            return None
        i = bisect.bisect_right(self.starts, v) - 1
        if i >= 0 and v < self.ends[i]:
            return self.names[i]
        return None


@dataclass
class SymbolStats:
    processes: int = 0
    addresses_cached: int = 0
    resolver_calls: int = 0
    invalidations: int = 0  # processes whose image changed (exec, pid reuse)
    refreshes: int = 0  # resolvers re-read after a library was loaded
    elf_files: int = 0  # symbol tables read (each shared by all processes mapping the file)
    primed: int = 0  # process images whose maps were read when first sampled (prime())


class Symbolizer:
    """Kernel and per-process user symbols with caches (see the module docstring).

    ``resolver_factory(pid)`` makes a :class:`Resolver` (``-1`` for the kernel);
    the default is bcc's.  ``proc`` is the /proc to read identities from.
    Call :meth:`begin_drain` once per drain before resolving: it is when
    identities are re-read (once per pid per drain) and when the cache of
    addresses outside any module expires (every ``unknown_ttl`` drains, or
    beyond ``unknown_max`` entries).
    """

    def __init__(
        self,
        resolver_factory: Any = None,
        proc: Path = Path("/proc"),
        unknown_ttl: int = 6,
        unknown_max: int = 1_000_000,
        elf_loader: Any = None,
    ) -> None:
        self._factory = resolver_factory or default_resolver
        self._elf_loader = elf_loader or ElfSymbols
        #: (device, inode) -> the file's symbols.
        self._elves: dict[tuple[str, int], ElfSymbols] = {}
        #: (device, inode, pid): the file could not be opened through that
        #: process this drain.  Another process (or the next drain) tries
        #: again: one process's view (a chroot, an exited process) must not
        #: leave a file every other process maps unnamed.
        self._elf_unreachable: set[tuple[str, int, int]] = set()
        self._proc = proc
        self._unknown_ttl = unknown_ttl
        self._unknown_max = unknown_max
        self._drains = 0
        self._kernel: Resolver | None = None
        self._kernel_known: dict[int, str] = {}
        self._procs: dict[int, _ProcessSymbols] = {}
        self._checked: set[int] = set()
        self._unknown_count = 0
        #: (device, inode, file offset) -> frame, shared by all processes.
        self._module_known: dict[tuple[str, int, int], str] = {}
        self._module_max = 4_000_000
        self._forget: set[int] = set()
        self._kernel_blind: bool | None = None  # /proc/kallsyms hides its addresses from us
        self.stats = SymbolStats()

    # -- lifecycle -------------------------------------------------------
    def begin_drain(self) -> None:
        self._checked.clear()
        self._elf_unreachable.clear()
        self._drains += 1
        for p in self._procs.values():
            if p.cut:
                for a in p.cut:
                    p.known.pop(a, None)
                p.cut.clear()
        if self._drains % self._unknown_ttl == 0 or self._unknown_count > self._unknown_max:
            for p in self._procs.values():
                p.unknown.clear()
            self._unknown_count = 0

    def end_drain(self) -> None:
        """Drop the processes :meth:`forget` was called for, now that the
        drain that may still hold their samples is done; and the caches of
        processes that exited (or exec'd) and were not sampled for two
        drains, whether or not anyone called :meth:`forget` (otherwise every
        short-lived process ever sampled kept its cache: found by
        tests/faults/test_mixed_faults.py's churn test)."""
        for pid in self._forget:
            self._drop(pid)
        self._forget.clear()
        for pid, p in list(self._procs.items()):
            if self._drains - p.seen_drain >= 2:
                now = read_identity(pid, self._proc)
                if now is None or now != p.identity:
                    self._drop(pid)
        if len(self._module_known) > self._module_max:
            self._module_known.clear()
        if len(self._elves) > 1024:
            self._elves.clear()
        self.stats.processes = len(self._procs)
        self.stats.addresses_cached = (
            len(self._kernel_known) + len(self._module_known) + sum(len(p.known) for p in self._procs.values())
        )

    def forget(self, pid: int) -> None:
        """The process exited or exec'd: drop its cache after the next drain."""
        self._forget.add(pid)

    def forget_now(self, pid: int) -> None:
        self._drop(pid)

    def close(self) -> None:
        for pid in list(self._procs):
            self._drop(pid)
        if self._kernel is not None:
            self._kernel.close()
            self._kernel = None
        self._kernel_known.clear()

    def _drop(self, pid: int) -> None:
        p = self._procs.pop(pid, None)
        if p is not None and p.resolver is not None:
            p.resolver.close()

    # -- kernel ----------------------------------------------------------
    def kernel(self, addr: int) -> str:
        f = self._kernel_known.get(addr)
        if f is not None:
            return f
        if self._kernel_blind is None:
            self._kernel_blind = _kallsyms_hidden(self._proc)
        if self._kernel_blind:
            # bcc would scan a table of zero addresses for every frame (seconds per drain).
            f = self._kernel_known[addr] = UNKNOWN + KERNEL_SUFFIX
            return f
        if self._kernel is None:
            self._kernel = self._factory(-1)
        assert self._kernel is not None
        self.stats.resolver_calls += 1
        name, _module = self._kernel.resolve(addr)
        f = (sanitize_frame(name.decode("utf-8", "surrogateescape")) if name else UNKNOWN) + KERNEL_SUFFIX
        self._kernel_known[addr] = f
        return f

    def kernel_stack(self, addrs_leaf_first: Sequence[int]) -> tuple[str, ...]:
        """Root-first frames for kernel addresses given leaf first."""
        try:
            # The common case, every address seen before, at C speed.
            return tuple(map(self._kernel_known.__getitem__, reversed(addrs_leaf_first)))
        except KeyError:
            return tuple(self.kernel(a) for a in reversed(addrs_leaf_first))

    # -- user ------------------------------------------------------------
    def _process(self, pid: int) -> _ProcessSymbols:
        p = self._procs.get(pid)
        if pid in self._checked and p is not None:
            return p
        self._checked.add(pid)
        if p is not None:
            p.seen_drain = self._drains
        ident = read_identity(pid, self._proc)
        if p is not None:
            if ident is None or ident == p.identity:
                # Gone: the last image seen under this pid is the best guess
                # (a new process under the same pid would have an identity).
                return p
            self.stats.invalidations += 1
            log.debug("pid %d changed image (%s -> %s): new symbol cache", pid, p.identity, ident)
            self._drop(pid)
        p = _ProcessSymbols(ident, seen_drain=self._drains)
        self._procs[pid] = p
        return p

    def _resolver(self, p: _ProcessSymbols, pid: int) -> Resolver | None:
        """bcc's cache for the process, made on first need (it reads the maps
        and, lazily, each module's symbols: worth avoiding when the shared
        cache answers)."""
        if not p.resolver_tried:
            p.resolver_tried = True
            if p.identity is not None:
                try:
                    p.resolver = self._factory(pid)
                except Exception as e:  # noqa: BLE001 -- bcc raises plain Exception
                    log.debug("no symbol cache for pid %d: %s", pid, e)
        return p.resolver

    def user_stack(self, pid: int, addrs_leaf_first: Sequence[int]) -> tuple[str, ...]:
        """Root-first frames for user addresses of ``pid`` given leaf first."""
        p = self._process(pid)
        known = p.known
        try:
            t = tuple(map(known.__getitem__, reversed(addrs_leaf_first)))
        except KeyError:
            pass
        else:
            if _CUT not in t:
                return t
            # The chain broke at the leaf-most address outside every mapping.
            return (UNKNOWN, *t[len(t) - t[::-1].index(_CUT):])
        out: list[str] = []
        for a in addrs_leaf_first:
            f = known.get(a)
            if f is None:
                f = self._resolve_user(p, pid, a)
                if f is None:
                    known[a] = _CUT
                    p.cut.append(a)
            if f is None or f is _CUT:
                out.append(UNKNOWN)
                break
            out.append(f)
        out.reverse()
        return tuple(out)

    def _read_maps(self, p: _ProcessSymbols, pid: int) -> None:
        p.maps_drain = self._drains
        ranges = read_maps(pid, self._proc)
        if ranges or not p.ranges:
            # An exited process keeps the mappings last seen.
            p.set_ranges(ranges)

    # -- priming: short-lived processes ------------------------------------
    def prepare(self, pid: int) -> tuple[ProcessIdentity, list[_Mapping]] | None:
        """What :meth:`prime` needs, read now from /proc (``None``: gone).

        Touches no state of the symbolizer, so it may run in another thread
        than the drain; :meth:`prime` must not."""
        ident = read_identity(pid, self._proc)
        if ident is None:
            return None
        ranges = read_maps(pid, self._proc)
        if not ranges or read_identity(pid, self._proc) != ident:
            return None  # exited (or exec'd) while being read
        return ident, ranges

    def prime(self, pid: int, prepared: tuple[ProcessIdentity, list[_Mapping]]) -> None:
        """Remember a process image's mappings before its samples are drained.

        A process that exits before the next drain takes /proc/PID/maps with
        it; with its mappings kept here its samples are still symbolized
        (from the mapped files, found through the host's file system when
        /proc/PID/root is gone and the file there is still the same inode)."""
        ident, ranges = prepared
        p = self._procs.get(pid)
        if p is not None:
            if p.identity == ident:
                # Read again later: the dynamic loader maps the libraries
                # after exec, so the first read may hold only the executable.
                if ranges != p.ranges:
                    p.set_ranges(ranges)
                    p.unknown.clear()  # addresses outside the old mappings may be in the new ones
                return
            self.stats.invalidations += 1
            self._drop(pid)
        p = _ProcessSymbols(ident, seen_drain=self._drains)
        p.set_ranges(ranges)
        self._procs[pid] = p
        self.stats.primed += 1

    def primed(self, pid: int) -> bool:
        """Are mappings of ``pid`` kept (read when first sampled, or at a drain)?"""
        return pid in self._procs

    def maps_lack(self, pid: int, addr: int) -> bool:
        """Was ``pid`` primed, and does no executable mapping read for it so
        far hold ``addr`` (a library it loaded since)?"""
        p = self._procs.get(pid)
        return p is not None and p.holding(addr) is None

    def _mapping(self, p: _ProcessSymbols, pid: int, addr: int) -> _Mapping | None:
        """The executable mapping holding ``addr``, if any."""
        m = p.holding(addr)
        if m is None and p.maps_drain != self._drains:
            self._read_maps(p, pid)
            m = p.holding(addr)
        return m

    def _from_elf(self, m: _Mapping, pid: int, file_offset: int) -> str | None:
        """The frame from the mapped file's own symbol table; ``None`` when the
        file cannot be read here (then bcc's per-process cache decides)."""
        key = (m.dev, m.inode)
        elf = self._elves.get(key)
        if elf is None:
            if (m.dev, m.inode, pid) in self._elf_unreachable:
                return None
            path = mapped_file(pid, m.path, m.inode, m.start, m.end, dev=m.dev, proc=self._proc)
            loaded = self._load_elf(path) if path else None
            if loaded is None:
                # Not cached for the file: the failure may be this process's
                # (its view, or its exit mid-read), not the file's.
                self._elf_unreachable.add((m.dev, m.inode, pid))
                return None
            elf = self._elves[key] = loaded
        name = elf.lookup(file_offset)
        if name:
            return sanitize_frame(demangle(name).decode("utf-8", "surrogateescape"))
        return _frame(None, m.path.removesuffix(DELETED).encode("utf-8", "surrogateescape"))

    def _load_elf(self, path: str) -> ElfSymbols | None:
        try:
            elf = self._elf_loader(path)
        except Exception as e:  # noqa: BLE001 -- bcc and ctypes raise plain errors
            log.debug("no ELF symbols from %s: %s", path, e)
            return None
        self.stats.elf_files += 1
        return elf

    def _resolve_user(self, p: _ProcessSymbols, pid: int, addr: int) -> str | None:
        """The frame for ``addr``; ``None`` when no executable mapping holds it."""
        f = p.unknown.get(addr)
        if f is not None:
            return f
        m = self._mapping(p, pid, addr)
        if m is None:
            return None
        mkey = (m.dev, m.inode, addr - m.start + m.offset) if m.inode else None
        if mkey is not None:
            f = self._module_known.get(mkey)
            if f is not None:
                p.known[addr] = f
                return f
        if mkey is not None:
            f = self._from_elf(m, pid, mkey[2])
            if f is not None:
                p.known[addr] = f
                self._module_known[mkey] = f
                return f
        f = UNKNOWN
        resolver = self._resolver(p, pid)
        if resolver is not None:
            self.stats.resolver_calls += 1
            name, module = resolver.resolve(addr)
            if not name and not module and m.path and p.refresh_drain != self._drains:
                # A file-backed mapping bcc does not know: loaded (dlopen)
                # after bcc read the maps.  Once per drain at most.
                p.refresh_drain = self._drains
                self.stats.refreshes += 1
                resolver.refresh()
                self.stats.resolver_calls += 1
                name, module = resolver.resolve(addr)
            f = _frame(name, module)
            if name or module:
                p.known[addr] = f
                if mkey is not None and name:
                    # Shared only when named: "[unknown] (module)" may be this
                    # process's view of the file failing, not the file.
                    self._module_known[mkey] = f
                return f
        p.unknown[addr] = f
        self._unknown_count += 1
        return f
