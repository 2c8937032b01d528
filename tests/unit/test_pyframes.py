"""flamed/sampling/pyframes.py: runs of Python frames and the splice into native stacks."""

from __future__ import annotations

import random
import struct
from typing import Any

from flamed.sampling.pyframes import (
    PYSTACK_READ_FAULT,
    READ_FAULT_FRAME,
    TRUNCATED_FRAME,
    PythonFrames,
    parse_pystack,
    splice,
)


class _Target:
    interpreter = "/usr/bin/python3.11"
    version = (3, 11)

    class layout:  # noqa: N801 - stands for a Layout
        instr_size = 4

    def validate(self) -> str:
        return "ready"

    def pack(self) -> bytes:
        return b"\0" * 40


class _Names:
    def __init__(self, names: dict[int, str]) -> None:
        self.names = names

    def symbolize(self, frames: Any) -> list[str]:
        return [self.names[c & ~1] for c, _ in frames]


def _frames(names: dict[int, str]) -> PythonFrames:
    pf = PythonFrames(probe=lambda pid: _Target(), symbolizer_factory=lambda pid, t: _Names(names))
    assert isinstance(pf.describe(7), bytes)
    return pf


def test_runs_root_first_split_at_entry_frames() -> None:
    pf = _frames({0x10: "leaf", 0x20: "mid", 0x30: "callback", 0x40: "main"})
    # innermost first; entry bit on the first frame of each evaluation run
    runs = pf.stack(7, [(0x10, 0), (0x20 | 1, 0), (0x30, 0), (0x40 | 1, 0)], 0)
    assert runs == [("main", "callback"), ("mid", "leaf")]


def test_truncated_and_read_fault_are_visible_at_the_root() -> None:
    pf = _frames({0x10: "f"})
    assert pf.stack(7, [(0x10 | 1, 0)], 1)[0] == (TRUNCATED_FRAME,)
    assert pf.stack(7, [(0x10 | 1, 0)], 2)[0] == (READ_FAULT_FRAME,)


def test_unknown_process_gets_placeholders_not_an_error() -> None:
    pf = PythonFrames(probe=lambda pid: None, symbolizer_factory=lambda pid, t: _Names({}))
    assert pf.describe(8) is None and pf.verdict(8) == "not_python"
    assert pf.stack(8, [(0x1230 | 1, 0)], 0) == [("[python code 0x1230]",)]


def test_the_drain_names_a_stack_as_it_was_named_when_new() -> None:
    """A code object named when its stack was new, then freed and its address
    taken by another before the drain: the drain keeps the first name (a
    stack whose names were not kept is named again)."""
    names = {0x10: "<module> (mod.py:3)", 0x20: "importer (main.py:2)"}
    pf = _frames(names)
    stack = [(0x10 | 1, 0), (0x20 | 1, 0)]
    token = pf.warm_token(1)
    pf.warm(7, stack, gen=1, sid=55, token=token)
    names[0x10] = "decoy (other.py:1)"  # the address holds another code object now
    pf.begin_drain(1)
    assert pf.stack(7, stack, 0, sid=55) == [("importer (main.py:2)",), ("<module> (mod.py:3)",)]
    assert pf.stack(7, stack, 0, sid=56) == [("importer (main.py:2)",), ("decoy (other.py:1)",)]
    # Kept for one drain of their generation only, and never from a reading
    # that began before that generation's last drain.
    pf.warm(7, stack, gen=1, sid=57, token=token)
    pf.begin_drain(0)
    pf.begin_drain(1)
    assert pf.stack(7, stack, 0, sid=55) == [("importer (main.py:2)",), ("decoy (other.py:1)",)]
    assert pf.stack(7, stack, 0, sid=57) == [("importer (main.py:2)",), ("decoy (other.py:1)",)]


def test_splice_replaces_each_eval_frame_by_its_run() -> None:
    native = ("_start", "main", "Py_RunMain", "_PyEval_EvalFrameDefault", "PyObject_Call", "cext_fn",
              "_PyEval_EvalFrameDefault", "zlib_compress", "deflate")
    runs = [("<module> (app.py:1)", "handler (app.py:9)"), ("callback (app.py:20)",)]
    assert splice(native, runs) == ("_start", "main", "Py_RunMain", "<module> (app.py:1)", "handler (app.py:9)",
                                    "PyObject_Call", "cext_fn", "callback (app.py:20)", "zlib_compress", "deflate")


def test_splice_without_eval_frames_puts_python_on_top_of_the_leaf() -> None:
    # CPython without frame pointers: the native walk stops near the leaf
    runs = [("main (a.py:1)",), ("f (a.py:5)",)]
    assert splice(("[unknown]", "deflate"), runs) == ("main (a.py:1)", "f (a.py:5)", "deflate")
    # eval frames that do not match the runs: native frames below the innermost one
    native = ("_PyEval_EvalFrameDefault", "PyObject_Call", "deflate")
    assert splice(native, runs) == ("main (a.py:1)", "f (a.py:5)", "PyObject_Call", "deflate")
    assert splice(native, []) == native


def test_a_cut_stack_keeps_its_marker_at_the_root_whichever_way_python_goes_in() -> None:
    """A frame-pointer stack where tables are expected (off-CPU waits, a process
    not described yet) is marked at its root.  Once, when the walk had not reached
    an evaluation loop, the Python frames went on top of the marker, so one Python
    path was drawn under the root in some stacks and under the marker in others."""
    mark = "[truncated: no table]"
    runs = [("<module> (w.py:9)", "main (w.py:8)", "sleep_a_while (w.py:6)")]
    reached = splice((mark, "_PyEval_EvalFrameDefault", "time_sleep", "clock_nanosleep"), runs)
    short = splice((mark, "clock_nanosleep"), runs)
    assert reached == (mark, *runs[0], "time_sleep", "clock_nanosleep")
    assert short == (mark, *runs[0], "clock_nanosleep")
    assert splice((mark,), runs) == (mark, *runs[0])
    # Uncut stacks are as before: no marker appears.
    assert splice(("clock_nanosleep",), runs) == (*runs[0], "clock_nanosleep")


#: A sample of greenlet 3.5 on pyenv 3.12 (a greenlet started by the main
#: greenlet's switch, running work_a), as the unwinder named it: the C stack
#: still holds the main greenlet's evaluation loop above the greenlet's entry,
#: while the thread state holds only the running greenlet's Python frames.
GREENLET_NATIVE = (
    "_start", "__libc_start_main", "Py_BytesMain", "Py_RunMain", "PyEval_EvalCode", "_PyEval_EvalFrameDefault",
    "PyObject_Vectorcall", "method_vectorcall_VARARGS_KEYWORDS", "green_switch(_greenlet*, _object*, _object*)",
    "greenlet::UserGreenlet::g_switch()", "greenlet::UserGreenlet::g_initialstub(void*)",
    "greenlet::UserGreenlet::inner_bootstrap(_greenlet*, _object*)", "_PyEval_EvalFrameDefault", "_PyLong_Add",
    "_PyObject_Malloc")


def test_splice_in_a_greenlet_keeps_its_native_frames_and_the_outer_loop() -> None:
    runs = [("run_a (g.py:12)", "work_a (g.py:4)")]
    assert splice(GREENLET_NATIVE, runs) == (
        *GREENLET_NATIVE[:-3], "run_a (g.py:12)", "work_a (g.py:4)", "_PyLong_Add", "_PyObject_Malloc")
    # greenlet 0.4-1.x, in C
    native = ("_start", "_PyEval_EvalFrameDefault", "green_switch", "g_switch", "g_initialstub",
              "PyObject_Call", "_PyEval_EvalFrameDefault", "PyObject_Call", "cext", "_PyEval_EvalFrameDefault",
              "leaf")
    runs = [("run (g.py:1)",), ("cb (g.py:9)",)]
    assert splice(native, runs) == ("_start", "_PyEval_EvalFrameDefault", "green_switch", "g_switch",
                                    "g_initialstub", "PyObject_Call", "run (g.py:1)", "PyObject_Call", "cext",
                                    "cb (g.py:9)", "leaf")
    # as many runs as loops: the plain splice; runs matching neither: Python on top
    runs3 = [("a (g.py:1)",), ("b (g.py:2)",), ("c (g.py:3)",)]
    assert splice(native, runs3)[1] == "a (g.py:1)"
    runs4 = runs3 + [("d (g.py:4)",)]
    assert splice(native, runs4) == ("a (g.py:1)", "b (g.py:2)", "c (g.py:3)", "d (g.py:4)", "leaf")


def test_splice_of_a_native_stack_cut_short_keeps_the_c_frames_between_inner_runs() -> None:
    native = ("[truncated: depth limit]", "builtin_sorted", "list_sort", "_PyEval_EvalFrameDefault",
              "builtin_sorted", "list_sort", "_PyEval_EvalFrameDefault", "_PyLong_Add")
    runs = [("<module> (d.py:12)", "level (d.py:9)"), ("lambda (d.py:9)", "level (d.py:9)"),
            ("lambda (d.py:9)", "level (d.py:9)"), ("lambda (d.py:9)", "leaf (d.py:4)")]
    assert splice(native, runs) == (
        "<module> (d.py:12)", "level (d.py:9)", "lambda (d.py:9)", "level (d.py:9)",
        "[truncated: depth limit]", "builtin_sorted", "list_sort", "lambda (d.py:9)", "level (d.py:9)",
        "builtin_sorted", "list_sort", "lambda (d.py:9)", "leaf (d.py:4)", "_PyLong_Add")
    # not cut: the loops that do not match go, Python on top as before
    assert splice(native[1:], runs)[-2:] == ("leaf (d.py:4)", "_PyLong_Add")
    assert "list_sort" not in splice(native[1:], runs)


def _splice_reference(native: tuple[str, ...], runs: list[tuple[str, ...]]) -> tuple[str, ...]:
    """splice as its docstring says it, frame by frame."""
    from flamed.sampling.pystack import EVAL_FRAME, native_below_interpreter

    if not runs:
        return native
    # Perf trampolines out: py::..., py_trampoline_evaluator, a bare [unknown] calling an evaluation loop.
    native = tuple(f for i, f in enumerate(native)
                   if not (f.startswith("py::") or f == "py_trampoline_evaluator"
                           or (f == "[unknown]" and i + 1 < len(native)
                               and native[i + 1].startswith("_PyEval_EvalFrame")
                                   and EVAL_FRAME.match(native[i + 1]) is not None)))
    loops = [i for i, f in enumerate(native) if EVAL_FRAME.match(f) and f.startswith("_PyEval_EvalFrame")]
    if len(loops) == len(runs):
        out: list[str] = []
        for i, f in enumerate(native):
            out.extend(runs[loops.index(i)] if i in loops else (f,))
        return tuple(out)
    python = tuple(f for run in runs for f in run)
    entries = [i for i, f in enumerate(native) if EVAL_FRAME.match(f)]
    if entries:
        return python + native[max(entries) + 1:]
    return python + native_below_interpreter(native)


def test_splice_matches_its_reference_on_random_stacks() -> None:
    rng = random.Random(27)
    names = ["_start", "main", "_PyEval_EvalFrameDefault", "PyEval_EvalCode", "PyObject_Call", "cext_fn",
             "[unknown]", "deflate", "_PyEval_EvalFrame", "py::f:a.py", "py_trampoline_evaluator"]
    for _ in range(20000):
        native = tuple(rng.choice(names) for _ in range(rng.randrange(0, 10)))
        runs = [tuple(f"p{j}_{k} (a.py:{k})" for k in range(rng.randrange(1, 4))) for j in range(rng.randrange(0, 4))]
        assert splice(native, runs) == _splice_reference(native, runs), (native, runs)


def test_parse_pystack_reads_the_struct_of_the_program() -> None:
    depth = 8
    codes = [0x1000, 0x2001, 0, 0, 0, 0, 0, 0]
    instrs = [10, 20, 0, 0, 0, 0, 0, 0]
    guards = [0xDEADBEEF, 7, 0, 0, 0, 0, 0, 0]
    raw = (struct.pack("<II", 2, 1) + struct.pack(f"<{depth}Q", *codes) + struct.pack(f"<{depth}I", *instrs)
           + struct.pack(f"<{depth}I", *guards))
    frames, flags, got = parse_pystack(raw, depth)
    assert frames == [(0x1000, 10), (0x2001, 20)] and flags == 1
    assert got is None  # no FLAMED_PYSTACK_GUARDED: the guards were not read, whatever the bytes say


def test_parse_pystack_gives_the_guards_the_program_read() -> None:
    """struct flamed_pystack's guard[] follows instr[]; FLAMED_PYSTACK_GUARDED
    (4) says it was filled, and is not one of the flags the caller sees."""
    depth = 4
    raw = (struct.pack("<II", 3, 4 | 2) + struct.pack("<4Q", 0x7F00, 0x7F41, 0x7F80, 0)
           + struct.pack("<4I", 1, 2, 3, 0) + struct.pack("<4I", 0x11111111, 0, 0x33333333, 0x44))
    frames, flags, guards = parse_pystack(raw, depth)
    assert frames == [(0x7F00, 1), (0x7F41, 2), (0x7F80, 3)]
    assert flags == 2 and flags == PYSTACK_READ_FAULT
    assert guards == (0x11111111, 0, 0x33333333)  # 0: that code object could not be read


class _Flaky(_Target):
    """A target whose walk from user space fails ``fails`` times first (a starting interpreter)."""

    def __init__(self, fails: list[int]) -> None:
        self.fails = fails

    def validate(self) -> Any:
        if self.fails[0] > 0:
            self.fails[0] -= 1
            return type("State", (), {"kind": "invalid", "reason": "frame code object 0x0 is unreadable"})()
        return "ready"


def test_failures_in_quick_succession_do_not_refuse_a_starting_interpreter() -> None:
    walks = PythonFrames.VALIDATE_WALKS
    fails = [5 * walks]
    refused: list[str] = []
    pf = PythonFrames(probe=lambda pid: _Flaky(fails), symbolizer_factory=lambda pid, t: _Names({}),
                      on_refused=lambda pid, code, why: refused.append(code))
    got = [pf.describe(7) for _ in range(6)]  # within microseconds: no VALIDATE_SPAN_S elapsed
    assert got[:5] == [True] * 5 and isinstance(got[5], bytes), got
    assert pf.verdict(7) == "bpf" and refused == []


class _Racing(_Target):
    """A good layout whose walks from user space mostly race a stack that changes under them:
    ``pattern`` says which walks fail, cyclically."""

    def __init__(self, pattern: list[bool]) -> None:
        self.pattern = pattern
        self.walks = 0

    def validate(self) -> Any:
        fail = self.pattern[self.walks % len(self.pattern)]
        self.walks += 1
        if fail:
            return type("State", (), {"kind": "invalid", "reason": "frame object 0x1 has type 0x2"})()
        return "ready"


def test_a_process_whose_stack_changes_under_most_walks_is_described(monkeypatch: Any) -> None:
    """Three walks of four fail (a program calling tiny functions at random): a
    walk that did not race is enough, however long the failures go on."""
    import flamed.sampling.pyframes as mod

    now = [1000.0]
    monkeypatch.setattr(mod.time, "monotonic", lambda: now[0])
    refused: list[str] = []
    target = _Racing([True] * (PythonFrames.VALIDATE_WALKS - 1) + [False])
    pf = PythonFrames(probe=lambda pid: target, symbolizer_factory=lambda pid, t: _Names({}),
                      on_refused=lambda pid, code, why: refused.append(code))
    assert isinstance(pf.describe(7), bytes)
    assert pf.verdict(7) == "bpf" and refused == [] and target.walks == PythonFrames.VALIDATE_WALKS


def test_a_layout_that_keeps_failing_is_refused_once_the_span_has_passed(monkeypatch: Any) -> None:
    import flamed.sampling.pyframes as mod

    now = [1000.0]
    monkeypatch.setattr(mod.time, "monotonic", lambda: now[0])
    refused: list[str] = []
    pf = PythonFrames(probe=lambda pid: _Flaky([10**6]), symbolizer_factory=lambda pid, t: _Names({}),
                      on_refused=lambda pid, code, why: refused.append(code))
    for _ in range(10):
        assert pf.describe(7) is True
    now[0] += PythonFrames.VALIDATE_SPAN_S
    assert pf.describe(7) is None
    assert pf.verdict(7) == "invalid_layout" and refused == ["invalid_layout"]
