"""A module's top level sampled while it runs, then freed, its address taken
by another code object before the profiler names it.

usage: freed_code.py DIR SPIN_S AFTER_S

Writes DIR/spun_module.py and imports it: its top level spins on the CPU for
SPIN_S seconds.  Once the import is done its code object is freed; code
objects of the same size made right after (from the same source, as
``decoy_N.py``, never run) take its memory.  Then ``after_import`` spins for
AFTER_S seconds, so that the profiler names the import's samples while the
process still runs.  Writes DIR/reused: "1" when a decoy took the module
code object's address (a frame named ``decoy_N.py`` is then a wrong name:
no decoy ever runs), "0" otherwise.
"""

import os
import sys
import time

SOURCE = """import sys
import time
CODE_ID = id(sys._getframe().f_code)
t = time.monotonic()
while time.monotonic() - t < SPIN_S:
    pass
"""


def after_import(deadline: float) -> int:
    n = 0
    while time.monotonic() < deadline:
        n += 1
    return n


def main() -> None:
    where, spin, after = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
    sys.dont_write_bytecode = True
    source = SOURCE.replace("SPIN_S", repr(spin))
    with open(os.path.join(where, "spun_module.py"), "w") as f:
        f.write(source)
    sys.path.insert(0, where)
    import spun_module  # noqa: PLC0415 -- its top level is the point

    decoys = [compile(source, f"decoy_{i}.py", "exec") for i in range(2000)]
    reused = any(id(c) == spun_module.CODE_ID for c in decoys)
    with open(os.path.join(where, "reused"), "w") as f:
        f.write("1" if reused else "0")
    after_import(time.monotonic() + after)


if __name__ == "__main__":
    main()
