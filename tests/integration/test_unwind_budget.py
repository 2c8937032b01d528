"""The unwind budget with a real large library: a process that ran libLLVM
(what every bcc tool does while it compiles) and then sits idle must not keep
the rows another process's binaries need (real BPF, real processes)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

import flamed.sampling.unwind.tables as tables
from flamed.sampling.bpf import BpfSampler, BpfSamplerOptions
from flamed.sampling.unwind import ehframe
from support import have_bcc, have_root, need

pytestmark = pytest.mark.usefixtures("require_bpf")

#: Runs libLLVM's C API in a loop (samples land in libLLVM, so its table is
#: loaded), then sleeps alive.
LLVM_THEN_IDLE = """
import ctypes, sys, time
llvm = ctypes.CDLL(sys.argv[1])
llvm.LLVMContextCreate.restype = ctypes.c_void_p
llvm.LLVMContextDispose.argtypes = [ctypes.c_void_p]
llvm.LLVMModuleCreateWithNameInContext.restype = ctypes.c_void_p
llvm.LLVMModuleCreateWithNameInContext.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
llvm.LLVMDisposeModule.argtypes = [ctypes.c_void_p]
end = time.time() + float(sys.argv[2])
while time.time() < end:
    c = llvm.LLVMContextCreate()
    for _ in range(50):
        llvm.LLVMDisposeModule(llvm.LLVMModuleCreateWithNameInContext(b"m", c))
    llvm.LLVMContextDispose(c)
print("idle", flush=True)
time.sleep(120)
"""

BUSY = ("import time\n"
        "def busy_after_llvm():\n"
        "    end = time.time() + 2\n"
        "    while time.time() < end:\n"
        "        sum(i * i for i in range(1000))\n"
        "busy_after_llvm()\n")


def _run_llvm_process(opts: BpfSamplerOptions, llvm: Path, n_llvm: int,
                      then: list[str] | None) -> tuple[int, tables.UnwindStats, dict[tuple[str, ...], int]]:
    """Run the LLVM process to idleness under a sampler with ``opts``, then
    ``then`` (if any) for 2 s; (rows in use once libLLVM was loaded, the
    unwinder's stats at the end, the stacks of ``then``)."""
    with BpfSampler(opts) as s:
        u = s.unwinder
        assert u is not None
        a = subprocess.Popen(["/usr/bin/python3.11", "-c", LLVM_THEN_IDLE, str(llvm), "2"], stdout=subprocess.PIPE)
        b: subprocess.Popen[bytes] | None = None
        try:
            s.add_pid(a.pid)
            assert a.stdout is not None and a.stdout.readline().strip() == b"idle"
            deadline = time.monotonic() + 30  # the builder thread parses libLLVM once (~3 s), then it loads
            while u.stats.rows_used < n_llvm and time.monotonic() < deadline:
                time.sleep(0.2)
            used = u.stats.rows_used
            stacks: dict[tuple[str, ...], int] = {}
            if then is not None and used >= n_llvm:
                s.drain()  # A's busy samples: the drain marks its tables used now
                time.sleep(tables.EVICT_IDLE_S + 0.5)  # A idles: no unwound sample of it since
                s.drain()
                b = subprocess.Popen(then)
                s.add_pid(b.pid)
                assert b.wait(timeout=30) == 0
                w = s.drain()
                stacks = {st: n for (tgid, _t, _c, st), n in w.counts.items() if tgid == b.pid}
            return used, u.stats.copy(), stacks
        finally:
            for p in (a, b):
                if p is not None and p.poll() is None:
                    p.kill()
                    p.wait(timeout=10)


def test_idle_llvm_rows_are_evicted_for_a_new_process(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Rows sized so that a process that ran libLLVM leaves less than
    libpython3.12's table free: once it idles, its libLLVM rows are evicted
    for a Python process, whose stacks are then whole."""
    need(have_root(), "root (BPF and perf events)")
    need(have_bcc(), "bcc Python binding (Debian python3-bpfcc, under /usr/bin/python3)")
    llvm = sorted(Path("/usr/lib/x86_64-linux-gnu").glob("libLLVM-1*.so.1"))
    need(bool(llvm), "a libLLVM (Debian libllvm*, installed with bcc)")
    py312 = sorted(Path.home().glob(".pyenv/versions/3.12*/bin/python3.12"))
    need(bool(py312), "pyenv's 3.12 (libpython3.12.so)")
    libpy = sorted(py312[-1].parent.parent.glob("lib/libpython3.12.so*"))
    need(bool(libpy), "pyenv's libpython3.12.so")
    cache = tmp_path / "unwind-cache"
    tc = tables.TableCache(cache)
    n_llvm = len(tc.rows(str(llvm[-1]), ehframe.read_elf_info(str(llvm[-1])))[1]) // ehframe.ROW.size
    n_libpy = len(tc.rows(str(libpy[-1]), ehframe.read_elf_info(str(libpy[-1])))[1]) // ehframe.ROW.size
    monkeypatch.setattr(tables, "EVICT_IDLE_S", 3.0)
    # 1: how many rows the LLVM process takes here (libLLVM, python3.11, libc, libstdc++, ...).
    used_a, _st, _ = _run_llvm_process(BpfSamplerOptions(frequency=199, pids=frozenset(), unwind=True,
                                                         unwind_rows=n_llvm * 4, unwind_cache_dir=cache),
                                       llvm[-1], n_llvm, None)
    assert used_a >= n_llvm, "libLLVM's table was never loaded for a process running it"
    # 2: room for that and half of libpython3.12.
    opts = BpfSamplerOptions(frequency=199, pids=frozenset(), unwind=True, unwind_rows=used_a + n_libpy // 2,
                             unwind_cache_dir=cache)
    used, st, stacks = _run_llvm_process(opts, llvm[-1], n_llvm, [str(py312[-1]), "-c", BUSY])
    assert used >= n_llvm, ("libLLVM's table was not loaded in the second run", st)
    total0 = sum(stacks.values()); nt0 = sum(n for stack, n in stacks.items() if "[truncated: no table]" in stack)
    assert st.evicted >= 1 and st.evicted_rows >= n_llvm, (st.skipped, total0, nt0, sorted(stacks.items(), key=lambda x: -x[1])[:2])
    total = sum(stacks.values())
    no_table = sum(n for stack, n in stacks.items() if "[truncated: no table]" in stack)
    assert total >= 100, total
    assert no_table / total <= 0.05, (no_table, total, sorted(stacks.items(), key=lambda x: -x[1])[:3])
