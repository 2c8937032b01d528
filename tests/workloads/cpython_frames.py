"""A Python process with three threads blocked at known nestings of functions,
for the CPython frame reader's tests (tests/integration/test_cpython_walk.py).

Usage: python cpython_frames.py TRUTH.json

Once every thread is blocked it writes its own ground truth (each thread's
frames from sys._current_frames(), innermost first, with line numbers, plus
threading.get_native_id() and get_ident()) atomically to TRUTH.json and keeps
waiting until killed.  Runs on CPython 3.8 and later.
"""

import json
import os
import sys
import threading
import time
import traceback

STOP = threading.Event()
READY = []


def _name(code):
    return getattr(code, "co_qualname", code.co_name)


def _block(ready):
    ready.set()
    STOP.wait()


class Outer:
    def method(self, ready):
        def nested():
            _block(ready)

        nested()


def größe(ready):
    return (lambda: [_block(ready) for _ in range(1)])()


def a_function_with_a_very_long_name_xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx(ready):
    _block(ready)


def _start(target):
    ready = threading.Event()
    READY.append(ready)
    t = threading.Thread(target=target, args=(ready,), daemon=True)
    t.start()
    return t


def _snapshot(skip):
    out = {}
    for ident, frame in sys._current_frames().items():
        if ident == skip:
            continue
        frames = []
        f = frame
        while f is not None:
            frames.append([_name(f.f_code), f.f_code.co_filename, f.f_lineno])
            f = f.f_back
        out[ident] = frames
    return out


def _settled(snap):
    # Every thread's innermost frame is inside threading's wait (blocked on a lock).
    return all(frames and frames[0][0].endswith("wait") and frames[0][1].endswith("threading.py")
               for frames in snap.values())


def _write_truth(path, natives):
    me = threading.get_ident()
    for r in READY:
        r.wait(30)
    prev = None
    for _ in range(3000):
        snap = _snapshot(me)
        if len(snap) == 4 and _settled(snap) and snap == prev:
            break
        prev = snap
        time.sleep(0.01)
    else:
        sys.exit("threads did not settle")
    threads = []
    for ident, frames in snap.items():
        threads.append({"ident": ident, "native_id": natives.get(ident), "frames": frames})
    truth = {
        "pid": os.getpid(),
        "version": list(sys.version_info[:2]),
        "main_ident": MAIN_IDENT,
        "threads": threads,
        "stack_summary": {str(i): [list(fs)[:3] for fs in traceback.extract_stack(sys._current_frames()[i])]
                          for i in snap},
    }
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(truth, f, ensure_ascii=False)
    os.rename(tmp, path)


MAIN_IDENT = threading.get_ident()
NATIVES = {MAIN_IDENT: threading.get_native_id()}


def _register(target):
    def run(ready):
        NATIVES[threading.get_ident()] = threading.get_native_id()
        target(ready)
    run.__name__ = run.__qualname__ = target.__name__ + "_thread"
    return run


if __name__ == "__main__":
    _start(_register(Outer().method))
    _start(_register(größe))
    _start(_register(a_function_with_a_very_long_name_xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx))
    threading.Thread(target=_write_truth, args=(sys.argv[1], NATIVES), daemon=True).start()
    STOP.wait()
