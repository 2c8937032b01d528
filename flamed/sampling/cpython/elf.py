"""The few ELF facts probing needs of an interpreter binary, parsed once per file.

Only 64-bit little-endian ELF (x86-64): the symbol tables (.dynsym, then
.symtab) for ``_PyRuntime`` and ``Py_Version``, the PT_LOAD segments (for the
load bias and for reading initialized data from the file).  Parsed with
``struct`` reading only the headers and the two symbol tables; results are
cached by (dev, inode, size, mtime) so a libpython shared by many processes is
parsed once.
"""

from __future__ import annotations

import os
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from flamed.sampling.cpython.errors import CPythonError

ET_EXEC = 2
ET_DYN = 3
PT_LOAD = 1
SHT_SYMTAB = 2
SHT_DYNSYM = 11
SHT_NOBITS = 8
SHT_DYNAMIC = 6
DT_NEEDED = 1

#: Symbols probing looks up; everything else in the tables is skipped.
#: (``Py_InitializeEx``, defined by every CPython, tells the process watcher
#: that an executable of any name is an interpreter, flamed/pyspy/watcher.py.)
WANTED = (b"_PyRuntime", b"Py_Version", b"Py_InitializeEx")
#: A symbol table larger than this is not read (a libpython's is a few MiB).
MAX_TABLE_BYTES = 64 << 20


class ElfError(CPythonError):
    """An interpreter binary that is not a readable 64-bit little-endian ELF file."""


@dataclass(frozen=True, slots=True)
class Segment:
    vaddr: int
    offset: int
    filesz: int
    memsz: int


@dataclass(frozen=True, slots=True)
class ElfFacts:
    path: str
    etype: int
    segments: tuple[Segment, ...]
    #: name -> (file vaddr, size) of the WANTED symbols found
    symbols: dict[bytes, tuple[int, int]]
    #: DT_NEEDED libraries (what the dynamic loader will map before main)
    needed: tuple[str, ...] = ()

    def file_offset(self, vaddr: int, size: int) -> int | None:
        """File offset of ``size`` initialized bytes at ``vaddr``, None when not in the file."""
        for seg in self.segments:
            if seg.vaddr <= vaddr and vaddr + size <= seg.vaddr + seg.filesz:
                return seg.offset + (vaddr - seg.vaddr)
        return None

    def read(self, vaddr: int, size: int, path: str | None = None) -> bytes | None:
        """Initialized data at ``vaddr`` as stored in the file (None when out of the file).

        ``path``: where to open the file now.  The facts are shared by every
        process mapping the file, and ``self.path`` is where the first of them
        saw it (``/proc/PID/root/...``), gone once that process exits."""
        off = self.file_offset(vaddr, size)
        if off is None:
            return None
        try:
            with open(path or self.path, "rb") as f:
                f.seek(off)
                data = f.read(size)
        except OSError:
            return None
        return data if len(data) == size else None

    def hexversion(self, path: str | None = None) -> int | None:
        """``Py_Version`` (CPython 3.11+: ``PY_VERSION_HEX``) as stored in the file,
        None without it; ``path`` as for :meth:`read`."""
        if b"Py_Version" not in self.symbols:
            return None
        raw = self.read(self.symbols[b"Py_Version"][0], 4, path)
        return struct.unpack("<I", raw)[0] if raw is not None else None


def parse(path: str) -> ElfFacts:
    """Read the headers and symbol tables of ``path``."""
    try:
        with open(path, "rb") as f:
            return _parse(f, path)
    except OSError as e:
        raise ElfError(f"{path}: cannot read: {e.strerror}") from e
    except struct.error as e:
        raise ElfError(f"{path}: truncated ELF file ({e})") from e


def _parse(f: BinaryIO, path: str) -> ElfFacts:
    head = f.read(64)
    if len(head) < 64 or head[:4] != b"\x7fELF":
        raise ElfError(f"{path}: not an ELF file")
    if head[4] != 2 or head[5] != 1:
        raise ElfError(f"{path}: not a 64-bit little-endian ELF file (only x86-64 is supported)")
    etype, _machine = struct.unpack_from("<HH", head, 16)
    phoff, shoff = struct.unpack_from("<QQ", head, 32)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", head, 54)
    if phentsize != 56 or (shnum and shentsize != 64) or phnum > 4096 or shnum > 65535:
        raise ElfError(f"{path}: unexpected ELF header sizes")
    f.seek(phoff)
    ph = f.read(phnum * 56)
    segments = []
    for i in range(phnum):
        p_type, _flags, p_offset, p_vaddr, _paddr, p_filesz, p_memsz = struct.unpack_from(
            "<IIQQQQQ", ph, i * 56
        )
        if p_type == PT_LOAD:
            segments.append(Segment(p_vaddr, p_offset, p_filesz, p_memsz))
    f.seek(shoff)
    sh = f.read(shnum * 64)
    sections = [struct.unpack_from("<IIQQQQIIQQ", sh, i * 64) for i in range(shnum)]
    symbols: dict[bytes, tuple[int, int]] = {}
    # .dynsym first: stripped executables (Debian's python3.11) keep only it.
    for wanted_type in (SHT_DYNSYM, SHT_SYMTAB):
        if len(symbols) == len(WANTED):
            break  # all in .dynsym: the (larger) .symtab is not read
        for sec in sections:
            if sec[1] != wanted_type or sec[9] != 24:
                continue
            link = sec[6]
            if link >= len(sections):
                continue
            strsec = sections[link]
            if sec[5] > MAX_TABLE_BYTES or strsec[5] > MAX_TABLE_BYTES:
                continue
            f.seek(sec[4])
            table = f.read(sec[5])
            f.seek(strsec[4])
            strtab = f.read(strsec[5])
            for name in WANTED:
                if name in symbols:
                    continue
                found = _lookup(table, strtab, name)
                if found is not None:
                    symbols[name] = found
    needed: list[str] = []
    for sec in sections:
        if sec[1] != SHT_DYNAMIC or sec[5] > MAX_TABLE_BYTES or sec[6] >= len(sections):
            continue
        strsec = sections[sec[6]]
        if strsec[5] > MAX_TABLE_BYTES:
            continue
        f.seek(sec[4])
        dyn = f.read(sec[5])
        f.seek(strsec[4])
        dynstr = f.read(strsec[5])
        for i in range(0, len(dyn) - 15, 16):
            tag, val = struct.unpack_from("<qQ", dyn, i)
            if tag == 0:
                break
            if tag == DT_NEEDED and val < len(dynstr):
                end = dynstr.find(b"\0", val)
                needed.append(dynstr[val : end if end >= 0 else len(dynstr)].decode("utf-8", "replace"))
    return ElfFacts(path, etype, tuple(segments), symbols, tuple(needed))


def _lookup(table: bytes, strtab: bytes, name: bytes) -> tuple[int, int] | None:
    # Find the name in the string table first: one bytes.find per occurrence
    # instead of decoding every symbol.
    needle = name + b"\0"
    positions = set()
    start = 0
    while True:
        pos = strtab.find(needle, start)
        if pos < 0:
            break
        if pos == 0 or strtab[pos - 1] == 0:
            positions.add(pos)
        start = pos + 1
    if not positions:
        return None
    for i in range(0, len(table) - 23, 24):
        st_name, _info, _other, shndx, value, size = struct.unpack_from("<IBBHQQ", table, i)
        if st_name in positions and shndx != 0:
            return value, size
    return None


class ElfCache:
    """Parsed :class:`ElfFacts` by file identity, bounded LRU, thread-safe."""

    def __init__(self, maxsize: int = 256) -> None:
        self._maxsize = maxsize
        self._entries: OrderedDict[tuple[int, int, int, int], ElfFacts] = OrderedDict()
        self._lock = threading.Lock()
        self.parses = 0

    def get(self, path: str | Path, st: os.stat_result | None = None) -> ElfFacts:
        if st is None:
            st = os.stat(path)
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        with self._lock:
            facts = self._entries.get(key)
            if facts is not None:
                self._entries.move_to_end(key)
                return facts
        facts = parse(str(path))
        with self._lock:
            self.parses += 1
            self._entries[key] = facts
            while len(self._entries) > self._maxsize:
                self._entries.popitem(last=False)
        return facts


#: The process-wide cache probe() uses by default.
CACHE = ElfCache()
