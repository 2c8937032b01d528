"""What compiling a BPF program leaves resident, and that giving it back loses nothing.

A child interpreter (so this test's own memory and libraries stay out of it)
starts a real BpfSampler, measures the compiler libraries' resident code
pages that only it maps (/proc/self/smaps), calls flamed.sampling.memory.release_compiler_memory,
measures again, then compiles and runs a second sampler and drains it: the
paged-out compiler must still work when a reload needs it.

The kernel pages out only pages no other process maps.  The daemon is usually
the only process with libLLVM mapped, but this test's own pytest process has
compiled BPF programs in earlier tests and maps the same pages, which would
make them shared.  So the child loads private copies of the compiler libraries
(LD_LIBRARY_PATH to a directory holding copies under their sonames): the same
code in a file no other process maps, as on a host where only the daemon runs it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from support import ROOT

pytestmark = pytest.mark.bpf

CHILD = r"""
import json, re, time
from flamed.sampling.bpf import BpfSampler, BpfSamplerOptions
from flamed.sampling.memory import COMPILER_LIBS, compiler_mappings, release_compiler_memory

def compiler_rss_kb():
    # Private_Clean: code pages only this process maps (pytest's own process may
    # map the same libraries; pages it shares are not this process's to give back)
    kb, name = 0, ""
    for line in open("/proc/self/smaps"):
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            parts = line.split(None, 5)
            name = parts[5].strip() if len(parts) == 6 else ""
        elif line.startswith("Private_Clean:") and COMPILER_LIBS.search(name):
            kb += int(line.split()[1])
    return kb

def vmrss_kb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])

a = BpfSampler(BpfSamplerOptions(frequency=99))
a.start()
before, rss_before = compiler_rss_kb(), vmrss_kb()
asked = release_compiler_memory()
after, rss_after = compiler_rss_kb(), vmrss_kb()
b = BpfSampler(BpfSamplerOptions(frequency=49))  # compiles again from paged-out code
b.start()
t0 = time.monotonic()
while time.monotonic() - t0 < 1.0:
    sum(i * i for i in range(10000))
w1, w2 = a.drain(), b.drain()
a.close(); b.close()
print(json.dumps({"libs": sorted({p for _, _, p in compiler_mappings()}), "before": before, "after": after, "asked": asked, "rss_before": rss_before,
                  "rss_after": rss_after, "samples": [w1.samples, w2.samples]}))
"""


def _private_compiler_libs(into: Path) -> Path:
    """Copy the compiler libraries libbcc links against into *into*, under their sonames."""
    ldconfig = subprocess.run(["/sbin/ldconfig", "-p"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"libbcc\.so\.0 .*=> (\S+)", ldconfig)
    assert m, "libbcc.so.0 not in the linker cache"
    ldd = subprocess.run(["ldd", m.group(1)], capture_output=True, text=True, check=True).stdout
    copied = 0
    for soname, path in re.findall(r"^\s*(lib(?:LLVM|clang)\S*\.so\S*) => (\S+)", ldd, re.M):
        shutil.copyfile(os.path.realpath(path), into / soname)
        # written back, or its page-cache pages count as dirty and stay resident
        fd = os.open(into / soname, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        copied += 1
    assert copied, f"libbcc links no compiler library? ldd said:\n{ldd}"
    return into


@pytest.fixture
def disk_dir() -> Iterator[Path]:
    """A directory on a disk file system (/tmp may be tmpfs, whose pages cannot be paged out without swap)."""
    d = Path(tempfile.mkdtemp(prefix="flamed-libs-", dir="/var/tmp" if os.path.isdir("/var/tmp") else ROOT))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_compiler_pages_are_given_back_and_compiling_again_works(require_bpf: None, disk_dir: Path) -> None:
    libdir = _private_compiler_libs(disk_dir)
    env = dict(os.environ, LD_LIBRARY_PATH=str(libdir))
    r = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True,
                       timeout=180, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads(r.stdout.strip().splitlines()[-1])
    assert m["libs"] and all(p.startswith(str(libdir)) for p in m["libs"]), m["libs"]
    # compiling touched tens of MB of libLLVM/libclang code; most of it is dropped
    assert m["before"] > 20_000, m
    assert m["asked"] > 0, m
    assert m["after"] < m["before"] / 3, m
    assert m["rss_after"] < m["rss_before"] - (m["before"] - m["after"]) // 2, m
    # both samplers sampled this busy child: nothing was lost by paging out
    assert all(s > 0 for s in m["samples"]), m
