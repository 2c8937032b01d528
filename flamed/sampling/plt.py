"""Names for the entries of an x86-64 ELF file's procedure linkage table.

A call to a function of another module (or, in a shared library built with
semantic interposition, such as a ``--enable-shared`` CPython, to its own
exported functions) goes through a PLT stub: ``jmp *GOT_SLOT(%rip)``.  Those
stubs are in no symbol table, so without this a sample in one takes the name
of the nearest symbol before it (``_init``, whose size is zero): 7 % of the
samples of a busy pyenv 3.12 were ``_init`` that way.  Each stub is named
``<function>@plt`` after the relocation that fills its GOT slot, as ``perf``
and ``objdump`` name them.

The stubs of ``.plt``, ``.plt.sec`` (with IBT) and ``.plt.got`` are decoded,
whatever the lazy-binding layout: the slot a stub jumps through is found from
the instruction itself, then looked up among the ``R_X86_64_JUMP_SLOT`` and
``R_X86_64_GLOB_DAT`` relocations.  Other machines, and anything malformed,
give no names (never an error): the file's own symbols still stand.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Callable
from typing import BinaryIO

EM_X86_64 = 62
SHT_RELA = 4
R_X86_64_GLOB_DAT = 6
R_X86_64_JUMP_SLOT = 7
R_X86_64_IRELATIVE = 37
#: Sections larger than this are not read (a libpython's .rela.plt is ~35 KiB).
MAX_SECTION = 16 << 20
_PLT_SECTIONS = (b".plt", b".plt.sec", b".plt.got")
_JMP = b"\xff\x25"  # jmp *disp32(%rip)


def plt_symbols(path: str, name_at: Callable[[int], bytes | None] = lambda _a: None) -> list[tuple[int, int, bytes]]:
    """(address, size, ``name@plt``) of every PLT stub of ``path`` that jumps
    through a slot a relocation names; [] when there is none or the file is
    not a 64-bit x86-64 ELF file.  ``name_at(address)``: the file's symbol at
    an address, for the slots of ``R_X86_64_IRELATIVE`` relocations (a call
    to a GNU ifunc inside the file: libc's own calls to memcpy), named after
    the ifunc's resolver, which is the function's symbol."""
    try:
        with open(path, "rb") as f:
            return _read(f, name_at)
    except (OSError, ValueError, struct.error, IndexError):
        return []


def _section(f: BinaryIO, sec: tuple[int, ...]) -> bytes:
    size = sec[5]
    if size > MAX_SECTION:
        raise ValueError("section too large")
    f.seek(sec[4])
    data = f.read(size)
    if len(data) != size:
        raise ValueError("truncated section")
    return data


def _cstr(table: bytes, at: int) -> bytes:
    end = table.find(b"\0", at)
    return table[at:end if end >= 0 else len(table)]


def _read(f: BinaryIO, name_at: Callable[[int], bytes | None]) -> list[tuple[int, int, bytes]]:
    head = f.read(64)
    if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
        return []
    if struct.unpack_from("<H", head, 18)[0] != EM_X86_64:
        return []
    shoff = struct.unpack_from("<Q", head, 40)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", head, 58)
    if shentsize != 64 or not 0 < shnum <= 65535 or shstrndx >= shnum:
        return []
    f.seek(shoff)
    raw = f.read(shnum * 64)
    if len(raw) != shnum * 64:
        return []
    # name, type, flags, addr, offset, size, link, info, addralign, entsize
    sections = [struct.unpack_from("<IIQQQQIIQQ", raw, i * 64) for i in range(shnum)]
    shstr = _section(f, sections[shstrndx])
    by_name = {_cstr(shstr, s[0]): s for s in sections}
    # The stubs first: (address, size, the GOT slot each jumps through).
    stubs: list[tuple[int, int, int]] = []
    for secname in _PLT_SECTIONS:
        plt = by_name.get(secname)
        if plt is None or plt[1] == 8:  # absent, or SHT_NOBITS
            continue
        code = _section(f, plt)
        step = plt[9] if plt[9] in (8, 16) else 16
        if secname == b".plt.got" and plt[9] == 0:
            step = 8
        for at in range(0, len(code) - step + 1, step):
            j = code.find(_JMP, at, at + step)
            if j < 0 or j + 6 > at + step:
                continue
            addr = plt[3] + at
            stubs.append((addr, step, addr + (j - at) + 6 + struct.unpack_from("<i", code, j + 2)[0]))
    if not stubs:
        return []
    wanted = {slot for _a, _s, slot in stubs}
    # Then the relocations that fill those slots.  A .rela.dyn holds 200,000
    # entries in libLLVM, nearly all R_X86_64_RELATIVE: matched in C (array
    # slices, set intersection), not one by one.
    names: dict[int, bytes] = {}
    for sec in sections:
        if sec[1] != SHT_RELA or sec[9] != 24 or not sec[6] < shnum:
            continue
        table = array("Q")
        table.frombytes(_section(f, sec)[: sec[5] // 24 * 24])
        offsets = table[0::3]
        hits = wanted.intersection(offsets)
        if not hits:
            continue
        symtab = sections[sec[6]]
        if symtab[9] == 24 and 0 < symtab[6] < shnum:
            syms = _section(f, symtab)
            strs = _section(f, sections[symtab[6]])
        else:
            syms = strs = b""
        where = dict(zip(offsets, range(len(offsets)))) if len(hits) > 16 else None
        for slot in hits:
            k = (where[slot] if where is not None else offsets.index(slot)) * 3
            info, addend = table[k + 1], table[k + 2]
            kind = info & 0xFFFFFFFF
            name: bytes | None = None
            if kind == R_X86_64_IRELATIVE:
                name = name_at(addend - (1 << 64) if addend >= 1 << 63 else addend)
            elif kind in (R_X86_64_JUMP_SLOT, R_X86_64_GLOB_DAT):
                index = info >> 32
                if 0 < index < len(syms) // 24:
                    name = _cstr(strs, struct.unpack_from("<I", syms, index * 24)[0])
            if name:
                names[slot] = name
    return [(addr, size, names[slot] + b"@plt") for addr, size, slot in stubs if slot in names]
