"""The CPython layout tables against the real thing: bpf/flamed.h compiled by
gcc for the packed struct, and each interpreter's DWARF (gdb) for every offset."""

from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

import pytest
from cpython_support import VERSIONS, gdb_values, libpython
from support import ROOT, need

from flamed.sampling.cpython import elf
from flamed.sampling.cpython.errors import LayoutError, UnsupportedVersion
from flamed.sampling.cpython.layout import (
    CODE_BYTES,
    FRAME_BYTES,
    PYPROC_SIZE,
    TSTATE_BYTES,
    Layout,
    layout_for,
    layout_from_debug_offsets,
)

PYPROC_FIELDS = (
    "interp_addr version thread_match flags interp_threads_head tstate_next tstate_thread "
    "tstate_frame cframe_frame frame_code frame_previous frame_instr frame_owner frame_is_entry "
    "owner_cstack instr_size frame_windows guard_len guard_base guard_name guard_file guard_line pad "
    "ns_dev ns_ino gil_lo gil_hi"
).split()
HEADER_DEFINES = (
    "FLAMED_PY_TSTATE_BYTES FLAMED_PY_FRAME_BYTES FLAMED_PY_NONE FLAMED_PY_MATCH_TID "
    "FLAMED_PY_MATCH_FSBASE FLAMED_PY_CFRAME FLAMED_PY_ENTRY_BIT FLAMED_PY_CODE_BYTES"
).split()


def _header_facts(tmp_path: Path) -> dict[str, tuple[int, int]]:
    gcc = shutil.which("gcc")
    need(gcc is not None, "gcc (to compile bpf/flamed.h)")
    assert gcc is not None
    lines = [
        "#include <stdio.h>",
        "#include <stddef.h>",
        "#include <linux/types.h>",
        f'#include "{ROOT / "bpf" / "flamed.h"}"',
        "int main(void) {",
        "struct flamed_pyproc p;",
        'printf("sizeof %zu 0\\n", sizeof(struct flamed_pyproc));',
    ]
    for f in PYPROC_FIELDS:
        lines.append(f'printf("{f} %zu %zu\\n", offsetof(struct flamed_pyproc, {f}), sizeof(p.{f}));')
    for d in HEADER_DEFINES:
        lines.append(f'printf("{d} %llu 0\\n", (unsigned long long)({d}));')
    lines += ["return 0; }"]
    src = tmp_path / "pyproc.c"
    src.write_text("\n".join(lines) + "\n")
    exe = tmp_path / "pyproc"
    subprocess.run([gcc, "-o", str(exe), str(src)], check=True, timeout=60)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True, timeout=10).stdout
    facts = {}
    for line in out.splitlines():
        name, a, b = line.split()
        facts[name] = (int(a), int(b))
    return facts


def test_pack_is_struct_flamed_pyproc(tmp_path: Path) -> None:
    facts = _header_facts(tmp_path)
    assert PYPROC_SIZE == facts["sizeof"][0]
    assert TSTATE_BYTES == facts["FLAMED_PY_TSTATE_BYTES"][0]
    assert FRAME_BYTES == facts["FLAMED_PY_FRAME_BYTES"][0]
    # Every field lands at gcc's offset with gcc's width: values chosen distinct.
    layout = layout_for((3, 11))
    packed = layout.pack(0x7F0011223344, (0x801, 0xEFFFFF00), (0x7F0011220000, 0x7F0011260000))
    assert len(packed) == facts["sizeof"][0]
    widths = {1: "<B", 2: "<H", 8: "<Q"}

    def field(name: str) -> int:
        off, size = facts[name]
        value: int = struct.unpack_from(widths[size], packed, off)[0]
        return value

    assert field("interp_addr") == 0x7F0011223344
    assert field("version") == 0x030B
    assert field("thread_match") == facts["FLAMED_PY_MATCH_TID"][0]
    assert field("flags") == facts["FLAMED_PY_CFRAME"][0]
    assert field("interp_threads_head") == 16
    assert field("tstate_next") == 8
    assert field("tstate_thread") == 160
    assert field("tstate_frame") == 56
    assert field("cframe_frame") == 8
    assert field("frame_code") == 32
    assert field("frame_previous") == 48
    assert field("frame_instr") == 56
    assert field("frame_owner") == facts["FLAMED_PY_NONE"][0]
    assert field("frame_is_entry") == 68
    assert field("instr_size") == 8
    assert field("pad") == 0
    # The guard read (3.11): co_firstlineno at 72 is its start, co_qualname (128) + 8 its end.
    assert (field("guard_base"), field("guard_len")) == (72, 64)
    assert (field("guard_name"), field("guard_file"), field("guard_line")) == (128 - 72, 112 - 72, 0)
    assert field("guard_len") <= facts["FLAMED_PY_CODE_BYTES"][0] == CODE_BYTES
    assert (field("ns_dev"), field("ns_ino")) == (0x801, 0xEFFFFF00)
    assert (field("gil_lo"), field("gil_hi")) == (0x7F0011220000, 0x7F0011260000)
    old = layout_for((3, 9)).pack(1)
    assert struct.unpack_from("<B", old, facts["thread_match"][0])[0] == facts["FLAMED_PY_MATCH_FSBASE"][0]
    assert struct.unpack_from("<B", old, facts["flags"][0])[0] == 0
    assert struct.unpack_from("<H", old, facts["cframe_frame"][0])[0] == facts["FLAMED_PY_NONE"][0]
    assert struct.unpack_from("<B", old, facts["instr_size"][0])[0] == 4
    new = layout_for((3, 12)).pack(1)
    assert struct.unpack_from("<H", new, facts["frame_owner"][0])[0] == 70
    assert struct.unpack_from("<B", new, facts["owner_cstack"][0])[0] == 3


def _dwarf_exprs(minor: str) -> dict[str, str]:
    m = int(minor.split(".")[1])
    frame = "struct _frame" if m <= 10 else "struct _PyInterpreterFrame"
    ex = {
        "runtime_interp_head": "&((struct pyruntimestate*)0)->interpreters.head",
        # The walk's start (a property: head's offset + 8), checked here for every version.
        "runtime_interp_main": "&((struct pyruntimestate*)0)->interpreters.main",
        "interp_threads_head": "&((struct _is*)0)->" + ("tstate_head" if m <= 10 else "threads.head"),
        "tstate_next": "&((struct _ts*)0)->next",
        "tstate_interp": "&((struct _ts*)0)->interp",
        "tstate_thread_id": "&((struct _ts*)0)->thread_id",
        "tstate_frame": "&((struct _ts*)0)->"
        + ("frame" if m <= 10 else "cframe" if m <= 12 else "current_frame"),
        "frame_code": f"&(({frame}*)0)->"
        + ("f_code" if m <= 12 else "f_executable"),
        "frame_previous": f"&(({frame}*)0)->" + ("f_back" if m <= 10 else "previous"),
        "frame_instr": f"&(({frame}*)0)->"
        + ("f_lasti" if m <= 10 else "prev_instr" if m <= 12 else "instr_ptr"),
        "instr_size": f"sizeof((({frame}*)0)->"
        + ("f_lasti" if m <= 10 else "prev_instr" if m <= 12 else "instr_ptr")
        + ")",
        "code_name": "&((PyCodeObject*)0)->co_name",
        "code_filename": "&((PyCodeObject*)0)->co_filename",
        "code_firstlineno": "&((PyCodeObject*)0)->co_firstlineno",
        "code_linetable": "&((PyCodeObject*)0)->" + ("co_lnotab" if m <= 9 else "co_linetable"),
        "object_type": "&((PyObject*)0)->ob_type",
        "type_name": "&((PyTypeObject*)0)->tp_name",
        "unicode_state": "&((PyASCIIObject*)0)->state",
        "unicode_length": "&((PyASCIIObject*)0)->length",
        "unicode_ascii_size": "sizeof(PyASCIIObject)",
        "unicode_compact_size": "sizeof(PyCompactUnicodeObject)",
        "bytes_size": "&((PyBytesObject*)0)->ob_base.ob_size",
        "bytes_sval": "&((PyBytesObject*)0)->ob_sval",
    }
    if m >= 11:
        ex["tstate_native_thread_id"] = "&((struct _ts*)0)->native_thread_id"
        ex["code_qualname"] = "&((PyCodeObject*)0)->co_qualname"
        ex["code_adaptive"] = "&((PyCodeObject*)0)->co_code_adaptive"
    if m in (11, 12):
        ex["cframe_frame"] = "&((struct _PyCFrame*)0)->current_frame"
    if m == 11:
        ex["frame_is_entry"] = f"&(({frame}*)0)->is_entry"
    if m >= 12:
        ex["frame_owner"] = f"&(({frame}*)0)->owner"
    return ex


def _layout_of(minor: str, lib: Path) -> Layout:
    if minor != "3.13":
        return layout_for(tuple(int(x) for x in minor.split(".")))  # type: ignore[arg-type]
    facts = elf.parse(str(lib))
    vaddr, _size = facts.symbols[b"_PyRuntime"]
    data = facts.read(vaddr, 584)
    assert data is not None
    return layout_from_debug_offsets(data)


@pytest.mark.parametrize("minor", VERSIONS)
def test_layout_matches_dwarf(minor: str) -> None:
    """Every offset of the table (3.13: of _Py_DebugOffsets in the file) equals gdb's answer."""
    lib = libpython(minor)
    layout = _layout_of(minor, lib)
    exprs = _dwarf_exprs(minor)
    values = gdb_values(lib, list(exprs.values()))
    expected = dict(zip(exprs, values))
    actual = {name: getattr(layout, name) for name in exprs}
    assert actual == expected
    # Fields the version does not have are None, not a stale number.
    for name in ("tstate_native_thread_id", "code_qualname", "code_adaptive", "cframe_frame",
                 "frame_is_entry", "frame_owner"):
        if name not in exprs:
            assert getattr(layout, name) is None, name
    assert layout.version == tuple(int(x) for x in minor.split("."))


@pytest.mark.parametrize("minor", VERSIONS)
def test_every_version_has_a_guard_read(minor: str) -> None:
    """The fields of a frame's guard (name or qualname, filename, first line)
    fit one read of at most CODE_BYTES in every supported version (3.13: from
    the file's _Py_DebugOffsets), and the packed flamed_pyproc asks for it."""
    layout = _layout_of(minor, libpython(minor)) if minor == "3.13" else _layout_of(minor, Path("/"))
    got = layout.guard_read()
    assert got is not None
    base, length, at_name, at_file, at_line = got
    assert 0 < length <= CODE_BYTES
    assert base + at_name == layout.code_guard_name and base + at_file == layout.code_filename
    assert base + at_line == layout.code_firstlineno
    for at, size in ((at_name, 8), (at_file, 8), (at_line, 4)):
        assert 0 <= at and at + size <= length
    # Beyond one read: no guards (guard_len 0), the process is still walked.
    far = layout.with_offsets(code_filename=layout.code_firstlineno + CODE_BYTES)
    assert far.guard_read() is None
    assert len(far.pack(1)) == PYPROC_SIZE


@pytest.mark.parametrize("version", [(2, 7), (3, 6), (3, 7), (3, 14), (4, 0)])
def test_versions_without_table_are_refused(version: tuple[int, int]) -> None:
    with pytest.raises(UnsupportedVersion, match=f"{version[0]}.{version[1]}: no frame layout"):
        layout_for(version)


def test_layout_beyond_the_bpf_reads_is_refused() -> None:
    bad = layout_for((3, 11)).with_offsets(tstate_native_thread_id=TSTATE_BYTES - 4)
    with pytest.raises(LayoutError, match="tstate_thread at offset 252 is beyond the 256 bytes"):
        bad.pack(1)
    bad = layout_for((3, 12)).with_offsets(frame_owner=FRAME_BYTES)
    with pytest.raises(LayoutError, match="frame_owner"):
        bad.check()


def test_debug_offsets_refused_without_cookie_or_for_other_versions() -> None:
    with pytest.raises(LayoutError, match="xdebugpy"):
        layout_from_debug_offsets(b"\0" * 600)
    data = bytearray(600)
    data[:8] = b"xdebugpy"
    struct.pack_into("<Q", data, 8, 0x030E00F0)  # 3.14.0
    with pytest.raises(UnsupportedVersion, match="3.14"):
        layout_from_debug_offsets(bytes(data))
