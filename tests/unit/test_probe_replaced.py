"""probe() of an interpreter replaced on disk while it runs (a package
upgrade): its maps name ``libpython3.X.so.1.0 (deleted)``, which opens only
through /proc/PID/map_files, and whose version (3.8-3.10 have no Py_Version)
comes from the name without the suffix."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from cpython_support import need_debian_311, need_pyenv

from flamed.sampling.cpython.process import Target, _version_from_name, probe
from support import ROOT, need


def test_version_from_a_deleted_files_name() -> None:
    assert _version_from_name("/usr/bin/python3.9 (deleted)") == (3, 9)
    assert _version_from_name("/usr/lib/libpython3.10.so.1.0 (deleted)") == (3, 10)
    assert _version_from_name("/usr/bin/python3.9") == (3, 9)
    assert _version_from_name("/usr/bin/sh (deleted)") is None


def test_probe_of_a_process_whose_libpython_was_replaced(tmp_path: Path) -> None:
    need(os.geteuid() == 0, "root (/proc/PID/map_files needs CAP_CHECKPOINT_RESTORE or CAP_SYS_ADMIN)")
    prefix = need_pyenv("3.10")
    lib = tmp_path / "libpython3.10.so.1.0"
    shutil.copy2(prefix / "lib" / lib.name, lib)
    p = subprocess.Popen([str(prefix / "bin" / "python3.10"), "-c", "import time; time.sleep(30)"],
                         env=dict(os.environ, LD_LIBRARY_PATH=str(tmp_path)))
    try:
        maps = Path(f"/proc/{p.pid}/maps")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and str(lib) not in maps.read_text():
            time.sleep(0.02)
        lib.unlink()
        lib.write_bytes(b"an upgrade's new file")  # another inode at the same path
        text = maps.read_text()
        assert f"{lib} (deleted)" in text, text
        r = probe(p.pid)
        assert isinstance(r, Target), r
        assert r.version == (3, 10) and r.interpreter == f"{lib} (deleted)"
    finally:
        p.kill()
        p.wait()


def test_a_proc_of_another_pid_namespace_is_refused(tmp_path: Path) -> None:
    """flamed inside a container with a PID namespace of its own: the kernel's
    host pids are not what its /proc shows; the sampler says so and how to
    run it, instead of attributing nothing (or to the wrong processes)."""
    import pytest

    from flamed.errors import CapabilityError
    from flamed.sampling.program import _check_pid_namespace

    (tmp_path / "1" / "ns").mkdir(parents=True)
    (tmp_path / "1" / "ns" / "pid").write_text("")  # its inode is not the initial namespace's
    with pytest.raises(CapabilityError, match=r"PID namespace other than the host's .*hostPID"):
        _check_pid_namespace(str(tmp_path))
    _check_pid_namespace("/proc")  # this machine: the host's


PROBE_WITHOUT_CAPS = """
import os, sys
from flamed.sampling.cpython.process import Target, probe
from flamed.sampling.mappedfile import mapped_file
pid = int(sys.argv[1])
m = next(ln.split() for ln in open(f"/proc/{pid}/maps") if ln.rstrip().endswith("(deleted)"))
start, end = (int(x, 16) for x in m[0].split("-"))
try:
    os.stat(f"/proc/{pid}/map_files/{start:x}-{end:x}")
    print("map_files opens")
except PermissionError:
    print("map_files refused")
print(mapped_file(pid, " ".join(m[5:]), int(m[4]), start, end))
r = probe(pid)
print(isinstance(r, Target) and r.version == (3, 11), getattr(r, "reason", ""))
"""


def test_a_replaced_executable_opens_as_proc_exe_without_the_capability(tmp_path: Path) -> None:
    """A static interpreter (Debian's python3.11) deleted while it runs: its
    file opens as /proc/PID/exe, which needs no more than the rest of
    /proc/PID; /proc/PID/map_files needs CAP_CHECKPOINT_RESTORE (or
    CAP_SYS_ADMIN).  Probed by a process without either, it is read all the same."""
    need(os.geteuid() == 0, "root")
    need(shutil.which("setpriv") is not None, "setpriv (util-linux)")
    exe = tmp_path / "python3.11-replaced"
    shutil.copy2(need_debian_311(), exe)
    p = subprocess.Popen([str(exe), "-c", "import time; time.sleep(30)"])
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and str(exe) not in Path(f"/proc/{p.pid}/maps").read_text():
            time.sleep(0.02)
        exe.unlink()
        r = subprocess.run(["setpriv", "--bounding-set=-checkpoint_restore,-sys_admin", sys.executable, "-c",
                            PROBE_WITHOUT_CAPS, str(p.pid)], capture_output=True, text=True, timeout=60, cwd=ROOT)
    finally:
        p.kill()
        p.wait()
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["map_files refused", f"/proc/{p.pid}/exe", "True "], r.stdout
