"""PLT stubs named ``function@plt`` (flamed/sampling/plt.py), checked against
binutils' objdump on real binaries, on hostile files, and through the
symbolizer on this very process."""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flamed.sampling.plt import plt_symbols
from support import have_bcc, need

BINARIES = [
    "/usr/lib/x86_64-linux-gnu/libc.so.6",  # .plt with IRELATIVE slots (its own ifuncs)
    "/usr/lib/x86_64-linux-gnu/libstdc++.so.6",  # .plt and .plt.got
    "/usr/bin/python3.11",  # an executable
    str(Path.home() / ".pyenv/versions/3.12.1/lib/libpython3.12.so.1.0"),  # 1,450 stubs
]
_LABEL = re.compile(r"^([0-9a-f]+) <(.+)@plt>:$")
_ABS = re.compile(r"^\*ABS\*\+0x([0-9a-f]+)$")


def _tool(name: str) -> str:
    path = shutil.which(name)
    need(path is not None, f"{name} (Debian binutils)")
    assert path is not None
    return path


def _objdump_stubs(path: str) -> dict[int, str]:
    out = subprocess.run([_tool("objdump"), "-d", "--no-show-raw-insn", path], capture_output=True, text=True,
                         timeout=300, check=True).stdout
    stubs = {}
    for line in out.splitlines():
        m = _LABEL.match(line)
        if m:
            stubs[int(m.group(1), 16)] = m.group(2)
    return stubs


def _function_symbols(path: str) -> dict[int, set[str]]:
    """address -> names of the file's function symbols (readelf), for ifuncs."""
    out = subprocess.run([_tool("readelf"), "-sW", path], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    syms: dict[int, set[str]] = {}
    for line in out.splitlines():
        f = line.split()
        if len(f) >= 8 and f[3] in ("FUNC", "IFUNC") and f[0].endswith(":"):
            syms.setdefault(int(f[1], 16), set()).add(f[7].split("@")[0])
    return syms


@pytest.mark.parametrize("path", BINARIES)
def test_every_stub_objdump_names_is_named_alike(path: str) -> None:
    need(Path(path).exists(), path)
    want = _objdump_stubs(path)
    funcs = _function_symbols(path)
    got = plt_symbols(path, lambda a: min(funcs[a]).encode() if a in funcs else None)
    assert len(want) > 10, want
    by_addr = {a: n.decode() for a, _size, n in got}
    assert set(by_addr) == set(want)
    for addr, name in want.items():
        ifunc = _ABS.match(name)
        if ifunc:
            # objdump shows an ifunc's slot by its resolver's address: that is the function's symbol.
            assert by_addr[addr].removesuffix("@plt") in funcs[int(ifunc.group(1), 16)], (hex(addr), name)
        else:
            assert by_addr[addr] == f"{name}@plt", (hex(addr), name, by_addr[addr])
    assert all(size in (8, 16) for _a, size, _n in got)


def test_hostile_files_give_no_names_and_no_error(tmp_path: Path) -> None:
    src = Path(BINARIES[1])
    need(src.exists(), str(src))
    data = src.read_bytes()
    f = tmp_path / "x.so"
    cases = [b"", b"\x7fELF", b"not an ELF file at all" * 10, data[:64], data[:4096], data[: len(data) // 2]]
    rng = random.Random(5)
    shoff = int.from_bytes(data[40:48], "little")
    for _ in range(40):
        # Flip bytes in the ELF header and the section headers: offsets, sizes, links, entsizes.
        b = bytearray(data)
        for _k in range(rng.randint(1, 8)):
            at = rng.choice([rng.randrange(16, 64), shoff + rng.randrange(0, len(data) - shoff)])
            b[at] = rng.randrange(256)
        cases.append(bytes(b))
    for case in cases:
        f.write_bytes(case)
        got = plt_symbols(str(f))
        assert isinstance(got, list)
    assert plt_symbols(str(tmp_path / "missing")) == []
    assert plt_symbols(str(tmp_path)) == []  # a directory


def test_a_sample_in_a_stub_is_named_after_its_function() -> None:
    """Through the symbolizer, on this process: an address inside a PLT stub
    of its executable.  Before, it took the name of the symbol before the
    stubs (``_init``, size zero)."""
    need(have_bcc(), "bcc Python binding (Debian python3-bpfcc, under /usr/bin/python3)")
    from flamed.sampling.symbols import Symbolizer, read_maps

    exe = os.path.realpath(sys.executable)
    stubs = plt_symbols(exe)
    need(bool(stubs), f"PLT stubs in {exe}")
    out = subprocess.run([_tool("readelf"), "-SW", exe], capture_output=True, text=True, timeout=60, check=True).stdout
    sections = {}
    for line in out.splitlines():
        m = re.search(r"\]\s+(\.\S+)\s+\S+\s+([0-9a-f]+)\s+([0-9a-f]+)\s+([0-9a-f]+)", line)
        if m:
            sections[m.group(1)] = (int(m.group(2), 16), int(m.group(3), 16), int(m.group(4), 16))
    addr, _size, name = stubs[len(stubs) // 2]
    sec_addr, sec_off, _sec_size = next(v for v in sections.values() if v[0] <= addr < v[0] + v[2])
    file_off = sec_off + (addr - sec_addr)
    st = os.stat(exe)
    maps = [m for m in read_maps(os.getpid())
            if m.inode == st.st_ino and m.offset <= file_off < m.offset + m.end - m.start]
    assert maps, "the stub's page is not mapped"
    runtime = maps[0].start + (file_off - maps[0].offset) + 2
    s = Symbolizer()
    try:
        s.begin_drain()
        assert s.user_stack(os.getpid(), [runtime + 1]) == (name.decode(),)
    finally:
        s.close()
