"""Probe, walk and symbolize real CPython processes and compare every frame
with the ground truth the target script writes about itself."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cpython_support import VERSIONS, need_debian_311, pyenv_python
from support import ROOT, have_root, need

from flamed.sampling.cpython import elf
from flamed.sampling.cpython.layout import ENTRY_BIT
from flamed.sampling.cpython.memory import ProcessMemory
from flamed.sampling.cpython.process import Refusal, Target, probe, walk
from flamed.sampling.cpython.symbolize import CodeSymbolizer
from flamed.sampling.cpython.walk import walk_memory

WORKLOAD = ROOT / "tests" / "workloads" / "cpython_frames.py"
WAIT_S = 60.0


def _interpreters() -> list[str]:
    return [*VERSIONS, "debian-3.11"]


def _exe(which: str) -> Path:
    return need_debian_311() if which == "debian-3.11" else pyenv_python(which)


def _wait_for(cond: object, what: str, timeout: float = WAIT_S) -> None:
    assert callable(cond)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def target_script(tmp_path: Path) -> Path:
    # A path with spaces, as co_filename carries it.
    d = tmp_path / "dir with spaces"
    d.mkdir()
    script = d / "frames target.py"
    shutil.copy(WORKLOAD, script)
    return script


@pytest.fixture
def spawn() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)


def _frame(name: str, filename: str, line: int) -> str:
    return f"{name} ({filename}:{line})"


@pytest.mark.parametrize("which", _interpreters())
def test_walk_and_symbolize_match_ground_truth(
    which: str, target_script: Path, spawn: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    need(have_root(), "root (process_vm_readv of another process)")
    exe = _exe(which)
    truth_path = tmp_path / "truth.json"
    proc = subprocess.Popen([str(exe), str(target_script), str(truth_path)])
    spawn.append(proc)
    _wait_for(lambda: truth_path.exists() or proc.poll() is not None, "the target's ground truth")
    assert proc.poll() is None, "the target script exited"
    truth = json.loads(truth_path.read_text())

    target = probe(proc.pid)
    assert isinstance(target, Target), target
    assert target.version == tuple(truth["version"])
    if which == "debian-3.11":
        assert target.interpreter == "/usr/bin/python3.11" and target.hexversion is not None
    else:
        assert os.path.basename(target.interpreter).startswith("libpython")
    assert target.validate().kind == "ready", target.validate()

    key = "native_id" if target.version >= (3, 11) else "ident"
    expected = {t[key]: [_frame(*f) for f in t["frames"]] for t in truth["threads"]}
    # The truth writer thread may still be finishing: wait until only the four remain.
    _wait_for(lambda: set(walk(proc.pid)) == set(expected), "the walk to show the four threads")
    stacks = walk(proc.pid)
    sym = CodeSymbolizer.for_target(target)
    sym.begin_batch()
    got = {k: sym.symbolize(frames) for k, frames in stacks.items()}
    assert got == expected
    assert all(v == 0 for v in sym.stats.values()), sym.stats
    # Outermost frame of a run of the evaluation loop carries the entry bit.
    for frames in stacks.values():
        assert frames[-1][0] & ENTRY_BIT
    if target.version <= (3, 10):
        assert all(c & ENTRY_BIT for c, _ in frames)
    else:
        # Thread.run -> (C) -> run(): a new evaluation loop starts under the C call.
        assert not all(c & ENTRY_BIT for c, _ in frames)

    # The cache keeps serving after the process exited.
    proc.kill()
    proc.wait(timeout=30)
    sym.begin_batch()
    assert {k: sym.symbolize(frames) for k, frames in stacks.items()} == expected


def test_symbolizer_counts_garbage_and_never_raises(spawn: list[subprocess.Popen[bytes]], tmp_path: Path,
                                                    target_script: Path) -> None:
    need(have_root(), "root (process_vm_readv of another process)")
    exe = pyenv_python("3.12")
    truth_path = tmp_path / "truth.json"
    proc = subprocess.Popen([str(exe), str(target_script), str(truth_path)])
    spawn.append(proc)
    _wait_for(lambda: truth_path.exists() or proc.poll() is not None, "the target's ground truth")
    target = probe(proc.pid)
    assert isinstance(target, Target)
    sym = CodeSymbolizer.for_target(target)
    result = walk_memory(ProcessMemory(proc.pid), target.layout, target.interp_addr)
    assert result is not None
    tstate = result.threads[0].tstate
    frames = sym.symbolize([(8, 0), (tstate, 0)])
    assert frames == ["[unknown python code 0x8]", f"[unknown python code 0x{tstate:x}]"]
    assert sym.stats["read_failed"] == 1 and sym.stats["not_code"] == 1


def test_wrong_offset_fails_validation(spawn: list[subprocess.Popen[bytes]], tmp_path: Path,
                                       target_script: Path) -> None:
    need(have_root(), "root (process_vm_readv of another process)")
    exe = pyenv_python("3.11")
    truth_path = tmp_path / "truth.json"
    proc = subprocess.Popen([str(exe), str(target_script), str(truth_path)])
    spawn.append(proc)
    _wait_for(lambda: truth_path.exists() or proc.poll() is not None, "the target's ground truth")
    target = probe(proc.pid)
    assert isinstance(target, Target) and target.validate().kind == "ready"
    for change in ({"frame_code": 40}, {"tstate_native_thread_id": 152}, {"frame_previous": 56}):
        bad = Target(target.pid, target.start_time, target.version, target.hexversion, target.interpreter,
                     target.runtime_addr, target.layout.with_offsets(**change))
        state = bad.validate()
        assert state.kind == "invalid", (change, state)
        assert "does not validate" in state.reason


def test_non_python_process_is_refused_quickly(spawn: list[subprocess.Popen[bytes]]) -> None:
    proc = subprocess.Popen(["sleep", "60"])
    spawn.append(proc)
    _wait_for(lambda: Path(f"/proc/{proc.pid}/exe").exists() and
              os.readlink(f"/proc/{proc.pid}/exe").endswith("sleep"), "sleep to exec")
    cache = elf.ElfCache()
    # Right after exec the kernel names the executable before it maps it: that is "not yet".
    got = probe(proc.pid, cache=cache)
    deadline = time.monotonic() + 10
    while isinstance(got, Refusal) and got.not_yet and time.monotonic() < deadline:
        time.sleep(0.01)
        got = probe(proc.pid, cache=cache)
    assert isinstance(got, Refusal) and not got.not_yet, got
    assert "not a CPython process" in got.reason
    assert cache.parses == 1
    # Cached facts: no file is parsed again.
    probe(proc.pid, cache=cache)
    assert cache.parses == 1


@pytest.mark.parametrize("minor", ["2.7", "3.6", "3.7"])
def test_versions_without_table_are_refused(minor: str, spawn: list[subprocess.Popen[bytes]]) -> None:
    exe = pyenv_python(minor)
    proc = subprocess.Popen([str(exe), "-c", "import sys; sys.stdout.write('up\\n'); sys.stdout.flush(); sys.stdin.read()"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    spawn.append(proc)
    assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
    got = probe(proc.pid)
    assert isinstance(got, Refusal) and not got.not_yet
    assert f"CPython {minor}: no frame layout" in got.reason


_PTRACE_TRACEME = 0
_PTRACE_DETACH = 17


def _traceme() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace(_PTRACE_TRACEME, 0, None, None)


@pytest.mark.parametrize("which", ["3.11", "3.13", "debian-3.11"])
def test_probe_right_after_exec_says_not_yet_then_ready(
    which: str, spawn: list[subprocess.Popen[bytes]], tmp_path: Path, target_script: Path
) -> None:
    need(have_root(), "root (process_vm_readv of another process)")
    exe = _exe(which)
    truth_path = tmp_path / "truth.json"
    # PTRACE_TRACEME: the child stops with SIGTRAP right after execve, before
    # the dynamic loader ran (nothing but the executable and ld.so mapped).
    proc = subprocess.Popen([str(exe), str(target_script), str(truth_path)], preexec_fn=_traceme)
    spawn.append(proc)
    _pid, status = os.waitpid(proc.pid, os.WUNTRACED)
    assert os.WIFSTOPPED(status) and os.WSTOPSIG(status) == signal.SIGTRAP
    try:
        first = probe(proc.pid)
        if which == "debian-3.11":
            # The static build's _PyRuntime is there at exec, but empty.
            assert isinstance(first, Target), first
            assert first.state().kind == "not_yet"
        else:
            assert isinstance(first, Refusal) and first.not_yet, first
    finally:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.ptrace(_PTRACE_DETACH, proc.pid, None, 0)

    def ready() -> bool:
        t = probe(proc.pid)
        return isinstance(t, Target) and t.state().kind == "ready"

    _wait_for(ready, "the interpreter to initialize")
    _wait_for(lambda: truth_path.exists(), "the target's ground truth")
    t = probe(proc.pid)
    assert isinstance(t, Target) and t.validate().kind == "ready"


def test_a_second_process_of_an_interpreter_reads_its_version_after_the_first_exited() -> None:
    """The ELF facts are shared by every process of one interpreter file; the
    version read through them must not depend on the first process still
    being there (its /proc/PID/root path is gone with it)."""
    need(have_root(), "root (another process's /proc/PID/root)")
    exe = need_debian_311()
    cache = elf.ElfCache()
    code = "import sys, time; print('ready', flush=True); time.sleep(30)"
    first = subprocess.Popen([str(exe), "-c", code], stdout=subprocess.PIPE)
    try:
        assert first.stdout is not None and first.stdout.readline().strip() == b"ready"
        t1 = probe(first.pid, cache=cache)
        assert isinstance(t1, Target) and t1.hexversion is not None, t1
    finally:
        first.kill()
        first.wait(timeout=10)
    second = subprocess.Popen([str(exe), "-c", code], stdout=subprocess.PIPE)
    try:
        assert second.stdout is not None and second.stdout.readline().strip() == b"ready"
        t2 = probe(second.pid, cache=cache)
        assert isinstance(t2, Target) and t2.hexversion == t1.hexversion, t2
        assert cache.parses == 1  # the same facts, not a new parse
    finally:
        second.kill()
        second.wait(timeout=10)
