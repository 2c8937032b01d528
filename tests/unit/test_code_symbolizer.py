"""CodeSymbolizer's batch index of finished frames, on this test process's own
code objects (process_vm_readv of oneself needs no privilege)."""

from __future__ import annotations

import os
import random

import pytest

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
    """splice as it was before its per-frame-name memo."""
    if not runs:
        return user_stack
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
              "_PyEval_Vector", "[unknown]", "[unknown] (libc.so.6)", "PyObject_Call", "malloc", "_PyEval_EvalFrameX"]
    rng = random.Random(4)
    for _ in range(5000):
        user = tuple(rng.choice(native) for _ in range(rng.randrange(0, 10)))
        runs = [tuple(f"py{j}_{k} (a.py:{k})" for k in range(rng.randrange(1, 4))) for j in range(rng.randrange(0, 4))]
        assert splice(user, runs) == _splice_reference(user, runs), (user, runs)
