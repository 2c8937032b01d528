"""flamed.sampling.symbols.ElfSymbols on real shared libraries: one entry per
address, its largest size, the plainest of its names, as a reference built
symbol by symbol from the same reader says."""

from __future__ import annotations

import ctypes as ct
from pathlib import Path
from typing import Any

import pytest

from support import have_bcc, need

LIBS = ["/usr/lib/x86_64-linux-gnu/libc.so.6", "/usr/lib/x86_64-linux-gnu/libstdc++.so.6"]


def _reference_all(path: str) -> list[tuple[int, tuple[int, bytes]]]:
    """Every (address, (size, name)) the reader gives, aliases included."""
    from bcc.libbcc import bcc_symbol_option, lib

    out: list[tuple[int, tuple[int, bytes]]] = []

    def on_sym(name: bytes | None, start: int, size: int, _p: Any) -> int:
        if name and start:
            out.append((start, (size, name)))
        return 0

    cb = ct.CFUNCTYPE(ct.c_int, ct.c_char_p, ct.c_uint64, ct.c_uint64, ct.c_void_p)(on_sym)
    opt = bcc_symbol_option(use_debug_file=1, check_debug_file_crc=1, lazy_symbolize=0,
                            use_symbol_type=(1 << 2) | (1 << 10))
    lib.bcc_elf_foreach_sym(path.encode(), ct.cast(cb, ct.c_void_p), ct.byref(opt), None)
    return out


def _reference(path: str) -> dict[int, tuple[int, bytes]]:
    """address -> (largest size, plainest name), one symbol at a time; the
    PLT stubs too (``name@plt``: tests/unit/test_plt.py checks those against objdump)."""
    from flamed.sampling.plt import plt_symbols
    from flamed.sampling.symbols import _alias_rank

    ref: dict[int, tuple[int, bytes]] = {}
    every = _reference_all(path)
    exact: dict[int, bytes] = {}
    for start, (_size, name) in every:
        if start not in exact or _alias_rank(name) < _alias_rank(exact[start]):
            exact[start] = name
    stubs = [(a, (size, name)) for a, size, name in plt_symbols(path, exact.get)]
    assert len(stubs) > 10
    for start, (size, name) in every + stubs:
        old = ref.get(start)
        if old is None:
            ref[start] = (size, name)
        else:
            best = name if _alias_rank(name) < _alias_rank(old[1]) else old[1]
            ref[start] = (max(size, old[0]), best)
    return ref


@pytest.mark.parametrize("path", LIBS)
def test_one_entry_per_address_with_the_plainest_name(path: str) -> None:
    need(have_bcc(), "bcc Python binding (Debian python3-bpfcc, under /usr/bin/python3)")
    need(Path(path).exists(), path)
    from flamed.sampling.symbols import ElfSymbols

    elf = ElfSymbols(path)
    ref = _reference(path)
    assert elf.starts == sorted(ref) and len(elf) > 1000
    assert elf.names == [ref[a][1] for a in elf.starts]
    for i, a in enumerate(elf.starts):
        size = ref[a][0]
        nxt = elf.starts[i + 1] if i + 1 < len(elf.starts) else a + 1
        assert elf.ends[i] == (a + size if size else nxt)


def test_libc_read_is_named_read() -> None:
    need(have_bcc(), "bcc Python binding (Debian python3-bpfcc, under /usr/bin/python3)")
    need(Path(LIBS[0]).exists(), LIBS[0])
    from flamed.sampling.symbols import ElfSymbols

    elf = ElfSymbols(LIBS[0])
    # read, __read and __libc_read share one address: the plain name wins.
    read = elf.starts[elf.names.index(b"read")]
    aliases = [n for a, (_size, n) in _reference_all(LIBS[0]) if a == read]
    assert len(aliases) >= 2 and b"__libc_read" not in elf.names, aliases
