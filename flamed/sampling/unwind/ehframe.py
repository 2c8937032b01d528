"""Unwind tables from a binary's call frame information (.eh_frame, .debug_frame).

The compiler describes, for every instruction of every function, how to find
the caller: where the canonical frame address (CFA: the stack pointer before
the call) is, and where the return address and the callee-saved registers
were stored.  The BPF unwinder needs three facts per address range on x86-64:
the CFA as ``rsp + N`` or ``rbp + N``, whether and where ``rbp`` was saved
(the return address is always at CFA - 8 there), and whether the frame is the
outermost one (the return address is *undefined*: ``_start``, ``clone3``).

:func:`build_table` runs the CFI programs of every FDE and turns them into a
sorted list of :class:`Row`: from ``pc`` (a file virtual address) up to the
next row's ``pc``, the rule ``kind`` holds.  A gap between functions gets a
``NONE`` row, so an address never inherits the rule of the function before it.

Only 64-bit little-endian ELF (x86-64).  Everything is read with ``struct``.
"""

from __future__ import annotations

import array
import bisect
import hashlib
import os
import struct
import sys
from dataclasses import dataclass
from typing import NamedTuple

from flamed.errors import FlamedError

# Row kinds; bpf/flamed.h mirrors them (FLAMED_UW_*).
NONE = 0  # no CFI covers the address: the unwinder uses the frame pointer
CFA_RSP = 1  # CFA = rsp + cfa
CFA_RBP = 2  # CFA = rbp + cfa
PLT = 3  # a PLT entry: CFA = rsp + cfa, + 8 when (addr & 15) >= rbp
STOP = 4  # the return address is undefined: the outermost frame
UNSUPPORTED = 5  # a rule the unwinder cannot follow (a DWARF expression, another register)


# DWARF register numbers of x86-64.
_RBP, _RSP, _RA = 6, 7, 16

#: Row encoding: pc (u32), cfa offset / 8 (u16), kind (u8), rbp (u8: saved
#: at CFA - 8 * rbp, 0 when not saved; the threshold for PLT rows).
ROW = struct.Struct("<IHBB")

SHT_NOBITS = 8

#: Bytes of code per bucket of a table's page index, as a shift: the same
#: number as FLAMED_UW_PAGE_SHIFT in bpf/flamed.h (a unit test compares them).
PAGE_SHIFT = 10


def page_index(packed: bytes) -> tuple[int, int, bytes]:
    """(base, pages, index) of packed rows (sorted by pc): P[b], the number of
    rows whose pc is below ``base + (b << PAGE_SHIFT)``, for b in 0..pages,
    as little-endian u32s padded to whole rows (bpf/flamed.h says how the
    program reads it).  Empty rows give (0, 0, b"")."""
    n = len(packed) // ROW.size
    if n == 0:
        return 0, 0, b""
    words = array.array("I")
    words.frombytes(packed[:n * ROW.size])
    if sys.byteorder != "little":
        words.byteswap()
    pcs = words[0::2]
    base = (pcs[0] >> PAGE_SHIFT) << PAGE_SHIFT
    pages = ((pcs[-1] - base) >> PAGE_SHIFT) + 1
    index = array.array("I", (bisect.bisect_left(pcs, base + (b << PAGE_SHIFT)) for b in range(pages + 1)))
    if len(index) % 2:
        index.append(n)
    if sys.byteorder != "little":
        index.byteswap()
    return base, pages, index.tobytes()


class UnwindTableError(FlamedError):
    """A binary whose call frame information cannot be read."""


class Row(NamedTuple):
    pc: int
    kind: int
    cfa: int
    rbp: int


@dataclass(frozen=True)
class Table:
    """A binary's unwind rows, sorted by pc, with what was seen building them."""

    rows: list[Row]
    #: FDEs read (functions described).
    fdes: int
    #: Rows whose rule is UNSUPPORTED.
    unsupported: int
    #: Which section the rows come from: ".eh_frame", ".debug_frame" or "".
    source: str

    def pack(self) -> bytes:
        """The rows as the BPF map holds them (see ROW)."""
        pack = ROW.pack
        return b"".join(pack(r.pc, r.cfa >> 3, r.kind, r.rbp if r.kind == PLT else -r.rbp) for r in self.rows)


@dataclass(frozen=True)
class ElfInfo:
    """What the unwinder needs of an ELF file's headers."""

    build_id: str
    #: (vaddr, file offset, file size, flags) of each PT_LOAD
    loads: tuple[tuple[int, int, int, int], ...]
    #: name -> (file offset, size, vaddr) of the sections read
    sections: dict[str, tuple[int, int, int]]


def read_elf_info(path: str) -> ElfInfo:
    """Headers, PT_LOAD segments, the build id and the CFI sections of ``path``."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
            if len(head) < 64 or head[:4] != b"\x7fELF":
                raise UnwindTableError(f"{path}: not an ELF file")
            if head[4] != 2 or head[5] != 1:
                raise UnwindTableError(f"{path}: not a 64-bit little-endian ELF file")
            phoff, shoff = struct.unpack_from("<QQ", head, 32)
            phentsize, phnum, shentsize, shnum, shstrndx = struct.unpack_from("<HHHHH", head, 54)
            if phentsize != 56 or (shnum and shentsize != 64) or phnum > 4096:
                raise UnwindTableError(f"{path}: unexpected ELF header sizes")
            f.seek(phoff)
            ph = f.read(56 * phnum)
            loads = []
            for i in range(phnum):
                p_type, p_flags, p_offset, p_vaddr, _pa, p_filesz, _memsz = struct.unpack_from("<IIQQQQQ", ph, 56 * i)
                if p_type == 1:
                    loads.append((p_vaddr, p_offset, p_filesz, p_flags))
            sections: dict[str, tuple[int, int, int]] = {}
            build_id = ""
            if shnum and shstrndx < shnum:
                f.seek(shoff)
                sh = f.read(64 * shnum)
                hdrs = [struct.unpack_from("<IIQQQQIIQQ", sh, 64 * i) for i in range(shnum)]
                strsec = hdrs[shstrndx]
                f.seek(strsec[4])
                names = f.read(min(strsec[5], 1 << 20))
                for h in hdrs:
                    end = names.find(b"\0", h[0])
                    name = names[h[0]:end if end >= 0 else len(names)].decode("ascii", "replace")
                    if h[1] == SHT_NOBITS:
                        continue
                    if name in (".eh_frame", ".debug_frame", ".eh_frame_hdr", ".note.gnu.build-id"):
                        sections[name] = (h[4], h[5], h[3])
                note = sections.get(".note.gnu.build-id")
                if note is not None and note[1] <= 4096:
                    f.seek(note[0])
                    build_id = _parse_build_id(f.read(note[1]))
    except OSError as e:
        raise UnwindTableError(f"{path}: cannot read: {e.strerror}") from e
    except struct.error as e:
        raise UnwindTableError(f"{path}: truncated ELF file ({e})") from e
    return ElfInfo(build_id, tuple(loads), sections)


def _parse_build_id(data: bytes) -> str:
    pos = 0
    while pos + 12 <= len(data):
        namesz, descsz, ntype = struct.unpack_from("<III", data, pos)
        pos += 12
        name = data[pos:pos + namesz]
        pos += (namesz + 3) & ~3
        desc = data[pos:pos + descsz]
        pos += (descsz + 3) & ~3
        if ntype == 3 and name.rstrip(b"\0") == b"GNU":
            return desc.hex()
    return ""


def file_key(path: str, info: ElfInfo) -> str:
    """The cache name of a binary's table: its build id, or a digest of what
    identifies this file version when it has none."""
    if info.build_id:
        return info.build_id
    st = os.stat(path)
    raw = f"{os.path.realpath(path)}\0{st.st_dev}\0{st.st_ino}\0{st.st_size}\0{st.st_mtime_ns}"
    return "nobuildid-" + hashlib.sha256(raw.encode()).hexdigest()[:32]


def build_table(path: str, info: ElfInfo | None = None) -> Table:
    """Parse ``path``'s .eh_frame (or, when it has none, .debug_frame) into rows."""
    info = info or read_elf_info(path)
    for name in (".eh_frame", ".debug_frame"):
        sec = info.sections.get(name)
        if sec is None or sec[1] == 0:
            continue
        offset, size, vaddr = sec
        if size > 1 << 30:
            raise UnwindTableError(f"{path}: {name} of {size} bytes is too large")
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read(size)
        except OSError as e:
            raise UnwindTableError(f"{path}: cannot read {name}: {e.strerror}") from e
        if len(data) != size:
            raise UnwindTableError(f"{path}: {name} is truncated")
        try:
            fdes = _parse_cfi(data, vaddr, name == ".eh_frame")
        except (IndexError, struct.error, ValueError) as e:
            raise UnwindTableError(f"{path}: malformed {name} ({e})") from e
        # Rows hold 32-bit addresses: a function above 4 GiB (no such
        # binary is known) is left out, and its addresses get no rule.
        fdes = [t for t in fdes if t[1] <= 0xFFFFFFFF]
        if fdes:
            rows = _merge(fdes)
            return Table(rows, len(fdes), sum(1 for r in rows if r.kind == UNSUPPORTED), name)
    return Table([], 0, 0, "")


# ---------------------------------------------------------------------------
# DWARF call frame information


def _uleb(d: bytes, p: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        b = d[p]
        p += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, p
        shift += 7


def _sleb(d: bytes, p: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        b = d[p]
        p += 1
        result |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            if b & 0x40:
                result -= 1 << shift
            return result, p


_FIXED = {0x02: ("<H", 2), 0x03: ("<I", 4), 0x04: ("<Q", 8), 0x0A: ("<h", 2), 0x0B: ("<i", 4), 0x0C: ("<q", 8)}


def _pointer(d: bytes, p: int, enc: int, field_addr: int) -> tuple[int, int]:
    """Decode a pointer of encoding ``enc`` at ``d[p]``; ``field_addr`` is the
    field's virtual address (for pc-relative encodings)."""
    fmt = enc & 0x0F
    if fmt == 0x00:
        v = struct.unpack_from("<Q", d, p)[0]
        q = p + 8
    elif fmt == 0x01:
        v, q = _uleb(d, p)
    elif fmt == 0x09:
        v, q = _sleb(d, p)
    else:
        spec = _FIXED.get(fmt)
        if spec is None:
            raise ValueError(f"pointer encoding {enc:#x}")
        v = struct.unpack_from(spec[0], d, p)[0]
        q = p + spec[1]
    app = enc & 0x70
    if app == 0x10:
        v += field_addr
    elif app not in (0x00,):
        raise ValueError(f"pointer application {enc:#x}")
    return v & 0xFFFFFFFFFFFFFFFF, q


class _Cie(NamedTuple):
    code_align: int
    data_align: int
    ra_reg: int
    fde_enc: int
    has_aug_data: bool
    signal: bool
    insns: bytes


def _parse_cie(d: bytes, p: int, end: int, vaddr: int, eh: bool) -> _Cie:
    version = d[p]
    p += 1
    aend = d.index(b"\0", p)
    aug = d[p:aend].decode("ascii", "replace")
    p = aend + 1
    if "eh" in aug:
        p += 8
    if not eh and version >= 4:
        p += 2  # address_size, segment_selector_size
    code_align, p = _uleb(d, p)
    data_align, p = _sleb(d, p)
    if version == 1:
        ra_reg = d[p]
        p += 1
    else:
        ra_reg, p = _uleb(d, p)
    fde_enc = 0x00  # absolute 8-byte pointers (.debug_frame)
    signal = False
    has_aug_data = aug.startswith("z")
    if has_aug_data:
        alen, p = _uleb(d, p)
        after = p + alen
        for ch in aug[1:]:
            if ch == "R":
                fde_enc = d[p]
                p += 1
            elif ch == "L":
                p += 1
            elif ch == "P":
                penc = d[p]
                _v, p = _pointer(d, p + 1, penc & 0x7F, vaddr + p + 1)
            elif ch == "S":
                signal = True
            elif ch in "BG":
                pass
            else:
                break
        p = after
    return _Cie(code_align, data_align, ra_reg, fde_enc, has_aug_data, signal, d[p:end])


def _parse_cfi(d: bytes, sec_vaddr: int, eh: bool) -> list[tuple[int, int, list[Row]]]:
    """Every FDE of the section as (start, end, rows)."""
    cies: dict[int, _Cie] = {}
    out: list[tuple[int, int, list[Row]]] = []
    p = 0
    n = len(d)
    while p + 4 <= n:
        length = struct.unpack_from("<I", d, p)[0]
        start = p
        p += 4
        if length == 0:
            if eh:
                break  # the terminator
            continue
        if length == 0xFFFFFFFF:
            length = struct.unpack_from("<Q", d, p)[0]
            p += 8
            idsize = 8
        else:
            idsize = 4
        end = p + length
        if end > n:
            raise ValueError(f"entry at {start:#x} runs past the section")
        id_pos = p
        cie_id = struct.unpack_from("<I" if idsize == 4 else "<Q", d, p)[0]
        p += idsize
        is_cie = cie_id == 0 if eh else cie_id in (0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF)
        if is_cie:
            cies[start] = _parse_cie(d, p, end, sec_vaddr, eh)
        else:
            cie_off = id_pos - cie_id if eh else cie_id
            cie = cies.get(cie_off)
            if cie is None:
                if cie_off in range(0, n - 4):
                    # A CIE after its FDE (legal in .debug_frame): parse it now.
                    cl = struct.unpack_from("<I", d, cie_off)[0]
                    cies[cie_off] = cie = _parse_cie(d, cie_off + 4 + idsize, cie_off + 4 + cl, sec_vaddr, eh)
                else:
                    p = end
                    continue
            pc_begin, p = _pointer(d, p, cie.fde_enc, sec_vaddr + p)
            pc_range, p = _pointer(d, p, cie.fde_enc & 0x0F, 0)
            if cie.has_aug_data:
                alen, p = _uleb(d, p)
                p += alen
            if pc_range and pc_begin:
                rows = _run(cie, d[p:end], pc_begin, pc_begin + pc_range, sec_vaddr + p)
                out.append((pc_begin, pc_begin + pc_range, rows))
        p = end
    return out


# State: (cfa_reg, cfa_off, cfa_expr_kind, rbp_rule, ra_undefined)
# cfa_expr_kind: 0 plain, PLT threshold (10/11) for the PLT expression, -1 other expression.
# rbp_rule: None (unchanged), int (saved at CFA + n), "x" (another rule)
_State = tuple[int, int, int, object, bool]


def _plt_threshold(expr: bytes) -> int:
    """The threshold of the PLT entry expression (rsp + 8 + 8 * ((rip & 15) >= T)), or -1."""
    # DW_OP_breg7 8; DW_OP_breg16 0; DW_OP_lit15; DW_OP_and; DW_OP_litT; DW_OP_ge; DW_OP_lit3; DW_OP_shl; DW_OP_plus
    if len(expr) == 11 and expr[:6] == b"\x77\x08\x80\x00\x3f\x1a" and expr[7:] == b"\x2a\x33\x24\x22":
        lit = expr[6]
        if 0x30 <= lit <= 0x4F:
            return lit - 0x30
    return -1


def _row(pc: int, st: _State) -> Row:
    cfa_reg, cfa_off, expr, rbp, ra_undef = st
    if ra_undef:
        return Row(pc, STOP, 0, 0)
    if expr > 0:
        return Row(pc, PLT, 8, expr)
    if expr < 0 or cfa_reg not in (_RSP, _RBP) or not 0 <= cfa_off <= 0xFFFF * 8 or cfa_off & 7:
        return Row(pc, UNSUPPORTED, 0, 0)
    if rbp is None:
        r = 0
    elif isinstance(rbp, int) and rbp % 8 == 0 and -2040 <= rbp < 0:
        r = rbp // 8
    else:
        return Row(pc, UNSUPPORTED, 0, 0)
    return Row(pc, CFA_RSP if cfa_reg == _RSP else CFA_RBP, cfa_off, r)


def _run(cie: _Cie, fde_insns: bytes, start: int, end: int, insn_vaddr: int) -> list[Row]:
    """Execute the CIE's initial instructions, then the FDE's; one row per location change."""
    ca, da = cie.code_align, cie.data_align
    init: list[object] = [_RSP, 8, 0, None, False]

    def execute(insns: bytes, state: list[object], initial: list[object] | None, rows: list[Row] | None,
                loc: int) -> int:
        stack: list[list[object]] = []
        p = 0
        n = len(insns)
        while p < n:
            op = insns[p]
            p += 1
            hi = op & 0xC0
            if hi == 0x40 or op in (0x01, 0x02, 0x03, 0x04):
                if hi == 0x40:
                    delta = (op & 0x3F) * ca
                elif op == 0x02:
                    delta = insns[p] * ca
                    p += 1
                elif op == 0x03:
                    delta = struct.unpack_from("<H", insns, p)[0] * ca
                    p += 2
                elif op == 0x04:
                    delta = struct.unpack_from("<I", insns, p)[0] * ca
                    p += 4
                else:
                    newloc, p = _pointer(insns, p, cie.fde_enc, insn_vaddr + p)
                    delta = newloc - loc
                if rows is not None and delta:
                    rows.append(_row(loc, tuple(state)))  # type: ignore[arg-type]
                loc += delta
                continue
            if hi == 0x80:
                reg = op & 0x3F
                off, p = _uleb(insns, p)
                _set_reg(state, reg, off * da)
            elif hi == 0xC0:
                _restore(state, initial, op & 0x3F)
            elif op == 0x00:
                pass
            elif op == 0x05:
                reg, p = _uleb(insns, p)
                off, p = _uleb(insns, p)
                _set_reg(state, reg, off * da)
            elif op == 0x06:
                reg, p = _uleb(insns, p)
                _restore(state, initial, reg)
            elif op == 0x07:
                reg, p = _uleb(insns, p)
                if reg == _RA:
                    state[4] = True
                elif reg == _RBP:
                    state[3] = None
            elif op == 0x08:
                reg, p = _uleb(insns, p)
                if reg == _RBP:
                    state[3] = None
            elif op == 0x09:
                reg, p = _uleb(insns, p)
                _r2, p = _uleb(insns, p)
                _set_other(state, reg)
            elif op == 0x0A:
                stack.append(list(state))
            elif op == 0x0B:
                if stack:
                    saved = stack.pop()
                    # The CFA rule is restored too (DWARF 5 makes it explicit; GCC relies on it).
                    state[:] = saved
            elif op == 0x0C:
                reg, p = _uleb(insns, p)
                off, p = _uleb(insns, p)
                state[0], state[1], state[2] = reg, off, 0
            elif op == 0x0D:
                reg, p = _uleb(insns, p)
                state[0] = reg
                if state[2] != 0:
                    state[2] = -1
            elif op == 0x0E:
                off, p = _uleb(insns, p)
                state[1] = off
            elif op == 0x0F:
                ln, p = _uleb(insns, p)
                expr = insns[p:p + ln]
                p += ln
                t = _plt_threshold(expr)
                state[2] = t if t > 0 else -1
            elif op == 0x10 or op == 0x16:
                reg, p = _uleb(insns, p)
                ln, p = _uleb(insns, p)
                p += ln
                _set_other(state, reg)
            elif op == 0x11:
                reg, p = _uleb(insns, p)
                off, p = _sleb(insns, p)
                _set_reg(state, reg, off * da)
            elif op == 0x12:
                reg, p = _uleb(insns, p)
                off, p = _sleb(insns, p)
                state[0], state[1], state[2] = reg, off * da, 0
            elif op == 0x13:
                off, p = _sleb(insns, p)
                state[1] = off * da
            elif op in (0x14, 0x15):
                reg, p = _uleb(insns, p)
                _v, p = (_uleb if op == 0x14 else _sleb)(insns, p)
                _set_other(state, reg)
            elif op == 0x2E:
                _v, p = _uleb(insns, p)
            elif op == 0x2F:
                reg, p = _uleb(insns, p)
                off, p = _uleb(insns, p)
                _set_reg(state, reg, -off * da)
            else:
                raise ValueError(f"CFA instruction {op:#x}")
        return loc

    st0 = list(init)
    execute(cie.insns, st0, None, None, start)
    state = list(st0)
    rows: list[Row] = []
    loc = execute(fde_insns, state, st0, rows, start)
    if loc < end:
        rows.append(_row(loc, tuple(state)))  # type: ignore[arg-type]
    return rows


def _set_reg(state: list[object], reg: int, off: int) -> None:
    if reg == _RBP:
        state[3] = off
    elif reg == _RA:
        state[4] = False
        if off != -8:
            state[2] = -1


def _set_other(state: list[object], reg: int) -> None:
    if reg == _RBP:
        state[3] = "x"
    elif reg == _RA:
        state[2] = -1


def _restore(state: list[object], initial: list[object] | None, reg: int) -> None:
    if initial is None:
        return
    if reg == _RBP:
        state[3] = initial[3]
    elif reg == _RA:
        state[4] = initial[4]


def _merge(fdes: list[tuple[int, int, list[Row]]]) -> list[Row]:
    """One sorted row list: each FDE's rows, a NONE row where an FDE ends
    and the next does not begin, consecutive equal rules joined."""
    fdes.sort(key=lambda t: t[0])
    out: list[Row] = []
    last_kind = (-1, -1, -1)
    for i, (start, end, rows) in enumerate(fdes):
        nxt = fdes[i + 1][0] if i + 1 < len(fdes) else None
        limit = min(end, nxt) if nxt is not None else end
        for r in rows:
            if r.pc >= limit:
                break
            key = (r.kind, r.cfa, r.rbp)
            if key == last_kind:
                continue
            if out and out[-1].pc == r.pc:
                out[-1] = r
            else:
                out.append(r)
            last_kind = key
        if nxt is None or nxt > end:
            if out and out[-1].pc == end:
                out[-1] = Row(end, NONE, 0, 0)
            else:
                out.append(Row(end, NONE, 0, 0))
            last_kind = (NONE, 0, 0)
    return out


def lookup(rows: list[Row], pc: int) -> Row | None:
    """The row in effect at ``pc`` (a file virtual address), None before the first."""
    lo, hi = 0, len(rows)
    while lo < hi:
        mid = (lo + hi) // 2
        if rows[mid].pc <= pc:
            lo = mid + 1
        else:
            hi = mid
    return rows[lo - 1] if lo else None
