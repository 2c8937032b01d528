"""The user-space frame walker: the reference the BPF walker is tested against.

It follows exactly the reads ``struct flamed_pyproc`` describes (bpf/flamed.h):
the pointer at ``&_PyRuntime.interpreters.main`` (the main interpreter), its first
thread state, FLAMED_PY_TSTATE_BYTES of each thread state and
FLAMED_PY_FRAME_BYTES of each frame in one read each, and emits the same
(code address | entry bit, raw instruction field) pairs, innermost first.
It takes a layout and an address, never a pid: finding them is
:func:`flamed.sampling.cpython.process.probe`'s, and
:func:`flamed.sampling.cpython.process.walk` does both for a pid.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from flamed.sampling.cpython.layout import ENTRY_BIT, FRAME_BYTES, OWNER_CSTACK, TSTATE_BYTES, Layout
from flamed.sampling.cpython.memory import ProcessMemory

#: Bounds of one walk (the BPF program has its own, smaller, loop bounds).
MAX_THREADS = 256
MAX_DEPTH = 512

Frame = tuple[int, int]


@dataclass(frozen=True, slots=True)
class ThreadFrames:
    """One thread state and its frames (innermost first)."""

    tstate: int
    interp: int
    #: PyThreadState.thread_id: pthread_self() of the thread
    thread_id: int
    #: PyThreadState.native_thread_id (the kernel tid), 3.11+
    native_thread_id: int | None
    frames: list[Frame] = field(default_factory=list)
    #: the walk stopped at a frame it could not read
    truncated: bool = False
    #: the walk stopped at its depth bound: the outermost frames are not in ``frames``
    deep: bool = False

    @property
    def key(self) -> int:
        """What the BPF walker matches: the tid on 3.11+, the pthread id before."""
        return self.native_thread_id if self.native_thread_id is not None else self.thread_id


@dataclass(slots=True)
class Walk:
    head: int
    threads: list[ThreadFrames]
    #: a thread state (or the list's head) was unreadable
    truncated: bool = False
    #: the thread list was longer than the walk's bound: the oldest threads are not in ``threads``
    bounded: bool = False


def _u64(data: bytes, off: int) -> int:
    value: int = struct.unpack_from("<Q", data, off)[0]
    return value


def read_head(memory: ProcessMemory, interp_addr: int) -> int | None:
    raw = memory.read(interp_addr, 8)
    return None if raw is None else _u64(raw, 0)


def walk_memory(
    memory: ProcessMemory,
    layout: Layout,
    interp_addr: int,
    *,
    max_threads: int = MAX_THREADS,
    max_depth: int = MAX_DEPTH,
) -> Walk | None:
    """Walk the threads of the interpreter whose pointer is at ``interp_addr``
    (``&_PyRuntime.interpreters.main``: Target.interp_addr); None when that
    pointer is unreadable."""
    head = read_head(memory, interp_addr)
    if head is None:
        return None
    result = Walk(head, [])
    if head == 0:
        return result
    raw = memory.read(head + layout.interp_threads_head, 8)
    if raw is None:
        result.truncated = True
        return result
    tstate = _u64(raw, 0)
    seen: set[int] = set()
    while tstate and tstate not in seen:
        if len(result.threads) >= max_threads:
            result.bounded = True
            break
        seen.add(tstate)
        ts = memory.read(tstate, TSTATE_BYTES)
        if ts is None:
            result.truncated = True
            break
        result.threads.append(_walk_thread(memory, layout, tstate, ts, max_depth))
        tstate = _u64(ts, layout.tstate_next)
    return result


def _walk_thread(memory: ProcessMemory, layout: Layout, tstate: int, ts: bytes, max_depth: int) -> ThreadFrames:
    native = _u64(ts, layout.tstate_native_thread_id) if layout.tstate_native_thread_id is not None else None
    frames: list[Frame] = []
    truncated = False
    ptr = _u64(ts, layout.tstate_frame)
    if layout.cframe_frame is not None and ptr:
        raw = memory.read(ptr + layout.cframe_frame, 8)
        ptr = 0 if raw is None else _u64(raw, 0)
        truncated = raw is None
    every_frame_entry = layout.version <= (3, 10)
    steps = 0
    deep = False
    while ptr:
        if steps >= max_depth:
            deep = True
            break
        steps += 1
        fb = memory.read(ptr, FRAME_BYTES)
        if fb is None:
            truncated = True
            break
        code = _u64(fb, layout.frame_code)
        if layout.instr_size == 8:
            instr = _u64(fb, layout.frame_instr)
        else:
            instr = struct.unpack_from("<I", fb, layout.frame_instr)[0]
        ptr = _u64(fb, layout.frame_previous)
        if layout.frame_owner is not None and fb[layout.frame_owner] == OWNER_CSTACK:
            # A shim the evaluation loop pushed: the frame emitted before it
            # is the first one that loop ran.
            if frames:
                frames[-1] = (frames[-1][0] | ENTRY_BIT, frames[-1][1])
            continue
        entry = every_frame_entry or (layout.frame_is_entry is not None and fb[layout.frame_is_entry] != 0)
        frames.append((code | ENTRY_BIT if entry else code, instr))
    return ThreadFrames(
        tstate=tstate,
        interp=_u64(ts, layout.tstate_interp),
        thread_id=_u64(ts, layout.tstate_thread_id),
        native_thread_id=native,
        frames=frames,
        truncated=truncated,
        deep=deep,
    )
