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
bcc.

An address without a symbol becomes ``[unknown] (module)`` when the module is
known (``[unknown] (libc.so.6)``), else ``[unknown]``.  Unknown results are not
cached across drains: a library mapped later may resolve them.

bcc is imported lazily; constructing a :class:`Symbolizer` needs it, importing
this module does not.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from flamed.model import KERNEL_SUFFIX, sanitize_frame

log = logging.getLogger("flamed.symbols")

UNKNOWN = "[unknown]"


@dataclass(frozen=True, slots=True)
class ProcessIdentity:
    """What tells one process image from another under the same pid."""

    pid: int
    start_time: int  # /proc/PID/stat field 22, clock ticks after boot
    start_code: int  # field 26: changes on exec
    start_stack: int  # field 28: changes on exec (ASLR)


def read_identity(pid: int, proc: Path = Path("/proc")) -> ProcessIdentity | None:
    """The identity of ``pid`` now, or ``None`` when it has exited."""
    try:
        raw = (proc / str(pid) / "stat").read_bytes()
    except OSError:
        return None
    # comm (field 2) may hold spaces and parentheses: split after the last ')'.
    end = raw.rfind(b")")
    if end < 0:
        return None
    rest = raw[end + 2 :].split()
    try:
        # rest[0] is field 3, so field N is rest[N - 3].
        return ProcessIdentity(pid, int(rest[19]), int(rest[23]), int(rest[25]))
    except (IndexError, ValueError):
        return None


class Resolver(Protocol):
    """One address space: bcc's SymbolCache, or a fake in tests."""

    def resolve(self, addr: int) -> tuple[bytes | None, bytes | None]:
        """(symbol name, module path); either may be ``None``."""

    def close(self) -> None: ...


class BccResolver:
    """A bcc symbol cache for one pid (``-1``: the kernel)."""

    def __init__(self, pid: int) -> None:
        from bcc.libbcc import lib  # type: ignore[import-not-found]

        self._lib: Any = lib
        self._pid = pid
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

    def close(self) -> None:
        if self._cache:
            self._lib.bcc_free_symcache(self._cache, self._pid)
            self._cache = None


def _frame(name: bytes | None, module: bytes | None) -> str:
    if name:
        return sanitize_frame(name.decode("utf-8", "surrogateescape"))
    if module:
        base = os.path.basename(module.decode("utf-8", "surrogateescape"))
        return sanitize_frame(f"{UNKNOWN} ({base})")
    return UNKNOWN


@dataclass
class _ProcessSymbols:
    identity: ProcessIdentity | None
    resolver: Resolver | None
    known: dict[int, str] = field(default_factory=dict)


@dataclass
class SymbolStats:
    processes: int = 0
    addresses_cached: int = 0
    resolver_calls: int = 0
    invalidations: int = 0


class Symbolizer:
    """Kernel and per-process user symbols with caches (see the module docstring).

    ``resolver_factory(pid)`` makes a :class:`Resolver` (``-1`` for the kernel);
    the default is bcc's.  ``proc`` is the /proc to read identities from.
    Call :meth:`begin_drain` once per drain before resolving: it is when
    identities are re-read (once per pid per drain) and when the per-drain
    caches of unknown addresses are dropped.
    """

    def __init__(
        self,
        resolver_factory: Any = None,
        proc: Path = Path("/proc"),
    ) -> None:
        self._factory = resolver_factory or BccResolver
        self._proc = proc
        self._kernel: Resolver | None = None
        self._kernel_known: dict[int, str] = {}
        self._procs: dict[int, _ProcessSymbols] = {}
        self._checked: set[int] = set()
        self._unknown: dict[tuple[int, int], str] = {}
        self._forget: set[int] = set()
        self.stats = SymbolStats()

    # -- lifecycle -------------------------------------------------------
    def begin_drain(self) -> None:
        self._checked.clear()
        self._unknown.clear()

    def end_drain(self) -> None:
        """Drop the processes :meth:`forget` was called for, now that the
        drain that may still hold their samples is done."""
        for pid in self._forget:
            self._drop(pid)
        self._forget.clear()
        self.stats.processes = len(self._procs)
        self.stats.addresses_cached = len(self._kernel_known) + sum(len(p.known) for p in self._procs.values())

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
        if self._kernel is None:
            self._kernel = self._factory(-1)
        assert self._kernel is not None
        self.stats.resolver_calls += 1
        name, _module = self._kernel.resolve(addr)
        f = (sanitize_frame(name.decode("utf-8", "surrogateescape")) if name else UNKNOWN) + KERNEL_SUFFIX
        self._kernel_known[addr] = f
        return f

    def kernel_stack(self, addrs_leaf_first: list[int]) -> tuple[str, ...]:
        """Root-first frames for kernel addresses given leaf first."""
        known = self._kernel_known
        out: list[str] = []
        for a in reversed(addrs_leaf_first):
            f = known.get(a)
            out.append(f if f is not None else self.kernel(a))
        return tuple(out)

    # -- user ------------------------------------------------------------
    def _process(self, pid: int) -> _ProcessSymbols:
        p = self._procs.get(pid)
        if pid in self._checked and p is not None:
            return p
        self._checked.add(pid)
        ident = read_identity(pid, self._proc)
        if p is not None:
            if ident is None or ident == p.identity:
                # Gone: the last image seen under this pid is the best guess
                # (a new process under the same pid would have an identity).
                return p
            self.stats.invalidations += 1
            log.debug("pid %d changed image (%s -> %s): new symbol cache", pid, p.identity, ident)
            self._drop(pid)
        resolver: Resolver | None
        try:
            resolver = self._factory(pid) if ident is not None else None
        except Exception as e:  # noqa: BLE001 -- bcc raises plain Exception
            log.debug("no symbol cache for pid %d: %s", pid, e)
            resolver = None
        p = _ProcessSymbols(ident, resolver)
        self._procs[pid] = p
        return p

    def user_stack(self, pid: int, addrs_leaf_first: list[int]) -> tuple[str, ...]:
        """Root-first frames for user addresses of ``pid`` given leaf first."""
        p = self._process(pid)
        known = p.known
        out: list[str] = []
        for a in reversed(addrs_leaf_first):
            f = known.get(a)
            if f is None:
                f = self._resolve_user(p, pid, a)
            out.append(f)
        return tuple(out)

    def _resolve_user(self, p: _ProcessSymbols, pid: int, addr: int) -> str:
        f = self._unknown.get((pid, addr))
        if f is not None:
            return f
        if p.resolver is None:
            self._unknown[(pid, addr)] = UNKNOWN
            return UNKNOWN
        self.stats.resolver_calls += 1
        name, module = p.resolver.resolve(addr)
        f = _frame(name, module)
        if name:
            p.known[addr] = f
        else:
            self._unknown[(pid, addr)] = f
        return f
