"""Member offsets of kernel structs from the kernel's BTF (/sys/kernel/btf/vmlinux).

The BPF walker matches 3.8-3.10 thread states by the thread's fs base
(pthread_self()), read at ``bpf_get_current_task() + task_struct.thread.fsbase``;
:func:`fsbase_offset` gives that offset for the running kernel.  The format
is the kernel's Documentation/bpf/btf.rst: a header, a type section of
``struct btf_type`` records (type ids from 1) each followed by its kind's
data, and a string section.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

from flamed.sampling.cpython.errors import CPythonError

VMLINUX = Path("/sys/kernel/btf/vmlinux")
BTF_MAGIC = 0xEB9F

KIND_INT, KIND_PTR, KIND_ARRAY, KIND_STRUCT, KIND_UNION, KIND_ENUM = 1, 2, 3, 4, 5, 6
KIND_FWD, KIND_TYPEDEF, KIND_VOLATILE, KIND_CONST, KIND_RESTRICT = 7, 8, 9, 10, 11
KIND_FUNC, KIND_FUNC_PROTO, KIND_VAR, KIND_DATASEC, KIND_FLOAT = 12, 13, 14, 15, 16
KIND_DECL_TAG, KIND_TYPE_TAG, KIND_ENUM64 = 17, 18, 19

#: Bytes after the 12-byte btf_type header: (fixed, per vlen item).
_EXTRA = {
    KIND_INT: (4, 0), KIND_ARRAY: (12, 0), KIND_STRUCT: (0, 12), KIND_UNION: (0, 12),
    KIND_ENUM: (0, 8), KIND_FUNC_PROTO: (0, 8), KIND_VAR: (4, 0), KIND_DATASEC: (0, 12),
    KIND_DECL_TAG: (4, 0), KIND_ENUM64: (0, 12),
}
_MODIFIERS = (KIND_TYPEDEF, KIND_VOLATILE, KIND_CONST, KIND_RESTRICT, KIND_TYPE_TAG)


class BtfError(CPythonError):
    """Kernel BTF missing, malformed, or without the member asked for."""


@dataclass(frozen=True, slots=True)
class BtfType:
    name: str
    kind: int
    kind_flag: bool
    vlen: int
    size_or_type: int
    data: int  # offset of the kind's extra data in the type section


class Btf:
    """The types of one BTF blob, indexed by id and by struct/union name.

    The index keeps only each record's offset; a type's name is decoded when
    a lookup reaches it (vmlinux has ~130 k types, and decoding every name
    was most of the 0.4 s a load took).
    """

    def __init__(self, blob: bytes, source: str = "BTF") -> None:
        self.source = source
        if len(blob) < 24:
            raise BtfError(f"{source}: too short for a BTF header")
        magic, _version, _flags, hdr_len = struct.unpack_from("<HBBI", blob, 0)
        if magic != BTF_MAGIC:
            raise BtfError(f"{source}: not BTF (magic 0x{magic:04x}, or other-endian)")
        type_off, type_len, str_off, str_len = struct.unpack_from("<IIII", blob, 8)
        self._types = blob[hdr_len + type_off : hdr_len + type_off + type_len]
        self._strings = blob[hdr_len + str_off : hdr_len + str_off + str_len]
        #: Offset of each type's record in the type section, by id (id 0 is void).
        self._offsets: list[int] = [-1]
        #: Struct and union ids by the offset of their name in the string section.
        self._by_name_off: dict[int, list[int]] = {}
        pos = 0
        data = self._types
        end = len(data) - 12
        unpack = struct.Struct("<III").unpack_from
        offsets = self._offsets
        by_name = self._by_name_off
        while pos <= end:
            name_off, info, _size = unpack(data, pos)
            kind = (info >> 24) & 0x1F
            offsets.append(pos)
            if kind == KIND_STRUCT or kind == KIND_UNION:
                if name_off:
                    by_name.setdefault(name_off, []).append(len(offsets) - 1)
                pos += 12 + 12 * (info & 0xFFFF)
            else:
                fixed, per = _EXTRA.get(kind, (0, 0))
                pos += 12 + fixed + per * (info & 0xFFFF)

    def type(self, type_id: int) -> BtfType | None:
        """Type ``type_id`` (None: void, or out of range)."""
        if not 0 < type_id < len(self._offsets):
            return None
        pos = self._offsets[type_id]
        name_off, info, size = struct.unpack_from("<III", self._types, pos)
        return BtfType(self._string(name_off), (info >> 24) & 0x1F, bool(info >> 31), info & 0xFFFF, size,
                       pos + 12)

    def _named(self, name: str) -> list[int]:
        """Ids of the structs and unions called ``name``."""
        needle = name.encode() + b"\0"
        ids: list[int] = []
        strings = self._strings
        at = 0 if strings.startswith(needle) else -1
        while True:
            if at >= 0:
                ids.extend(self._by_name_off.get(at, ()))
            found = strings.find(b"\0" + needle, at + 1 if at >= 0 else 0)
            if found < 0:
                return ids
            at = found + 1

    @classmethod
    def load(cls, path: Path = VMLINUX) -> Btf:
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            raise BtfError(
                f"{path} is missing: the kernel was built without CONFIG_DEBUG_INFO_BTF; "
                "3.8-3.10 threads cannot be matched by fs base (use a BTF-enabled kernel)"
            ) from None
        except OSError as e:
            raise BtfError(f"{path}: cannot read: {e.strerror}") from e
        return cls(blob, str(path))

    def _string(self, off: int) -> str:
        end = self._strings.find(b"\0", off)
        return self._strings[off : end if end >= 0 else len(self._strings)].decode("utf-8", "replace")

    def _resolve(self, type_id: int) -> tuple[int, BtfType | None]:
        for _ in range(32):
            t = self.type(type_id)
            if t is None or t.kind not in _MODIFIERS:
                return type_id, t
            type_id = t.size_or_type
        return type_id, None

    def _members(self, t: BtfType) -> list[tuple[str, int, int]]:
        """(name, type id, bit offset) of a struct or union."""
        out = []
        for i in range(t.vlen):
            name_off, type_id, offset = struct.unpack_from("<III", self._types, t.data + 12 * i)
            bits = offset & 0xFFFFFF if t.kind_flag else offset
            out.append((self._string(name_off), type_id, bits))
        return out

    def _find(self, t: BtfType, name: str) -> tuple[int, int] | None:
        """(type id, bit offset) of member ``name``, looking into anonymous members."""
        for mname, type_id, bits in self._members(t):
            if mname == name:
                return type_id, bits
            if not mname:
                _, inner = self._resolve(type_id)
                if inner is not None and inner.kind in (KIND_STRUCT, KIND_UNION):
                    found = self._find(inner, name)
                    if found is not None:
                        return found[0], bits + found[1]
        return None

    def member_offset(self, struct_name: str, path: str) -> int:
        """Byte offset of ``path`` (``a.b.c``) inside ``struct struct_name``."""
        ids = self._named(struct_name)
        if not ids:
            raise BtfError(f"{self.source}: no struct {struct_name}")
        t = next((u for u in map(self.type, ids) if u is not None and u.vlen), None)
        if t is None:
            raise BtfError(f"{self.source}: struct {struct_name} has no members (only a declaration)")
        bits = 0
        where = struct_name
        for part in path.split("."):
            if t is None or t.kind not in (KIND_STRUCT, KIND_UNION):
                raise BtfError(f"{self.source}: {where} is not a struct, cannot take .{part}")
            found = self._find(t, part)
            if found is None:
                raise BtfError(f"{self.source}: struct {where} has no member {part}")
            bits += found[1]
            where = f"{where}.{part}"
            _, t = self._resolve(found[0])
        if bits % 8:
            raise BtfError(f"{self.source}: {struct_name}.{path} is a bitfield")
        return bits // 8


def fsbase_offset(path: Path = VMLINUX) -> int:
    """``offsetof(struct task_struct, thread.fsbase)`` of the running kernel (x86-64)."""
    return Btf.load(path).member_offset("task_struct", "thread.fsbase")
