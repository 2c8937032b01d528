"""flamed's BTF reader against bpftool's dump of the running kernel's BTF."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from support import need

from flamed.sampling.cpython import btf

BPFTOOL = Path("/usr/sbin/bpftool")


def _bpftool_raw() -> list[str]:
    need(btf.VMLINUX.exists(), f"kernel BTF ({btf.VMLINUX})")
    need(BPFTOOL.exists(), f"bpftool ({BPFTOOL})")
    out = subprocess.run([str(BPFTOOL), "btf", "dump", "file", str(btf.VMLINUX), "format", "raw"],
                         capture_output=True, text=True, timeout=300, check=True)
    return out.stdout.splitlines()


def _member_bits(lines: list[str], header: re.Pattern[str], member: str) -> tuple[int, int]:
    """(type id, bit offset) of ``member`` in the first type whose line matches ``header``."""
    for i, line in enumerate(lines):
        if header.match(line):
            for sub in lines[i + 1 :]:
                if sub.startswith("["):
                    break
                m = re.match(rf"\s+'{member}' type_id=(\d+) bits_offset=(\d+)", sub)
                if m:
                    return int(m.group(1)), int(m.group(2))
            raise AssertionError(f"{member} not in {line}")
    raise AssertionError(f"no type matches {header.pattern}")


def test_fsbase_offset_matches_bpftool() -> None:
    lines = _bpftool_raw()
    thread_type, thread_bits = _member_bits(lines, re.compile(r"\[\d+\] STRUCT 'task_struct' size=\d+ vlen=[1-9]"), "thread")
    _fs_type, fs_bits = _member_bits(lines, re.compile(rf"\[{thread_type}\] STRUCT "), "fsbase")
    assert btf.fsbase_offset() == (thread_bits + fs_bits) // 8
    table = btf.Btf.load()
    # Other members, through the same path code (a nested one and a top-level one).
    _t, pid_bits = _member_bits(lines, re.compile(r"\[\d+\] STRUCT 'task_struct' size=\d+ vlen=[1-9]"), "pid")
    assert table.member_offset("task_struct", "pid") == pid_bits // 8


def test_missing_btf_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(btf.BtfError, match="CONFIG_DEBUG_INFO_BTF"):
        btf.fsbase_offset(tmp_path / "vmlinux")
    bad = tmp_path / "bad"
    bad.write_bytes(b"\0" * 64)
    with pytest.raises(btf.BtfError, match="not BTF"):
        btf.fsbase_offset(bad)
    with pytest.raises(btf.BtfError, match="no member nosuch"):
        btf.Btf.load().member_offset("task_struct", "thread.nosuch")
