"""flamed.sampling.unwind.ehframe against readelf's own reading of the same
call frame information (binutils' `readelf --debug-dump=frames-interp`), and
the on-disk table cache."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from flamed.sampling.unwind import ehframe
from flamed.sampling.unwind.tables import ExecMap, TableCache, mapping_bias
from support import ROOT, need

LIBC = Path("/usr/lib/x86_64-linux-gnu/libc.so.6")


def _readelf_rows(path: Path) -> list[tuple[int, str, str, str]]:
    """(loc, CFA, rbp, ra) of every row readelf prints, within each FDE's range."""
    readelf = shutil.which("readelf")
    need(readelf is not None, "readelf (Debian binutils)")
    assert readelf is not None
    # readelf exits 1 on binaries whose separate debug file is missing (libc),
    # having printed the frames all the same.
    out = subprocess.run([readelf, "-wF", str(path)], capture_output=True, text=True, timeout=300).stdout
    assert "FDE" in out, f"readelf printed no frame information for {path}"
    rows: list[tuple[int, str, str, str]] = []
    cols: list[str] | None = None
    lo = hi = 0
    for line in out.splitlines():
        m = re.search(r"FDE cie=\w+ pc=([0-9a-f]+)\.\.([0-9a-f]+)", line)
        if m:
            lo, hi, cols = int(m[1], 16), int(m[2], 16), None
            continue
        if "CIE" in line:
            cols, lo, hi = None, 0, 0
            continue
        if line.strip().startswith("LOC"):
            cols = line.split()
            continue
        line = re.sub(r"r\d+ \(\w+\)", "reg", line)  # "r10 (r10)": one column
        parts = line.split()
        if cols is None or not parts or not re.fullmatch(r"[0-9a-f]{16}", parts[0]):
            continue
        loc = int(parts[0], 16)
        if not lo or not lo <= loc < hi:
            continue  # readelf also prints a row at the FDE's end, and FDEs of discarded code at 0
        d = dict(zip(cols[1:], parts[1:]))
        rows.append((loc, d.get("CFA", ""), d.get("rbp", "u"), d.get("ra", "u")))
    return rows


def _expected(cfa: str, rbp: str, ra: str) -> tuple[int, ...] | None:
    """The row readelf's columns call for; None: an expression (PLT or unsupported)."""
    if ra == "u":
        return (ehframe.STOP,)
    if ra != "c-8":
        return (ehframe.UNSUPPORTED,)  # the return address in a register (a few hand-written libc routines)
    m = re.fullmatch(r"(rsp|rbp)\+(\d+)", cfa)
    if not m:
        return None if cfa == "exp" else (ehframe.UNSUPPORTED,)
    kind = ehframe.CFA_RSP if m[1] == "rsp" else ehframe.CFA_RBP
    off = int(m[2])
    if off % 8:
        return (ehframe.UNSUPPORTED,)
    if rbp in ("u", "s"):
        return (kind, off, 0)
    r = re.fullmatch(r"c(-\d+)", rbp)
    return (kind, off, int(r[1]) // 8) if r else (ehframe.UNSUPPORTED,)  # Row.rbp counts 8-byte slots


def _binaries(tmp_path: Path) -> list[Path]:
    out = [p for p in (LIBC, Path("/usr/bin/python3.11")) if p.exists()]
    gcc = shutil.which("gcc")
    if gcc:
        chain = tmp_path / "chain"
        subprocess.run([gcc, "-O2", "-fomit-frame-pointer", "-o", str(chain),
                        str(ROOT / "tests" / "workloads" / "unwind" / "chain.c")], check=True, timeout=120)
        out.append(chain)
    need(bool(out), "a binary with .eh_frame (libc, python3.11, or gcc to build one)")
    return out


def test_rows_match_readelf(tmp_path: Path) -> None:
    for path in _binaries(tmp_path):
        table = ehframe.build_table(str(path))
        assert table.source == ".eh_frame" and table.fdes > 0
        rows = _readelf_rows(path)
        assert len(rows) >= 5
        bad = []
        for loc, cfa, rbp, ra in rows:
            got = ehframe.lookup(table.rows, loc)
            want = _expected(cfa, rbp, ra)
            assert got is not None, (path, hex(loc))
            if want is None:
                ok = got.kind in (ehframe.PLT, ehframe.UNSUPPORTED)
            elif len(want) == 1:
                ok = got.kind == want[0]
            else:
                ok = (got.kind, got.cfa, got.rbp) == want
            if not ok:
                bad.append((hex(loc), cfa, rbp, ra, got))
        assert bad == [], (path, bad[:10])


def test_plt_entries_get_the_plt_rule() -> None:
    need(LIBC.exists(), "Debian's libc.so.6")
    table = ehframe.build_table(str(LIBC))
    assert any(r.kind == ehframe.PLT and r.rbp in (10, 11) for r in table.rows)


def test_gaps_between_functions_have_no_rule(tmp_path: Path) -> None:
    """An address after a function's end never inherits its rule."""
    for path in _binaries(tmp_path):
        rows = ehframe.build_table(str(path)).rows
        assert rows[-1].kind == ehframe.NONE
        assert [r.pc for r in rows] == sorted({r.pc for r in rows})


def test_cache_is_by_build_id_and_survives_a_restart(tmp_path: Path) -> None:
    need(LIBC.exists(), "Debian's libc.so.6")
    info = ehframe.read_elf_info(str(LIBC))
    assert re.fullmatch(r"[0-9a-f]{40}", info.build_id)
    first = TableCache(tmp_path)
    key, packed = first.rows(str(LIBC), info)
    assert key == info.build_id and first.built == 1 and first.cached == 0
    assert (tmp_path / f"{key}.uwt").stat().st_size == 16 + len(packed)
    again = TableCache(tmp_path)  # a restart
    assert again.rows(str(LIBC), info) == (key, packed)
    assert again.built == 0 and again.cached == 1
    # A damaged file is rebuilt, not trusted.
    (tmp_path / f"{key}.uwt").write_bytes(b"FLUWT001" + b"\xff" * 20)
    third = TableCache(tmp_path)
    assert third.rows(str(LIBC), info) == (key, packed) and third.built == 1


def test_unwritable_cache_directory_costs_only_a_rebuild(tmp_path: Path) -> None:
    need(LIBC.exists(), "Debian's libc.so.6")
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    cache = TableCache(blocker / "unwind")
    key, packed = cache.rows(str(LIBC), ehframe.read_elf_info(str(LIBC)))
    assert packed and cache.built == 1


def test_not_an_elf_file_is_a_clear_error(tmp_path: Path) -> None:
    p = tmp_path / "script.sh"
    p.write_text("#!/bin/sh\necho hi\n")
    with pytest.raises(ehframe.UnwindTableError, match="not an ELF file"):
        ehframe.read_elf_info(str(p))


def test_bias_takes_the_executable_segment() -> None:
    """lld's layout: the read-only segment ends inside the page where the code
    segment begins, so both hold the mapping's file offset."""
    loads = ((0x0, 0x0, 0x16888, 4), (0x17890, 0x16890, 0x3EED0, 5))
    m = ExecMap(0x7F0000016000, 0x7F0000056000, 0x16000, "fe:00", 1, "/bin/x")
    bias = mapping_bias(loads, m)
    assert bias is not None
    # The code's first byte (file offset 0x16890) is at 0x7f0000016890 and vaddr 0x17890.
    assert 0x7F0000016890 - bias == 0x17890
