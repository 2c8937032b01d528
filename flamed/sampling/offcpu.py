"""Off-CPU records as the program writes them (bpf/offcpu.bpf.c, structs in
bpf/flamed.h) and how an off-CPU stack is shown: the tracing frames above
``__schedule`` cut, and why the task left the CPU as its leaf."""

from __future__ import annotations

import struct

from flamed.model import KERNEL_SUFFIX, Stack
from flamed.procstat import running

#: The leaf frame of an off-CPU stack: why the task left the CPU.
OFFCPU_BLOCKED_FRAME = "[off-cpu: blocked]"
OFFCPU_PREEMPTED_FRAME = "[off-cpu: preempted]"
#: ... blocked waiting for the interpreter's GIL (a CPython thread read in BPF).
OFFCPU_GIL_FRAME = "[gil wait]"
_OFF_PREEMPTED = 1  # FLAMED_OFF_PREEMPTED
_OFF_GIL = 2  # FLAMED_OFF_GIL
# struct flamed_offcpu_start, flamed_offcpu_key, flamed_offcpu_carry_key of bpf/flamed.h.
OFF_START = struct.Struct("<QQQIIiiII16s")
OFF_KEY = struct.Struct("<IIii16sQQQQII")
OFF_CARRY_KEY = struct.Struct("<IIQ")
#: One open wait as the program remembered it: start ktime, Python stack id,
#: cgroup id, epoch, tgid, kernel stack id, user stack id, flags, raw comm.
OffStart = tuple[int, int, int, int, int, int, int, int, bytes]


def off_start(raw: bytes) -> OffStart:
    kt, py, cg, epoch, tgid, kid, uid, flags, _pad, comm = OFF_START.unpack(raw)
    return (kt, py, cg, epoch, tgid, kid, uid, flags, comm)


def thread_alive(tgid: int, tid: int) -> bool:
    return running(f"/proc/{tgid}/task/{tid}/stat")


def offcpu_frame(flags: int) -> str:
    """The leaf frame saying why a task left the CPU."""
    if flags & _OFF_GIL:
        return OFFCPU_GIL_FRAME
    return OFFCPU_PREEMPTED_FRAME if flags & _OFF_PREEMPTED else OFFCPU_BLOCKED_FRAME


#: Leaf kernel frames of the tracing machinery itself (the raw tracepoint's
#: runner and the off-CPU program), above __schedule in every off-CPU stack.
_TRACING_FRAME = ("bpf_prog_", "bpf_trace_run", "__bpf_trace_", "__traceiter_")


def offcpu_stack(stack: Stack, flags: int) -> Stack:
    """An off-CPU stack as shown: the tracing frames cut, the reason as leaf."""
    n = len(stack)
    while n and stack[n - 1].endswith(KERNEL_SUFFIX) and stack[n - 1].startswith(_TRACING_FRAME):
        n -= 1
    return stack[:n] + (offcpu_frame(flags),)
