"""Native stacks without frame pointers: tables from .eh_frame, unwound in BPF.

:mod:`ehframe` turns a binary's call frame information into rows,
:mod:`tables` keeps them on disk by build id and in the program's maps, and
bpf/unwind.bpf.c walks the stack with them.  See docs/bpf.md.
"""

from __future__ import annotations

import struct

#: struct flamed_ustack.end values, in order (FLAMED_UW_END_* of bpf/flamed.h).
END_REASONS = ("complete", "no_table", "unsupported_rule", "depth_limit", "read_fault")

_HEAD = struct.Struct("<II")


def parse_ustack(raw: bytes | memoryview) -> tuple[list[int], str]:
    """(addresses leaf first, how the walk ended) of a raw ``struct flamed_ustack``."""
    n, end = _HEAD.unpack_from(raw)
    depth = (len(raw) - _HEAD.size) // 8
    n = min(n, depth)
    ips = list(struct.unpack_from(f"<{n}Q", raw, _HEAD.size))
    return ips, END_REASONS[end] if end < len(END_REASONS) else "read_fault"


def truncated_frame(reason: str) -> str:
    """The root frame of a stack whose unwinding stopped early: ``[truncated: no table]``."""
    return f"[truncated: {reason.replace('_', ' ')}]"


#: Functions a complete user stack begins with: the program's entry, the C
#: library's start and thread entry points, Go's and Rust's runtimes.
_OUTERMOST = frozenset({
    "_start", "__libc_start_main", "__libc_start_call_main", "__libc_start_main_impl",
    "clone", "clone3", "__clone", "__clone3", "__GI___clone", "__GI___clone3", "start_thread",
    "runtime.goexit", "runtime.goexit.abi0", "runtime.rt0_go", "runtime.rt0_go.abi0", "runtime.mstart",
    "runtime.mstart.abi0", "thread_start", "_dl_start_user",
})


def is_outermost(frame: str) -> bool:
    """Is ``frame`` one a complete user stack can begin with?"""
    return frame in _OUTERMOST
