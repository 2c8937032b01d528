"""Finding the real CPython builds the tests of flamed/sampling/cpython/ run against.

pyenv builds (with DWARF in libpython) under ``$(pyenv root)/versions/`` and
Debian's /usr/bin/python3.11 (static libpython, stripped).  A missing one
skips, or fails under FLAMED_REQUIRE_BPF=1 (see support.need).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from support import need

VERSIONS = ("3.8", "3.9", "3.10", "3.11", "3.12", "3.13")
DEBIAN_311 = Path("/usr/bin/python3.11")


def pyenv_root() -> Path:
    env = os.environ.get("PYENV_ROOT")
    if env:
        return Path(env)
    exe = shutil.which("pyenv")
    if exe:
        try:
            out = subprocess.run([exe, "root"], capture_output=True, text=True, timeout=10, check=True)
            return Path(out.stdout.strip())
        except (OSError, subprocess.SubprocessError):
            pass
    return Path("/root/.pyenv")


def pyenv_prefix(minor: str) -> Path | None:
    versions = pyenv_root() / "versions"
    if not versions.is_dir():
        return None
    found = sorted(p for p in versions.iterdir() if p.name.startswith(minor + ".") and p.name.count(".") == 2)
    return found[-1] if found else None


def need_pyenv(minor: str) -> Path:
    """The prefix of pyenv's newest ``minor`` build (skip/fail when missing)."""
    prefix = pyenv_prefix(minor)
    need(prefix is not None and (prefix / "bin" / f"python{minor}").exists(), f"pyenv CPython {minor}")
    assert prefix is not None
    return prefix


def pyenv_python(minor: str) -> Path:
    return need_pyenv(minor) / "bin" / f"python{minor}"


def libpython(minor: str) -> Path:
    prefix = need_pyenv(minor)
    lib = prefix / "lib" / f"libpython{minor}.so.1.0"
    need(lib.exists(), f"pyenv CPython {minor} shared library {lib}")
    return lib


def need_debian_311() -> Path:
    need(DEBIAN_311.exists(), "Debian's /usr/bin/python3.11")
    return DEBIAN_311


def gdb_values(binary: Path, exprs: list[str]) -> list[int]:
    """Evaluate ``exprs`` (integer expressions over the binary's DWARF types) with gdb."""
    gdb = shutil.which("gdb")
    need(gdb is not None, "gdb (to check layout tables against DWARF)")
    assert gdb is not None
    args = [gdb, "-batch", "-nx", "-iex", "set debuginfod enabled off"]
    for e in exprs:
        args += ["-ex", f"print/d (long)({e})"]
    out = subprocess.run(args + [str(binary)], capture_output=True, text=True, timeout=120)
    values = []
    for line in out.stdout.splitlines():
        if line.startswith("$"):
            values.append(int(line.split("=", 1)[1]))
    assert len(values) == len(exprs), f"gdb answered {len(values)} of {len(exprs)}: {out.stderr[-2000:]}"
    return values
