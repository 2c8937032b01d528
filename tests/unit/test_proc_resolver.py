"""flamed's per-process resolver (flamed/sampling/symbols.py ProcResolver):
perf maps and the vDSO, in this very process, and no stray fd closed."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest

from flamed.sampling.symbols import ProcResolver, host_vdso
from support import have_bcc, need


@pytest.fixture
def perf_map() -> object:
    path = Path(f"/tmp/perf-{os.getpid()}.map")
    if path.exists():
        pytest.skip(f"{path} exists already")
    yield path
    path.unlink(missing_ok=True)


def test_perf_map_names_jit_code_and_follows_its_growth(perf_map: Path) -> None:
    code = mmap.mmap(-1, 8192, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    try:
        import ctypes

        base = ctypes.addressof(ctypes.c_char.from_buffer(code))
        perf_map.write_text(f"{base:x} 100 jitted_first\n{base + 0x100:x} 80 py::spin:/app/x.py\nnot a line\n")
        r = ProcResolver(os.getpid())
        name, module = r.resolve(base + 0x10)
        assert name == b"jitted_first" and module is not None and module.endswith(f"/tmp/perf-{os.getpid()}.map".encode())
        assert r.resolve(base + 0x17f)[0] == b"py::spin:/app/x.py"
        name, module = r.resolve(base + 0x1000)  # in the mapping, in no entry: the mapping's own name
        assert name is None
        # code reused: a later line for the same start wins, once re-read
        with perf_map.open("a") as f:
            f.write(f"{base:x} 100 jitted_again\n{base + 0x1000:x} 10 late_comer\n")
        r.refresh()
        assert r.resolve(base + 0x10)[0] == b"jitted_again"
        assert r.resolve(base + 0x1004)[0] == b"late_comer"
    finally:
        code.close()


def test_vdso_addresses_are_named() -> None:
    need(have_bcc(), "bcc Python binding (its ELF reader), Debian python3-bpfcc")
    vdso = host_vdso()
    assert vdso is not None
    line = next(ln for ln in Path("/proc/self/maps").read_text().splitlines() if ln.endswith("[vdso]"))
    start = int(line.split("-")[0], 16)
    r = ProcResolver(os.getpid())
    names = {r.resolve(start + off)[0] for off in range(0x400, 0x2000, 0x10)}
    assert any(n and b"gettime" in n for n in names), names
    assert r.resolve(start + 0x400)[1] == b"[vdso]"


def test_no_fd_is_closed_by_making_and_refreshing_resolvers() -> None:
    # bcc's own per-process cache (before 0.33) closes a stray fd each time it
    # is made: here, 40 of them over processes with and without perf maps.
    canaries = [os.pipe() for _ in range(20)]
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()][:40]
        made = []
        for pid in pids:
            try:
                made.append(ProcResolver(pid))
            except OSError:
                continue
        for r in made:
            r.refresh()
            r.close()
        for a, b in canaries:
            os.fstat(a)
            os.fstat(b)
    finally:
        for a, b in canaries:
            os.close(a)
            os.close(b)
