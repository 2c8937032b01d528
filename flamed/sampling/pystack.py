"""Python frames among native ones: what both sources of Python frames share.

The BPF walker's frames (:mod:`flamed.sampling.pyframes`) and py-spy's
(:mod:`flamed.pyspy`) name files alike and go in the same place of a native
stack, so a process gives the same frames whichever source read it.  Kept
apart from both so that neither depends on the other.
"""

from __future__ import annotations

import re

from flamed.model import Stack

#: Interpreter frames that Python frames replace (py-spy --native does the same).
#: Not their PLT stubs (``_PyEval_EvalFrameDefault@plt``, a leaf about to enter one).
EVAL_FRAME = re.compile(
    r"^(_PyEval_EvalFrameDefault|_PyEval_EvalFrame|PyEval_EvalFrameEx|PyEval_EvalFrame|"
    r"_PyEval_Vector|PyEval_EvalCode|_PyEval_EvalCode|_PyEval_EvalCodeWithName)(?=$|[^\w@])"
)
_LIB_PREFIX = re.compile(r"^.*/(?:site|dist)-packages/|^.*/lib/python3\.\d+t?/")


def short_filename(path: str) -> str:
    """``/usr/lib/python3.11/json/decoder.py`` -> ``json/decoder.py`` (py-spy's short names)."""
    return _LIB_PREFIX.sub("", path, count=1)


def native_below_interpreter(user_stack: Stack) -> Stack:
    """The native frames a Python frame caused: those below the innermost eval frame.

    Without an eval frame (the usual case when the interpreter has no frame
    pointers, so BPF only walks the leaf), the whole native stack is kept,
    minus the ``[unknown]`` frames a broken walk leaves at its root end.
    """
    last = -1
    for i, f in enumerate(user_stack):
        if EVAL_FRAME.match(f):
            last = i
    if last >= 0:
        return user_stack[last + 1:]
    i = 0
    while i < len(user_stack) - 1 and user_stack[i].startswith("[unknown]"):
        i += 1
    return user_stack[i:]
