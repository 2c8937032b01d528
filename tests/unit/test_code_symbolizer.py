"""CodeSymbolizer's batch index of finished frames, on this test process's own
code objects (process_vm_readv of oneself needs no privilege)."""

from __future__ import annotations

import os
import random
from typing import Any

import pytest

from flamed.sampling.cpython.layout import code_guard
from flamed.sampling.cpython.process import Target, probe
from flamed.sampling.cpython.symbolize import CodeSymbolizer
from flamed.sampling.pyframes import (
    ENTRY_BIT,
    PYSTACK_READ_FAULT,
    PYSTACK_TRUNCATED,
    READ_FAULT_FRAME,
    TRUNCATED_FRAME,
    runs_root_first,
    splice,
)
from flamed.sampling.pystack import EVAL_FRAME, native_below_interpreter


def _alpha() -> int:
    return 1


def _beta() -> int:
    return 2


@pytest.fixture(scope="module")
def target() -> Target:
    t = probe(os.getpid())
    if not isinstance(t, Target) or t.layout.code_adaptive is None:
        pytest.skip(f"this interpreter is not one the walker reads with instruction pointers: {t}")
    return t


def _frames(target: Target, fn: object, units: int = 0, entry: bool = False) -> tuple[int, int]:
    code = id(fn.__code__)  # type: ignore[attr-defined]
    assert target.layout.code_adaptive is not None
    return (code | (ENTRY_BIT if entry else 0), code + target.layout.code_adaptive + 2 * units)


def _name(fn: object) -> str:
    c = fn.__code__  # type: ignore[attr-defined]
    return f"{c.co_qualname} ({c.co_filename}:{c.co_firstlineno})"


def test_a_batch_names_a_known_stack_without_reading(target: Target) -> None:
    sym = CodeSymbolizer.for_target(target)
    sym.begin_batch()
    stack = [_frames(target, _alpha), _frames(target, _beta, entry=True)]
    first = sym.symbolize(stack)
    assert first == [_name(_alpha), _name(_beta)]
    reads = sym.memory.syscalls
    assert sym.symbolize(list(stack)) == first
    assert sym.memory.syscalls == reads  # answered from the batch's index
    sym.begin_batch()
    assert sym.symbolize(stack) == first
    assert sym.memory.syscalls > reads  # a new batch checks each code object again


def test_a_stale_code_object_is_not_named_from_the_index(target: Target) -> None:
    sym = CodeSymbolizer.for_target(target)
    sym.begin_batch()
    frame = _frames(target, _alpha)
    assert sym.symbolize([frame]) == [_name(_alpha)]
    code = frame[0]
    # As if the code object's memory held another object when the entry was
    # read: the guard no longer matches, and the index says something else.
    sym._cache[code].guard = b"\0" * len(sym._cache[code].guard)  # noqa: SLF001
    sym._cache[code].frames.clear()  # noqa: SLF001
    sym._named[frame] = "old (gone.py:1)"  # noqa: SLF001
    # A stack seen for the first time re-reads its code objects, even within the batch.
    assert sym.symbolize_fresh([frame]) == [_name(_alpha)]
    assert sym.stats["stale"] == 1
    assert sym.symbolize([frame]) == [_name(_alpha)]
    # And a new batch re-checks what the index named in the last one.  The
    # batch's stacks may have been sampled before the change: neither name
    # is sure for them, so the frame says so until the next batch.
    sym._cache[code].guard = b"\0" * len(sym._cache[code].guard)  # noqa: SLF001
    sym._named[frame] = "old (gone.py:1)"  # noqa: SLF001
    sym.begin_batch()
    assert sym.symbolize([frame]) == [f"[stale python code 0x{code:x}]"]
    assert sym.stats["stale"] == 2
    # A stack seen for the first time still gets the name of what is there now.
    assert sym.symbolize_fresh([frame]) == [_name(_alpha)]
    assert sym.symbolize([frame]) == [f"[stale python code 0x{code:x}]"]
    sym.begin_batch()
    assert sym.symbolize([frame]) == [_name(_alpha)]


def _guard_of(fn: object) -> int:
    """The guard bpf/python.bpf.c reads for a frame of ``fn``: from the code
    object's fields as this process sees them (ids are addresses)."""
    c = fn.__code__  # type: ignore[attr-defined]
    return code_guard(id(c.co_qualname), id(c.co_filename), c.co_firstlineno)


def test_a_frame_whose_guard_matches_is_named_by_its_code_object(target: Target) -> None:
    """The guard the symbolizer computes from the bytes it reads is the one
    made of the code object's fields (the layout's offsets are right), and a
    cached code object with the sample's guard names the frame without a read."""
    sym = CodeSymbolizer.for_target(target)
    sym.begin_batch()
    stack = [_frames(target, _alpha), _frames(target, _beta, entry=True)]
    guards = [_guard_of(_alpha), _guard_of(_beta)]
    assert guards[0] != guards[1]
    assert sym.symbolize_fresh(stack, guards=guards) == [_name(_alpha), _name(_beta)]
    assert sym.stats["guard_stale"] == 0
    reads = sym.memory.syscalls
    # A new stack (recheck) would read every cached code object again; their guards say they need not.
    assert sym.symbolize_fresh(stack, guards=guards) == [_name(_alpha), _name(_beta)]
    sym.begin_batch()
    assert sym.symbolize(stack, guards=guards) == [_name(_alpha), _name(_beta)]
    assert sym.memory.syscalls == reads
    # A cached code object whose memory changed since (guard bytes): the sample's guard is
    # still the cached one's, so the name is still the sampled code object's.
    code = stack[0][0]
    sym._cache[code].guard = b"\0" * len(sym._cache[code].guard)  # noqa: SLF001
    sym.begin_batch()
    assert sym.symbolize(stack, guards=guards) == [_name(_alpha), _name(_beta)]


def test_a_frame_whose_guard_differs_is_marked_stale_not_named(target: Target) -> None:
    """The code object at the address is not the sampled one (freed, another
    made there): the marker, on a new stack and at the drain; a guard of 0
    (not read) names as without guards."""
    sym = CodeSymbolizer.for_target(target)
    sym.begin_batch()
    stack = [_frames(target, _alpha), _frames(target, _beta)]
    other = _guard_of(_beta) ^ 0x5A5A  # as if another code object had been sampled at _alpha's address
    code = stack[0][0]
    for name in ("symbolize_fresh", "symbolize", "symbolize"):
        got = getattr(sym, name)(stack, guards=[other, _guard_of(_beta)])
        assert got == [f"[stale python code 0x{code:x}]", _name(_beta)], name
    assert sym.stats["guard_stale"] >= 2
    assert sym.symbolize(stack, guards=[0, _guard_of(_beta)]) == [_name(_alpha), _name(_beta)]
    assert sym.symbolize(stack) == [_name(_alpha), _name(_beta)]
    # Guards that do not fit the frames are not used (a value cut short).
    assert sym.symbolize(stack, guards=[other]) == [_name(_alpha), _name(_beta)]


class _FreedAt:
    """This process's memory, except that the object at ``addr`` reads as freed
    once ``freed`` is set: its first word is the allocator's free-list pointer,
    every other byte as it was (a freed code object keeps its fields, so its
    guard, until its memory is reused)."""

    def __init__(self, inner: Any, addr: int) -> None:
        self.inner, self.addr, self.freed = inner, addr, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _patch(self, addr: int, data: bytes | None) -> bytes | None:
        if self.freed and data is not None and addr == self.addr:
            return (0x7F1234567000).to_bytes(8, "little") + data[8:]
        return data

    def read(self, addr: int, size: int) -> bytes | None:
        return self._patch(addr, self.inner.read(addr, size))

    def read_many(self, pieces: Any) -> list[bytes | None]:
        return [self._patch(a, d) for (a, _n), d in zip(pieces, self.inner.read_many(pieces))]


def test_a_freed_code_object_is_not_named_from_its_memory(target: Target) -> None:
    """A freed code object still holds its fields (its guard matches the
    sample's) but its name string may be another object by now: it is named
    only from what was read while it lived, else ``[unknown python code]``."""
    from flamed.sampling.cpython.memory import ProcessMemory

    frame = _frames(target, _alpha)
    code = frame[0]
    mem = _FreedAt(ProcessMemory(os.getpid()), code)
    sym = CodeSymbolizer(target.pid, target.start_time, target.layout, memory=mem)  # type: ignore[arg-type]
    mem.freed = True
    sym.begin_batch()
    assert sym.symbolize_fresh([frame], guards=[_guard_of(_alpha)]) == [f"[unknown python code 0x{code:x}]"]
    assert sym.symbolize([frame]) == [f"[unknown python code 0x{code:x}]"]
    assert sym.stats["freed"] >= 2
    # Read while it lived: that name stands for its samples after it was freed.
    mem.freed = False
    assert sym.symbolize_fresh([frame], guards=[_guard_of(_alpha)]) == [_name(_alpha)]
    mem.freed = True
    sym.begin_batch()
    assert sym.symbolize_fresh([frame], guards=[_guard_of(_alpha)]) == [_name(_alpha)]
    assert sym.symbolize([frame], guards=[_guard_of(_alpha)]) == [_name(_alpha)]


def test_an_instruction_outside_the_code_object_is_not_named_by_it(target: Target) -> None:
    """A frame whose instruction lies past the end of the code object at its
    address was another code object's (that one freed, this one made there)."""
    sym = CodeSymbolizer.for_target(target)
    sym.begin_batch()
    units = len(_alpha.__code__.co_code) // 2
    inside = _frames(target, _alpha, units - 1)
    outside = _frames(target, _alpha, units + 40)
    start = (inside[0], inside[0] + target.layout.code_adaptive - 2)  # type: ignore[operator]
    got = sym.symbolize([inside, start, outside])
    # The last unit, and one before the first (a frame not started yet), are its own.
    assert got[0].startswith(f"{_alpha.__qualname__} (") and got[1] == _name(_alpha)
    assert got[2] == f"[stale python code 0x{inside[0]:x}]"
    assert sym.stats["outside_code"] == 1


def test_an_evicted_code_object_leaves_the_index(target: Target) -> None:
    sym = CodeSymbolizer(target.pid, target.start_time, target.layout, max_entries=1)
    sym.begin_batch()
    a, b = _frames(target, _alpha), _frames(target, _beta)
    assert sym.symbolize([a]) == [_name(_alpha)]
    assert sym.symbolize([b]) == [_name(_beta)]  # evicts _alpha
    assert a not in sym._named  # noqa: SLF001
    reads = sym.memory.syscalls
    assert sym.symbolize([a]) == [_name(_alpha)]
    assert sym.memory.syscalls > reads


def test_the_same_instruction_gives_the_same_line(target: Target) -> None:
    sym = CodeSymbolizer.for_target(target)
    sym.begin_batch()
    units = len(_alpha.__code__.co_code) // 2
    stack = [_frames(target, _alpha, u) for u in range(units)]
    once = sym.symbolize(stack)
    sym.begin_batch()
    fresh = CodeSymbolizer.for_target(target)
    fresh.begin_batch()
    assert sym.symbolize(stack) == once == fresh.symbolize(stack)
    lines = {ln for _s, _e, ln in _alpha.__code__.co_lines() if ln is not None}
    assert {int(f.rsplit(":", 1)[1].rstrip(")")) for f in once} <= lines | {_alpha.__code__.co_firstlineno}


def _runs_reference(frames: list[tuple[int, int]], names: list[str], flags: int) -> list[tuple[str, ...]]:
    """What PythonFrames.stack grouped runs with before runs_root_first."""
    runs: list[list[str]] = [[]]
    for (code, _), name in zip(frames, names):
        runs[-1].append(name)
        if code & ENTRY_BIT:
            runs.append([])
    if not runs[-1]:
        runs.pop()
    if flags & PYSTACK_TRUNCATED:
        runs.append([TRUNCATED_FRAME])
    elif flags & PYSTACK_READ_FAULT:
        runs.append([READ_FAULT_FRAME])
    return [tuple(reversed(r)) for r in reversed(runs)]


def test_runs_root_first_groups_as_before() -> None:
    rng = random.Random(21)
    for _ in range(5000):
        n = rng.randrange(0, 12)
        frames = [(rng.randrange(1, 1 << 20) * 16 | (ENTRY_BIT if rng.random() < 0.3 else 0), 0) for _ in range(n)]
        names = [f"f{i}" for i in range(n)]
        flags = rng.choice([0, 0, PYSTACK_TRUNCATED, PYSTACK_READ_FAULT, PYSTACK_TRUNCATED | PYSTACK_READ_FAULT])
        assert runs_root_first(frames, names, flags) == _runs_reference(frames, names, flags), (frames, flags)


def _splice_reference(user_stack: tuple[str, ...], runs: list[tuple[str, ...]]) -> tuple[str, ...]:
    """splice as it was before its per-frame-name memo (with the perf trampolines'
    frames left out: ``py::...``, ``py_trampoline_evaluator``, a bare ``[unknown]``
    calling an evaluation loop)."""
    if not runs:
        return user_stack
    user_stack = tuple(f for i, f in enumerate(user_stack)
                       if not (f.startswith("py::") or f == "py_trampoline_evaluator"
                               or (f == "[unknown]" and i + 1 < len(user_stack)
                                   and user_stack[i + 1].startswith("_PyEval_EvalFrame")
                                   and EVAL_FRAME.match(user_stack[i + 1]) is not None)))
    evals = [i for i, f in enumerate(user_stack) if EVAL_FRAME.match(f) and f.startswith("_PyEval_EvalFrame")]
    if len(evals) == len(runs):
        out: list[str] = []
        prev = 0
        for i, run in zip(evals, runs):
            out.extend(user_stack[prev:i])
            out.extend(run)
            prev = i + 1
        out.extend(user_stack[prev:])
        return tuple(out)
    return tuple(f for run in runs for f in run) + native_below_interpreter(user_stack)


def test_splice_places_python_frames_as_before() -> None:
    native = ["main", "Py_RunMain", "_PyEval_EvalFrameDefault", "_PyEval_EvalFrameDefault.cold", "PyEval_EvalCode",
              "_PyEval_Vector", "[unknown]", "[unknown] (libc.so.6)", "PyObject_Call", "malloc", "_PyEval_EvalFrameX",
              "py::f:a.py", "py_trampoline_evaluator"]
    rng = random.Random(4)
    for _ in range(5000):
        user = tuple(rng.choice(native) for _ in range(rng.randrange(0, 10)))
        runs = [tuple(f"py{j}_{k} (a.py:{k})" for k in range(rng.randrange(1, 4))) for j in range(rng.randrange(0, 4))]
        assert splice(user, runs) == _splice_reference(user, runs), (user, runs)
